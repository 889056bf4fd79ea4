#!/usr/bin/env bash
# MoE evidence on one GPU, after ../shared/device/stage.sh's two transfers (the model at /root/smollm2/model.gguf).
#   bash benchmarks/gpu_moe.sh upcycle   # function preservation on the real model, then gspo upcycle (8 x top-2)
#   ARMS='gspo grpo grpo+r2' bash benchmarks/gpu_moe.sh train   # arms on the upcycled model, concurrently, time-boxed
#   SECS=480 bash benchmarks/gpu_moe.sh compare   # the experiment: gspo compare --jobs 8 (2 runs per GPU of 4: 3 ran out
#                                                 # of memory), stopped after SECS
#                                                 # with checkpoints (the same command again resumes it)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
MOE=/root/smollm2-moe
nvidia-smi -L
case "$1" in
upcycle)
  [ -n "${CHECK-1}" ] && python3 benchmarks/moe_check.py $M $OUT/function_preservation.json 2>&1 | grep "moe_check\|rror"
  python3 -m gspo.cli upcycle configs/quickstart.toml model.name="'$M'" --out $MOE --experts 8 --top-k 2 \
    --drop 0.5 --distill-steps ${STEPS:-300} --distill-batch 32 --distill-lr ${LR:-1e-4} --eval-n 200 2>&1 \
    | grep -v "Loading weights\|Writing model" | tail -40
  cp $MOE/upcycle.json $OUT/
  ;;
train)
  secs=${SECS:-500}
  run() {  # name, overrides...
    local name=$1; shift
    timeout $secs python3 -m gspo.cli train configs/quickstart.toml model.name="'$MOE'" log.progress=false \
      log.checkpoint_every=0 train.steps=${TRAIN_STEPS:-200} "$@" --run-dir /tmp/moe/$name > /tmp/moe-$name.log 2>&1
    echo "$name exit $?"
  }
  mkdir -p /tmp/moe
  arms=${ARMS:-"gspo grpo grpo+r2"}
  for arm in $arms; do  # preset[+r2|+r3], as gspo compare names arms
    replay=off; case $arm in *+r2) replay=old;; *+r3) replay=rollout;; esac
    run ${arm/+/_} algorithm="'${arm%%+*}'" moe.routing_replay="'$replay'" &
  done
  wait
  for n in ${arms//+/_}; do
    grep "MoE:\|rollout engine\|CUDA graphs\|rror" /tmp/moe-$n.log | head -5
    mkdir -p $OUT/$n && cp /tmp/moe/$n/metrics.jsonl /tmp/moe/$n/config.json $OUT/$n/ 2>/dev/null
    python3 - $n <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"/tmp/moe/{sys.argv[1]}/metrics.jsonl")]
flips = [r["moe/flip_rate"] for r in rows if r.get("moe/flip_rate") is not None]
print(sys.argv[1], "steps", len(rows), "reward first/last", rows[0]["reward/mean"], rows[-1]["reward/mean"],
      "flip mean", sum(flips) / max(len(flips), 1), "first flips", [round(f, 4) for f in flips[:6]])
PY
  done
  ;;
compare)
  W=/dev/shm/moe-compare  # 15 runs' checkpoints (~8 GB each) are written at every stop: in memory, not on the disk
  timeout -s TERM ${SECS:-480} python3 -m gspo.cli compare configs/quickstart.toml model.name="'$MOE'" \
    log.progress=false log.checkpoint_every=${CKPT:-10} log.keep_checkpoints=1 train.steps=${TRAIN_STEPS:-300} \
    ${EXTRA:-} --algos ${ARMS:-gspo,grpo,grpo+r2,grpo+r3,gspo+r2} --seeds ${SEEDS:-1,2,3} --jobs ${JOBS:-8} \
    --out $W 2>&1 | grep -v "Warn\|warn(" | tail -40
  for d in $W/*-seed*; do
    case $d in *.incomplete-*) continue;; esac  # runs compare moved aside
    python3 - $d <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
b = [r for r in rows if r["minibatch"] == 0]
print(sys.argv[1].split("/")[-1], "step", rows[-1]["step"], "reward first/last", round(b[0]["reward/mean"], 3),
      round(b[-1]["reward/mean"], 3), "peak GiB", round(max(r.get("memory/peak_gib", 0) for r in rows), 1),
      "s/batch", round((b[-1]["time/elapsed"] - b[0]["time/elapsed"]) / max(1, len(b) - 1), 2))
PY
  done
  tail -n 3 $W/logs/*.log | grep -i "error" | head
  tar czf $OUT/moe_compare.tgz -C $W --exclude=checkpoints .
  ;;
esac
