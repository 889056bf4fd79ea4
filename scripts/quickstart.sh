#!/usr/bin/env bash
# Set up and run the quickstart: GSPO on the built-in "a + b" task with SmolLM2-135M-Instruct.
# On a CPU it runs a small version (minutes); on a GPU the full reference settings. Extra arguments are passed
# to `gspo train` (e.g. algorithm=grpo). It ends by exporting the model (gspo export) and asking it one question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
run_dir=${RUN_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}
gspo train configs/quickstart.toml --run-dir "$run_dir" "$@"
gspo summary "$run_dir"
# The trained model as a plain Hugging Face directory, and one question to it with transformers alone.
gspo export "$run_dir" --out "$run_dir/model"
python - "$run_dir/model" <<'PY'
import sys

from transformers import pipeline

chat = pipeline("text-generation", model=sys.argv[1])
reply = chat([{"role": "user", "content": "What is 7 + 5?"}], max_new_tokens=32, do_sample=False)
print("the trained model, asked 'What is 7 + 5?':", reply[0]["generated_text"][-1]["content"])
PY
