#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md, on any machine with CUDA GPUs and this tree's Python environment:
#
#   bash benchmarks/run_on_gpu.sh COMMAND MODEL OUT [key=value ...]
#
# MODEL is anything `model.name` takes: an HF directory or hub id, a .gguf file, or `smollm2-135m-instruct` (the model
# embedded in gspo, the reference model of every table). OUT is created; every run directory, log and JSON of the
# command lands under it (set WORK to put checkpoints and random models elsewhere: a 7B checkpoint is ~120 GB).
# key=value arguments are passed to every `gspo train` / `gspo compare` the command starts.
#
# Commands (environment variables in brackets, defaults after =):
#   tests         the GPU tests (tests/test_gpu.py and the engine tests) on the visible GPUs [K: a pytest -k expression]
#   e2e           the reference run end to end: gspo's algorithms, then the table [ALGOS=gspo,grpo]; with
#                 TRL_SCRIPT=path, TRL's GRPOTrainer on the same settings first [TRL_LEVELS=sequence]
#   startup       where the reference run's seconds go: the bare import cost, the run three times (first process,
#                 warm caches, a checkpoint every 10 batches), `gspo eval` of the result and a `gspo probe noise` smoke
#   rollout       rollout throughput: the engines on MODEL and on a Qwen2.5-0.5B-shaped model, a decode step's cost by
#                 rows, and the reference rollout with and without row compaction
#   update        the policy update's speed and peak memory on MODEL and the Qwen2.5-0.5B shape
#   profile       a decode step (fused and HF-module step) and a short training run under the profilers
#   scaling       weak scaling of the reference run under torchrun [GPUS=1,2,4 BATCHES=40 ROUNDS=1; EQUAL=1 adds one
#                 GPU at the largest batch in the last round]
#   ab            scaling rounds of this tree and of the older tree in directory BASE, alternating (e.g. BASE from
#                 `git worktree add`) [BASE GPUS ROUNDS BATCHES]
#   cards         one-GPU runs on every card at once, then the all-GPU job [ROUNDS=2 BATCHES=40]
#   profile-dist  rollout batch 3 of the scaling run under torch.profiler on every process [GPUS=1,4]
#   collectives   the gradient all-reduce's time and bandwidth over every visible GPU, and the gather's pickling on
#                 the CPU
#   large         full fine-tuning of random models of real shapes [SPECS="qwen2.5-7b:4 qwen2.5-3b:1"; the tokenizer
#                 of MODEL's directory, else gspo's embedded one]
#   lora          LoRA against full fine-tuning: memory and update speed, then reward runs side by side [STEPS=32]
#   moe-upcycle   function preservation of the upcycle on MODEL, then `gspo upcycle` to OUT/moe-model
#                 [STEPS=700 LR=3e-4]
#   moe-compare   the seeds' MoE experiment on OUT/moe-model (or MOE_MODEL) [ARMS=gspo,grpo,grpo+r2,grpo+r3,gspo+r2
#                 SEEDS=1,2,3 TRAIN_STEPS=300 JOBS=8]
#   moe-bench     the update's passes and the rollout engines on random MoE models of the upcycle's shapes
#   experiments   the `gspo compare` commands of configs/experiments/ [EXPERIMENTS="depth engine length rollback"
#                 SEEDS=1,2,3 JOBS=8]
#
# A command that stops (SECS seconds, a lost machine) is resumed by running it again: `gspo compare` keeps finished
# runs and continues the others from their checkpoints. Every table of benchmarks/README.md names the command here
# that measures it.
set -uo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
[ $# -ge 3 ] || usage
CMD=$1 MODEL=$2 OUT=$3
shift 3
OVERRIDES=("$@")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$OUT/work}
mkdir -p "$WORK"
PY=${PYTHON:-python3}
# the tree's own code, whatever is installed; one CPU thread per process unless the caller chose (a busy host's
# default threads slowed one-GPU runs by up to 2x: benchmarks/README.md#scale-out)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
M="model.name='$MODEL'"
cd "$ROOT"
nvidia-smi -L 2>/dev/null | tee "$OUT/cards.txt"

