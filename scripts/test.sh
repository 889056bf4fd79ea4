#!/usr/bin/env bash
# Set up and run the test suite (CPU; GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
# For the tests only: the optional TensorBoard and W&B sinks (about 10 s of install, ~150 MB) and peft (LoRA), so
# their tests run; in setup.sh's one install (a second pip resolve cost CI time).
GSPO_EXTRAS=test,tensorboard,wandb,lora bash scripts/setup.sh
. .venv/bin/activate
# The fused decode kernels are Triton; a CUDA torch brings its own Triton (leave it: torch pins it). With the CPU torch
# the tests run them in Triton's interpreter, which needs Triton >= 3.8 under NumPy 2.4.
if python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  python -m pip install -q "triton>=3.8"
fi
# Two workers (pytest-xdist): many tests wait on child processes (torchrun, kills, timeouts) more than they compute, so
# two at a time fill a 2-core machine (CI: 11 min instead of 18). TEST_WORKERS=0 runs them in this process, the
# default with a CUDA torch (the GPU tests time warm-ups and share one device).
workers=${TEST_WORKERS:-$(python -c 'import torch; print(0 if torch.version.cuda else 2)')}
# The linter first (a second): pyflakes and pycodestyle, as pyproject.toml's [tool.ruff] configures them.
ruff check .
# Tiers. `slow` marks the 30 slowest tests by --durations (system tests: torchrun jobs, kills and resumes, whole runs
# under Triton's interpreter, the recorded runs' slowest): TIER=fast leaves them out (a few minutes on 2 cores: the
# tier to run while editing), TIER=slow runs only them; CI runs both, in one session. The `extended` tests (long fault
# scenarios whose paths other tests also cover) run only with GSPO_TEST_FULL=1: CI leaves them out for its 20 minutes.
# A -m of your own wins.
marks="not extended"
[ -z "${GSPO_TEST_FULL:-}" ] || marks=""
case "${TIER:-all}" in
  fast) marks="${marks:+$marks and }not slow" ;;
  slow) marks="${marks:+$marks and }slow" ;;
  all) ;;
  *) echo "TIER=${TIER} is not a tier: use TIER=fast, TIER=slow, or leave it unset for both"; exit 2 ;;
esac
select=()
[ -z "$marks" ] || select=(-m "$marks")
# Progress as counts ("[ 412/902]"), not minutes of dots: how far the suite is, at a glance.
python -m pytest -q -n "$workers" --dist worksteal -o console_output_style=count "${select[@]}" "$@"
