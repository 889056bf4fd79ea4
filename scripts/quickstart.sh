#!/usr/bin/env bash
# Set up and run the quickstart: GSPO on the built-in "a + b" task with SmolLM2-135M-Instruct.
# On a CPU it runs a small version (minutes); on a GPU the full reference settings. Extra arguments are passed
# to `gspo train` (e.g. algorithm=grpo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
run_dir=${RUN_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}
gspo train configs/quickstart.toml --run-dir "$run_dir" "$@"
gspo summary "$run_dir"
