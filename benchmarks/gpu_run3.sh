#!/usr/bin/env bash
# The reference-run measurement of issue 10, part 1 (after ../shared/device/stage.sh's two transfers): GPU tests, the
# bare import cost of torch + transformers, gspo's reference run three times (the first process on the machine: cold
# model cache and Triton cache; then warm; then with the config's own checkpoint every 10 batches), and smoke runs of
# `gspo eval` and `gspo probe noise`. Part 2 is TRL on the same machine, right after (gpu_session.sh trl).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
E=$OUT/e2e
nvidia-smi -L | tee $OUT/card.txt
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_decode.py tests/test_graph_engine.py \
  tests/test_rollout.py tests/test_logprobs.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
for tag in _cold _warm; do
  python3 benchmarks/e2e_reference.py run --model $M --algos gspo --tag $tag --out $E --scratch /tmp/e2e log.progress=false \
    2>&1 | grep "e2e\]\|rror"
done
python3 benchmarks/e2e_reference.py run --model $M --algos gspo --tag _ckpt10 --out $E --scratch /tmp/e2e \
  log.progress=false log.checkpoint_every=10 2>&1 | grep "e2e\]\|rror"
for i in 1 2; do /usr/bin/time -f "bare import of torch + transformers + AutoModelForCausalLM: %e s" \
  python3 -c "import torch, transformers; from transformers import AutoModelForCausalLM"; done 2>&1 | tail -1 | tee $E/imports.txt
python3 -m gspo.cli eval configs/quickstart.toml --model /tmp/e2e/gspo_warm/checkpoints/step-000160 --n 128 --samples 2 --json \
  2>&1 | grep -v "Warn\|warn" | tail -9 | tee $E/eval_trained.txt
python3 -m gspo.cli probe noise configs/quickstart.toml --out /tmp/probe --rows 16 --bins 3 model.name="'$M'" \
  2>&1 | grep "gspo\|grpo\|probe:" | tail -8 | tee $E/probe_smoke.txt
python3 benchmarks/e2e_reference.py table $E | tee $E/table.md
cd $OUT && tar czf results.tgz e2e && rm -rf e2e
