"""Where a graph-engine rollout spends its time: one whole ``generate`` call (every row decodes ``--new`` tokens)
under the profiler, kernels by GPU time per decode step, after a warm-up call that captures the graphs.

  python benchmarks/profile_step.py --model /root/smollm2/model.gguf --batch 512 [--no-fused] [--no-flash] [--fp32-weights]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.data.tasks import ArithmeticTask  # noqa: E402
from gspo.models import load_model  # noqa: E402
from gspo.prompts import encode_prompts  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m-instruct")
p.add_argument("--batch", type=int, default=512)
p.add_argument("--new", type=int, default=128)
p.add_argument("--no-flash", action="store_true")
p.add_argument("--fp32-weights", action="store_true", help="fp32 weight copies cast at every step (no bf16 copies)")
p.add_argument("--no-fused", action="store_true", help="the HF modules' decode step instead of the fused one")
a = p.parse_args()
model, tok = load_model(a.model)
model.cuda().eval()
dev = torch.device("cuda")
engine = GraphEngine(model, tok, stop_ids=[model.config.vocab_size + 1], device=dev, autocast_dtype=torch.bfloat16,
                     flash_decode=False if a.no_flash else None, low_precision_weights=not a.fp32_weights,
                     fused=False if a.no_fused else None)
task = ArithmeticTask(seed=0)
prompts = encode_prompts(tok, [task[i] for i in range(a.batch)])
params = SamplingParams(max_new_tokens=a.new)
t0 = time.perf_counter()
engine.generate(prompts, 1, params)  # captures the graph
torch.cuda.synchronize()
first = time.perf_counter() - t0
torch.cuda.synchronize()
t0 = time.perf_counter()
engine.generate(prompts, 1, params)
torch.cuda.synchronize()
wall = time.perf_counter() - t0
print(f"fused={engine.fused is not None} flash_decode={engine.flash_decode} bf16_weights={not a.fp32_weights}: {a.batch} x {a.new} "
      f"in {wall:.3f} s, {a.batch * a.new / wall:,.0f} tokens/s, {1000 * wall / a.new:.2f} ms/step, warm-up {first - wall:.1f} s")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    engine.generate(prompts, 1, params)
    torch.cuda.synchronize()
ka = prof.key_averages()
total = sum(e.self_device_time_total for e in ka)
print(f"GPU time per decode step: {total / 1000 / a.new:.2f} ms")
for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:16]:
    print(f"{e.self_device_time_total / 1000 / a.new:7.3f} ms/step {e.count / a.new:6.1f} calls/step  {e.key[:90]}")
