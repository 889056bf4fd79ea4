#!/usr/bin/env bash
# One device call: GPU tests, rollout benchmark, end-to-end GSPO with the graph engine. Run after stage.sh's calls.
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p $OUT/e2e
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
python3 benchmarks/rollout.py --model /root/smollm2/model.gguf --out $OUT/rollout_smollm2.json 2>&1 | grep -v Warn | tail -14
python3 benchmarks/e2e_reference.py run --model /root/smollm2/model.gguf --algos ${ALGOS:-gspo} --out $OUT/e2e log.progress=false 2>&1 | grep "e2e\|rror" | tail -5
