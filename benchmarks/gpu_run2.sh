#!/usr/bin/env bash
# One device call on a machine where ../shared/device/stage.sh's transfers ran: where the imports' time goes, the
# reference run on a warm model cache with its timings, and the training-loop profile. Results in $OUT/results.tgz.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/smollm2/model.gguf
nvidia-smi -L | tee $OUT/card.txt
python3 -c "from gspo.models import load_model; load_model('$M')" 2>/dev/null  # the GGUF -> HF cache conversion, once
for i in 1 2; do /usr/bin/time -f "import wall %e s" python3 -c "import torch" ; done 2>&1 | tail -1
/usr/bin/time -f "import torch+transformers wall %e s" python3 -c "import torch, transformers; from transformers import AutoModelForCausalLM" 2>&1 | tail -1
python3 -X importtime -c "import gspo.cli; from gspo.train import Trainer" 2> $OUT/importtime.txt
python3 - <<'PY'
import os
rows = []
for line in open(os.environ["OUT"] + "/importtime.txt"):
    if not line.startswith("import time:") or "self [us]" in line:
        continue
    self_us, cum_us, name = line[12:].split("|")
    rows.append((int(self_us), int(cum_us), name.rstrip()))
print("top self:", [(n.strip(), s // 1000) for s, c, n in sorted(rows, reverse=True)[:25]])
print("top-level cumulative:", [(n.strip(), c // 1000) for s, c, n in rows if not n.startswith("  ")][-30:])
PY
python3 benchmarks/e2e_reference.py run --model $M --algos gspo --out $OUT/e2e --scratch /tmp/e2e log.progress=false \
  2>&1 | grep -v "Warn\|warn" | tail -3
cat /tmp/e2e/gspo/timings.json | tr -d '\n '; echo
python3 benchmarks/profile_train.py --model $M --out $OUT/profile_train.txt 2>&1 | grep -v Warn | head -5
cd $OUT && tar czf results.tgz e2e profile_train.txt importtime.txt && rm -rf e2e profile_train.txt importtime.txt
