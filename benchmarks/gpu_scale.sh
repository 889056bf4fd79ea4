#!/usr/bin/env bash
# Scale-out evidence on one host with 4 GPUs (nvidia-h100-x4), after ../shared/device/stage.sh's two transfers (the
# model at /root/smollm2/model.gguf, its tokenizer files beside it). Results under $OUT.
#   bash benchmarks/gpu_scale.sh scaling   # weak scaling at 1, 2, 4 GPUs + one GPU at the 4-GPU batch (MAKE7B=1: the
#                                          # random Qwen2.5-7B-shaped model is written meanwhile, for the next call)
#   bash benchmarks/gpu_scale.sh large     # that 7B model on 4 GPUs, then the Qwen2.5-3B shape on one GPU
#   bash benchmarks/gpu_scale.sh profile   # rollout batch 3 of the weak-scaling run under torch.profiler
#                                          # (log.profile_batch) at 1 and 4 GPUs: stage tables and traces to $OUT
# Runs and models go to /dev/shm or /root (a 7B checkpoint is ~120 GB of DCP shards and HF export), never under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
M=/root/smollm2/model.gguf
W=/dev/shm/gspo  # in memory when it has room for a 7B checkpoint, else on the disk
[ "$(df --output=avail -B1G /dev/shm | tail -1)" -gt 200 ] || W=/root/gspo-work
mkdir -p $W
nvidia-smi -L
df -h /dev/shm /root | tail -2; echo "work dir $W"
make() { python3 benchmarks/large_model.py --shape $1 --models $W/models --tokenizer ${TOK:-/root/smollm2} --make-only; }
case "$1" in
scaling)
  [ -n "${MAKE7B-}" ] && { CUDA_VISIBLE_DEVICES=3 make qwen2.5-7b > $OUT/make_7b.log 2>&1 & }
  # 40 rollout batches: the reference run's 160 optimizer steps, over which the few batches that capture CUDA graphs
  # of the update for a new packed size are amortised as in a user's run (BATCHES=12 was the earlier leases' setting)
  python3 benchmarks/scaling.py --gpus ${GPUS:-1,2,4} --batches ${BATCHES:-40} ${EQUAL---equal-batch} \
    --out $W/scaling/${NAME:-scaling}.json model.name="'$M'" 2>&1 | grep -v "Warn\|warn("
  # one archive: a call brings back only a few files
  (cd $W && tar czf $OUT/${NAME:-scaling}.tgz scaling/*.json scaling/scaling-runs/*/{metrics.jsonl,config.json,timings.json})
  wait; [ -n "${MAKE7B-}" ] && tail -2 $OUT/make_7b.log
  ;;
profile)
  for n in ${GPUS:-1 4}; do
    python3 -m gspo.cli train configs/quickstart.toml model.name="'$M'" rollout.prompts_per_batch=$((32 * n)) \
      train.steps=16 log.checkpoint_every=0 log.progress=false log.profile_batch=3 --run-dir $W/profile-$n --nproc $n \
      2>&1 | grep -v "Warn\|warn(\|USDT" | tail -3
    grep -A32 "^stage" $W/profile-$n/profile/rank0.txt
  done
  (cd $W && tar czf $OUT/profiles.tgz profile-*/profile/*.txt profile-*/profile/rank[01].trace.json.gz profile-*/metrics.jsonl)
  ls -la $OUT
  ;;
large)
  for spec in ${SPECS:-qwen2.5-7b:4 qwen2.5-3b:1}; do
    shape=${spec%:*}; gpus=${spec#*:}
    python3 benchmarks/large_model.py --shape $shape --gpus $gpus --models $W/models --tokenizer ${TOK:-/root/smollm2} \
      --out $W/large/${shape}_${gpus}gpu.json ${EXTRA:-} 2>&1 | grep -v "Warn\|warn(" | tail -25
    mkdir -p $OUT/large && cp $W/large/${shape}_${gpus}gpu.json $OUT/large/
    r=$W/large/run-$shape-${gpus}gpu
    mkdir -p $OUT/large/run-$shape-${gpus}gpu
    cp $r/metrics.jsonl $r/config.json $r/timings.json $OUT/large/run-$shape-${gpus}gpu/ 2>/dev/null
    du -sh $r/checkpoints 2>/dev/null
    rm -rf $r
  done
  ;;
esac