gpu_tests() {  # output file, pytest arguments...
  local out=$1; shift
  $PY -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -15 | tee "$out"
}

scaling() {  # tree, name, extra scaling.py options...
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH="$tree/src" $PY benchmarks/scaling.py --gpus "${GPUS:-1,2,4}" --batches "${BATCHES:-40}" \
    "$@" --out "$OUT/$name/scaling.json" "$M" ${OVERRIDES[@]+"${OVERRIDES[@]}"} 2>&1 | tee "$OUT/$name.log")
}

case "$CMD" in
tests)
  gpu_tests "$OUT/gpu_tests.txt" tests/test_gpu.py tests/test_fused_decode.py tests/test_graph_engine.py \
    tests/test_rollout.py tests/test_logprobs.py ${K:+-k "$K"}
  ;;
e2e)
  mkdir -p "$OUT/e2e"
  if [ -n "${TRL_SCRIPT-}" ]; then
    $PY benchmarks/e2e_reference.py trl --script "$TRL_SCRIPT" --model "$MODEL" --levels "${TRL_LEVELS:-sequence}" \
      --out "$OUT/e2e"
  fi
  $PY benchmarks/e2e_reference.py run --model "$MODEL" --algos "${ALGOS:-gspo,grpo}" --out "$OUT/e2e" \
    --scratch "$WORK/e2e" log.progress=false "$@"
  $PY benchmarks/e2e_reference.py table "$OUT/e2e" | tee "$OUT/e2e/table.md"
  ;;
startup)
  mkdir -p "$OUT/e2e"
  for i in 1 2; do /usr/bin/time -f "bare import of torch + transformers + AutoModelForCausalLM: %e s" \
    $PY -c "import torch, transformers; from transformers import AutoModelForCausalLM"; done 2>&1 | tail -1 \
    | tee "$OUT/imports.txt"
  # the first run is the machine's first process: the model cache and Triton's kernel cache start cold
  for tag in _cold _warm; do
    $PY benchmarks/e2e_reference.py run --model "$MODEL" --algos gspo --tag $tag --out "$OUT/e2e" \
      --scratch "$WORK/e2e" log.progress=false "$@"
  done
  $PY benchmarks/e2e_reference.py run --model "$MODEL" --algos gspo --tag _ckpt10 --out "$OUT/e2e" \
    --scratch "$WORK/e2e" log.progress=false log.checkpoint_every=10 "$@"
  $PY -m gspo.cli eval configs/quickstart.toml --model "$WORK/e2e/gspo_warm/checkpoints/step-000160" --n 128 \
    --samples 2 --out "$OUT/eval_trained.json" | tee "$OUT/eval_trained.txt"
  $PY -m gspo.cli probe noise configs/quickstart.toml --out "$WORK/probe" --rows 16 --bins 3 "$M" 2>&1 | tail -8 \
    | tee "$OUT/probe_smoke.txt"
  $PY benchmarks/e2e_reference.py table "$OUT/e2e" | tee "$OUT/e2e/table.md"
  ;;
rollout)
  $PY benchmarks/rollout.py --model "$MODEL" --out "$OUT/rollout.json"
  $PY benchmarks/rollout.py --model qwen2.5-0.5b-shape --new 128 --batches 256,512 --baselines none \
    --out "$OUT/rollout_qwen.json"
  $PY benchmarks/rollout.py --model "$MODEL" --batches 8,16,32,64,128,256 --new 128 --baselines none \
    --out "$OUT/rollout_steps.json"
  $PY benchmarks/rollout_tail.py --model "$MODEL" --out "$OUT/rollout_tail.json"
  ;;
update)
  $PY benchmarks/train_step.py --model "$MODEL" --out "$OUT/train_step.json"
  $PY benchmarks/train_step.py --model qwen2.5-0.5b-shape --batch 32 --out "$OUT/train_step_qwen.json"
  ;;
profile)
  for flags in "" --no-fused; do $PY benchmarks/profile_step.py --model "$MODEL" --batch 512 $flags; done 2>&1 \
    | tee "$OUT/profile_step.txt"
  $PY benchmarks/profile_train.py --model "$MODEL" --out "$OUT/profile_train.txt"
  ;;
