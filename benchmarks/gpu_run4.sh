#!/usr/bin/env bash
# Sanity of the final code on the GPU (after ../shared/device/stage.sh's two transfers): the GPU tests, the fault
# tests, and the reference run once on a warm model cache (a first process converts the GGUF).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
nvidia-smi -L
python3 -c "from gspo.models import load_model; load_model('$M')" >/dev/null 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_decode.py tests/test_graph_engine.py \
  tests/test_rollout.py tests/test_logprobs.py tests/test_faults.py 2>&1 | tail -3 | tee $OUT/gpu_tests_final.txt
python3 benchmarks/e2e_reference.py run --model $M --algos gspo --tag _final --out $OUT/e2e --scratch /tmp/e2e \
  log.progress=false 2>&1 | grep "e2e\]\|rror"
cat /tmp/e2e/gspo_final/timings.json | tr -d '\n '; echo
python3 benchmarks/e2e_reference.py table $OUT/e2e | tail -4
cd $OUT && tar czf results.tgz e2e && rm -rf e2e
