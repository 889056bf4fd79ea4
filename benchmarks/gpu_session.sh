#!/usr/bin/env bash
# Device-call helper, after ../shared/device/stage.sh's two calls (model at /root/smollm2, wheels in /tmp/site).
#   bash benchmarks/gpu_session.sh tests|profile|rollout|train|e2e|trl [...]     results under $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
mkdir -p "$OUT/e2e"
for part in "$@"; do
  case $part in
    tests)   python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt" ;;
    profile) for flags in ${PROFILE_FLAGS:-"" --no-fused}; do
               python3 benchmarks/profile_step.py --model $M --batch 512 $flags 2>&1 | grep -v "Warn\|warn\|Load\|Conv"
             done | tee "$OUT/profile_step.txt" | grep "tokens/s"
             python3 benchmarks/profile_train.py --model $M --out "$OUT/profile_train.txt" 2>&1 | grep -v Warn | head -4 ;;
    rollout) python3 benchmarks/rollout.py --model $M --out "$OUT/rollout_smollm2.json" 2>&1 | grep -v Warn | tail -16
             python3 benchmarks/rollout.py --model qwen2.5-0.5b-shape --new 128 --batches 256,512 --baselines none \
               --out "$OUT/rollout_qwen.json" 2>&1 | grep -v Warn | tail -6 ;;
    train)   python3 benchmarks/train_step.py --model $M --out "$OUT/train_step_smollm2.json" 2>&1 | tail -9
             python3 benchmarks/train_step.py --model qwen2.5-0.5b-shape --batch 32 --out "$OUT/train_step_qwen.json" 2>&1 | tail -9 ;;
    e2e)     python3 benchmarks/e2e_reference.py run --model $M --algos ${ALGOS:-gspo,grpo} --out "$OUT/e2e" log.progress=false \
               2>&1 | grep "e2e\|rror" | tail -5 ;;
    trl)     python3 benchmarks/e2e_reference.py trl --script .gpu/b/peer_trl.py --model $M --levels ${LEVELS:-sequence} \
               --out "$OUT/e2e" 2>&1 | grep "e2e\|rror" | tail -5 ;;
  esac
done