scaling)
  n=${ROUNDS:-1}
  for i in $(seq "$n"); do
    equal=; [ "$i" = "$n" ] && [ "${EQUAL:-0}" = 1 ] && equal=--equal-batch
    scaling "$ROOT" "round$i" $equal
  done
  $PY benchmarks/scaling.py --summarize "$OUT"/round*/scaling-runs/* --out "$OUT/all.json" | tee "$OUT/all.txt"
  ;;
ab)
  [ -d "${BASE-}/benchmarks" ] || { echo "ab: BASE must be a directory holding the older tree" >&2; exit 2; }
  BASE=$(cd "$BASE" && pwd)
  # alternating, so that a machine that drifts during the lease drifts for both trees alike
  for i in $(seq "${ROUNDS:-1}"); do
    scaling "$ROOT" "new_$i"
    scaling "$BASE" "base_$i"
  done
  for tree in new base; do
    $PY benchmarks/scaling.py --summarize "$OUT"/${tree}_*/scaling-runs/* --out "$OUT/$tree.json" | tee "$OUT/$tree.txt"
  done
  ;;
cards)
  cards=$(nvidia-smi -L | wc -l)
  [ "$cards" -gt 0 ] || { echo "cards: no GPU visible" >&2; exit 1; }
  for i in $(seq "${ROUNDS:-2}"); do
    # every card at once: the host as loaded as under the all-GPU job
    for k in $(seq 0 $((cards - 1))); do
      CUDA_VISIBLE_DEVICES=$k $PY benchmarks/scaling.py --gpus 1 --batches "${BATCHES:-40}" \
        --out "$OUT/r$i/card$k/scaling.json" "$M" "$@" > "$OUT/r${i}_card$k.log" 2>&1 &
    done
    wait
    $PY benchmarks/scaling.py --gpus "$cards" --batches "${BATCHES:-40}" --out "$OUT/r$i/gpus$cards/scaling.json" "$M" \
      "$@" 2>&1 | tee "$OUT/r${i}_gpus$cards.log"
  done
  ;;
profile-dist)
  for n in $(echo "${GPUS:-1,4}" | tr , ' '); do
    $PY -m gspo.cli train configs/quickstart.toml "$M" rollout.prompts_per_batch=$((32 * n)) train.steps=16 \
      log.checkpoint_every=0 log.progress=false log.profile_batch=3 "$@" --run-dir "$OUT/profile-$n" --nproc "$n"
    # the gradient all-reduce's overlap with compute: only a job of several processes has one
    [ "$n" -gt 1 ] && $PY benchmarks/trace_steps.py "$OUT/profile-$n/profile/rank0.trace.json.gz" \
      --out "$OUT/profile-$n/trace_steps.json" > "$OUT/profile-$n/trace_steps.txt"
  done
  ;;
collectives)
  n=$(nvidia-smi -L | wc -l)
  $PY -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/allreduce.py 134.5e6 1e9 \
    | tee "$OUT/allreduce.txt"
  $PY benchmarks/gather_pickle.py --world "$n" --out "$OUT/gather_pickle.json"
  ;;
large)
  tok=$(dirname "$MODEL")
  [ -f "$tok/tokenizer.json" ] || tok=$ROOT/src/gspo/assets/smollm2-135m-instruct
  for spec in ${SPECS:-qwen2.5-7b:4 qwen2.5-3b:1}; do
    shape=${spec%:*} gpus=${spec#*:}
    $PY benchmarks/large_model.py --shape "$shape" --gpus "$gpus" --models "$WORK/models" --tokenizer "$tok" \
      --out "$OUT/large/${shape}_${gpus}gpu.json" "$@"
  done
  ;;
lora)
  gpu_tests "$OUT/gpu_test_lora.txt" tests/test_gpu.py -k lora
  tok=$(dirname "$MODEL")
  [ -f "$tok/tokenizer.json" ] || tok=$ROOT/src/gspo/assets/smollm2-135m-instruct
  for rank in 0 32; do
    $PY benchmarks/large_model.py --model "$MODEL" --gpus 1 --prompts-per-gpu 32 --micro-batch 0 --no-checkpointing \
      --batches 4 --tag=-r$rank --models "$WORK/models" --out "$OUT/smollm2_r$rank.json" lora.rank=$rank
    $PY benchmarks/large_model.py --shape qwen2.5-1.5b --gpus 1 --models "$WORK/models" --tokenizer "$tok" \
      --batches 3 --tag=-r$rank --out "$OUT/qwen1.5b_r$rank.json" lora.rank=$rank
  done
  train() {  # name, overrides...
    local name=$1; shift
    $PY -m gspo.cli train configs/quickstart.toml "$M" log.progress=false log.checkpoint_every=0 \
      train.steps="${STEPS:-32}" "$@" --run-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"
  }
  # side by side on one GPU; LoRA at 10x the learning rate, alpha 32 at every rank ("LoRA Without Regret")
  train full "$@" & train r32 lora.rank=32 train.lr=5e-5 "$@" & train r1 lora.rank=1 train.lr=5e-5 "$@" &
  wait
  ;;
moe-upcycle)
  $PY benchmarks/moe_check.py "$MODEL" "$OUT/function_preservation.json"
  $PY -m gspo.cli upcycle configs/quickstart.toml "$M" --out "$OUT/moe-model" --experts 8 --top-k 2 --drop 0.5 \
    --distill-steps "${STEPS:-700}" --distill-batch 32 --distill-lr "${LR:-3e-4}" --eval-n 200
  ;;
moe-compare)
  moe=${MOE_MODEL:-$OUT/moe-model}
  ${SECS:+timeout -s TERM $SECS} $PY -m gspo.cli compare configs/quickstart.toml model.name="'$moe'" \
    log.progress=false log.checkpoint_every="${CKPT:-10}" log.keep_checkpoints=1 train.steps="${TRAIN_STEPS:-300}" \
    "$@" --algos "${ARMS:-gspo,grpo,grpo+r2,grpo+r3,gspo+r2}" --seeds "${SEEDS:-1,2,3}" --jobs "${JOBS:-8}" \
    --out "$OUT/moe-compare"
  ;;
moe-bench)
  $PY benchmarks/moe_passes.py --rows 64 --tokens 128 --out "$OUT/moe_passes.json"
  $PY benchmarks/moe_decode.py --rows 512 --tokens 128 --out "$OUT/moe_decode.json"
  ;;
experiments)
  A=configs/experiments/arithmetic.toml
  compare() {  # name, config, arms, overrides...
    local name=$1 config=$2 arms=$3; shift 3
    ${SECS:+timeout -s TERM $SECS} $PY -m gspo.cli compare "$config" "$M" "$@" --algos "$arms" \
      --seeds "${SEEDS:-1,2,3}" --jobs "${JOBS:-8}" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
  }
  for e in ${EXPERIMENTS:-depth engine length rollback}; do
    case $e in
    depth) compare depth $A gspo,grpo,gspo+mb8,grpo+mb8,gspo+mb16,grpo+mb16,gspo+lr5e-5,grpo+lr5e-5 "$@" ;;
    engine) compare engine $A gspo+enginelp,grpo+enginelp,gspo+int8,grpo+int8,gspo+int8+enginelp,grpo+int8+enginelp "$@" ;;
    length) compare length configs/experiments/numbered_words.toml gspo,grpo,dapo,gspo_token+credit "$@" ;;
    # the arms that collapsed in the engine experiment, with the sentinel's reward-drop detector and rollback on
    rollback) compare rollback $A gspo+int8+enginelp,grpo+int8+enginelp sentinel.action="'rollback'" \
                sentinel.reward_drop=0.3 log.checkpoint_every=5 log.keep_checkpoints=3 "$@" ;;
    timing) SEEDS=1 JOBS=1 compare timing $A gspo,gspo+enginelp,grpo,grpo+enginelp train.steps=40 "$@" ;;
    *) echo "unknown experiment $e" >&2; exit 2 ;;
    esac
  done
  $PY benchmarks/experiments_summary.py $(for e in ${EXPERIMENTS:-depth engine length rollback}; do echo "$OUT/$e"; done) \
    --out "$OUT/experiments_summary.json" | tee "$OUT/experiments_summary.md"
  ;;
*)
  usage
  ;;
esac
