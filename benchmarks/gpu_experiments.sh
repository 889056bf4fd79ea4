#!/usr/bin/env bash
# The seeds' claims at small scale (docs/experiments/) on every visible GPU, after ../shared/device/stage.sh's
# transfers (the model at /root/smollm2/model.gguf, its tokenizer beside it). The four experiments' `gspo compare`
# commands (the ones in configs/experiments/*.toml) run at once, each spreading its runs over the GPUs, and are
# stopped after SECS with checkpoints: the same command again continues them (finished runs are kept).
#   SECS=480 bash benchmarks/gpu_experiments.sh run    # again until every run is done
#   bash benchmarks/gpu_experiments.sh pack            # the runs (no checkpoints) and logs to $OUT/experiments.tgz
#   bash benchmarks/gpu_experiments.sh timing          # old-policy pass: recompute vs the engine's log-probs, alone
#   bash benchmarks/gpu_experiments.sh rollback        # the rollback experiment alone
#   bash benchmarks/gpu_experiments.sh rest            # what the first lease left, one GPU each (4 GPUs): seeds 2 and
#       # 3 of length (GPUs 0, 1), the timing, the noise probe and the rollback experiment (GPU 2), the MoE upcycle of
#       # benchmarks/gpu_moe.sh (GPU 3; UPCYCLE= to skip); SECS-limited and resumable like run
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
W=${W:-/root/exp}
A=configs/experiments/arithmetic.toml
mkdir -p $W
compare() {  # name config jobs arms [overrides...]
  local name=$1 config=$2 jobs=$3 arms=$4
  shift 4
  timeout -s TERM ${SECS:-480} python3 -m gspo.cli compare $config model.name="'$M'" "$@" --algos $arms \
    --seeds ${SEEDS:-1,2,3} --jobs $jobs --out $W/$name >> $W/$name.log 2>&1
  echo "$name: exit $?"
}
progress() {
  python3 - $W <<'PY'
import json, pathlib, sys
for d in sorted(pathlib.Path(sys.argv[1]).glob("*/*-seed*")):
    if ".incomplete-" in d.name or not (d / "metrics.jsonl").exists():
        continue
    rows = [json.loads(l) for l in open(d / "metrics.jsonl") if l.strip()]
    b = [r for r in rows if r["minibatch"] == 0]
    if not b:
        continue
    print(f"{d.parent.name}/{d.name}: step {rows[-1]['step']} reward {b[0]['reward/mean']:.3f} -> "
          f"{sum(r['reward/mean'] for r in b[-5:]) / len(b[-5:]):.3f} len {b[-1]['completion/len_mean']:.0f} "
          f"s/batch {(b[-1]['time/elapsed'] - b[0]['time/elapsed']) / max(1, len(b) - 1):.2f} "
          f"peak {max(r.get('memory/peak_gib') or 0 for r in rows):.1f} GiB")
PY
}
nvidia-smi -L
case "${1:-}" in
run)
  compare length configs/experiments/numbered_words.toml ${LJOBS:-8} gspo,grpo,dapo,gspo_token+credit &
  compare depth $A ${JOBS:-8} gspo,grpo,gspo+mb8,grpo+mb8,gspo+mb16,grpo+mb16,gspo+lr5e-5,grpo+lr5e-5 &
  compare engine $A ${JOBS:-8} gspo+enginelp,grpo+enginelp,gspo+int8,grpo+int8,gspo+int8+enginelp,grpo+int8+enginelp &
  # the arms that collapsed in the engine experiment, with the sentinel's rollback on (its reward-drop detector)
  compare rollback $A ${RJOBS:-4} gspo+int8+enginelp,grpo+int8+enginelp sentinel.action="'rollback'" \
    sentinel.reward_drop=0.3 log.checkpoint_every=5 log.keep_checkpoints=3 &
  wait
  progress
  grep -h "failed\|rror" $W/*.log | tail -8
  ;;
pack)
  progress > $W/progress.txt
  tar czf $OUT/experiments.tgz -C $W --exclude=checkpoints .
  ls -la $OUT
  ;;
timing)  # one GPU, nothing else on it: TSTEPS steps of each, one after the other
  SECS=${SECS:-300} SEEDS=1 compare timing $A 1 gspo,gspo+enginelp,grpo,grpo+enginelp train.steps=${TSTEPS:-80}
  progress | grep timing/
  ;;
rest)
  # 4 long runs share a GPU: micro-batches of 8 sequences keep each one's update memory small (same math)
  L="configs/experiments/numbered_words.toml 4 gspo,grpo,dapo,gspo_token+credit train.micro_batch_size=8"
  CUDA_VISIBLE_DEVICES=0 SEEDS=2 compare length_s2 $L &
  CUDA_VISIBLE_DEVICES=1 SEEDS=3 compare length_s3 $L &
  if [ -n "${UPCYCLE-1}" ] && [ ! -f /root/smollm2-moe/upcycle.json ]; then
    (CUDA_VISIBLE_DEVICES=3 CHECK= STEPS=700 LR=3e-4 bash benchmarks/gpu_moe.sh upcycle > $W/upcycle.log 2>&1
     echo "upcycle: exit $?") &
  fi
  export CUDA_VISIBLE_DEVICES=2
  # alone on its GPU first: the old-policy pass with and without recomputation, 40 steps of each
  [ -d $W/timing/report ] || [ -n "${NOTIMING-}" ] || TSTEPS=40 SECS=200 bash $0 timing
  if [ ! -f $W/probe/probe_noise.json ]; then
    mkdir -p $W/probe
    timeout 300 python3 -m gspo.cli probe noise configs/experiments/numbered_words.toml model.name="'$M'" \
      --rows 128 --bins 6 --out $W/probe/probe_noise.json > $W/probe.log 2>&1
    echo "probe: exit $?"; tail -12 $W/probe.log
  fi
  bash $0 rollback
  wait
  progress
  grep -h "failed\|rror" $W/*.log | tail -8
  ;;
rollback)  # the collapse-and-rollback experiment alone (RJOBS runs at a time over the visible GPUs)
  compare rollback $A ${RJOBS:-3} gspo+int8+enginelp,grpo+int8+enginelp sentinel.action="'rollback'" \
    sentinel.reward_drop=0.3 log.checkpoint_every=5 log.keep_checkpoints=3
  progress | grep rollback/
  ;;
*)
  echo "usage: bash benchmarks/gpu_experiments.sh run|pack|timing|rest|rollback" >&2
  exit 2
  ;;
esac
