#!/usr/bin/env bash
# LoRA evidence on one GPU, after ../shared/device/stage.sh's transfers (the model at /root/smollm2/model.gguf, its
# tokenizer files beside it; peft from the GPU image). Results under $OUT.
#   bash benchmarks/gpu_lora.sh tests     # tests/test_gpu.py's LoRA test
#   bash benchmarks/gpu_lora.sh speed     # memory and update speed: full fine-tuning vs LoRA rank 32, SmolLM2-135M
#                                         # (reference batch) and the Qwen2.5-1.5B shape (random weights)
#   bash benchmarks/gpu_lora.sh reward    # reward curves on the reference task: full (lr 5e-6) vs rank 32 and rank 1
#                                         # (lr 5e-5, ~10x as peers advise), run side by side on the one GPU
#   bash benchmarks/gpu_lora.sh threads   # the reference run on one GPU with torch's default CPU threads and with 1
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
M=/root/smollm2/model.gguf
W=/root/gspo-lora
mkdir -p $W $OUT/lora
python3 -c "import peft, torch; print('peft', peft.__version__, torch.cuda.get_device_name(0))"
for part in "$@"; do
  case $part in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k lora 2>&1 | tail -4 | tee $OUT/lora/gpu_test.txt ;;
  speed)
    for rank in 0 32; do
      python3 benchmarks/large_model.py --model $M --gpus 1 --prompts-per-gpu 32 --micro-batch 0 --no-checkpointing \
        --batches 4 --tag=-r$rank --out $W/smollm2_r$rank.json lora.rank=$rank 2>&1 | grep -v "Warn\|warn(" | tail -3
      python3 benchmarks/large_model.py --shape qwen2.5-1.5b --gpus 1 --models $W/models --tokenizer /root/smollm2 \
        --batches 3 --tag=-r$rank --out $W/qwen1.5b_r$rank.json lora.rank=$rank 2>&1 | grep -v "Warn\|warn(" | tail -3
    done
    cp $W/*.json $OUT/lora/ ;;
  reward)
    steps=${STEPS:-80}
    run() {  # name, overrides...
      local name=$1; shift
      python3 -m gspo.cli train configs/quickstart.toml model.name="'$M'" log.progress=false log.checkpoint_every=0 \
        train.steps=$steps "$@" --run-dir $W/$name > $W/$name.log 2>&1
      echo "$name exit $?"
    }
    run full &
    run r32 lora.rank=32 train.lr=5e-5 &
    run r1 lora.rank=1 train.lr=5e-5 &  # alpha 32 at every rank, as "LoRA Without Regret" (Thinking Machines) does
    wait
    grep -h "LoRA:\|CUDA graphs\|rollout engine" $W/r32.log | head -4
    (cd $W && tar czf $OUT/lora/reward_runs.tgz {full,r32,r1}/{metrics.jsonl,config.json,timings.json})
    for n in full r32 r1; do
      python3 - $W/$n/metrics.jsonl $n <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
first = [r for r in rows if r["minibatch"] == 0]
print(sys.argv[2], "steps", len(rows), "reward by batch", [round(r["reward/mean"], 3) for r in first][::2],
      "loop s", round(rows[-1]["time/elapsed"], 1))
PY
    done ;;
  threads)  # the one-process reference run with torch's default CPU threads and with one, as torchrun sets
    for n in default 1; do
      if [ $n = default ]; then env -u OMP_NUM_THREADS python3 benchmarks/scaling.py --gpus 1 --batches 8 \
          --out $W/threads_$n/scaling.json model.name="'$M'" 2>&1 | tail -1
      else OMP_NUM_THREADS=1 python3 benchmarks/scaling.py --gpus 1 --batches 8 --out $W/threads_$n/scaling.json \
          model.name="'$M'" 2>&1 | tail -1; fi
      cp $W/threads_$n/scaling.json $OUT/lora/threads_$n.json
    done ;;
  esac
done
