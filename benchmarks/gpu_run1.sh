#!/usr/bin/env bash
# One device call after ../shared/device/stage.sh's first transfer: GPU tests, the reference run twice (cold, then warm
# GGUF cache) with its timings, and the training-loop profile. Everything lands in $OUT/results.tgz.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
nvidia-smi -L | tee $OUT/card.txt
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_decode.py tests/test_graph_engine.py \
  tests/test_rollout.py 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
for run in cold warm; do
  python3 benchmarks/e2e_reference.py run --model $M --algos gspo --out $OUT/e2e_$run --scratch /tmp/e2e_$run log.progress=false \
    2>&1 | grep -v "Warn\|warn" | tail -4
  cat /tmp/e2e_$run/gspo/timings.json 2>/dev/null | tr -d '\n '; echo
done
python3 benchmarks/profile_train.py --model $M --out $OUT/profile_train.txt 2>&1 | grep -v Warn | head -6
cd $OUT && tar czf results.tgz e2e_* profile_train.txt && rm -rf e2e_* profile_train.txt
