"""Where a graph-engine decode step spends its time: the step run eagerly under the profiler (kernels by CUDA time).

  python benchmarks/profile_step.py --model /root/smollm2/model.gguf --batch 512
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.data.tasks import ArithmeticTask  # noqa: E402
from gspo.models import attention_context, autocast_context, load_model  # noqa: E402
from gspo.prompts import encode_prompts  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m-instruct")
p.add_argument("--batch", type=int, default=512)
a = p.parse_args()
model, tok = load_model(a.model)
model.cuda().eval()
dev = torch.device("cuda")
engine = GraphEngine(model, tok, stop_ids=[model.config.vocab_size + 1], device=dev, autocast_dtype=torch.bfloat16, use_graphs=False)
task = ArithmeticTask(seed=0)
prompts = encode_prompts(tok, [task[i] for i in range(a.batch)])
params = SamplingParams(max_new_tokens=128)
engine.generate(prompts, 1, params)  # builds the bucket
b = next(iter(engine._buckets.values()))


def rewind():  # back to the first decode slot, so the steps below stay inside the cache
    b.cur.fill_(b.length - params.max_new_tokens)
    b.step.fill_(1)
    b.done.zero_()


import time  # noqa: E402

with torch.no_grad(), autocast_context(dev, torch.bfloat16, cache=False), attention_context():
    rewind()
    for _ in range(3):
        engine._step(b, params)
    rewind()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        engine._step(b, params)
    torch.cuda.synchronize()
    print(f"eager step: {1000 * (time.perf_counter() - t0) / 20:.2f} ms")
    engine.use_graphs = True
    rewind()
    graph = engine._graph(b, params)
    rewind()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    print(f"graph replay: {1000 * (time.perf_counter() - t0) / 20:.2f} ms")
    rewind()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine._step(b, params)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
t0 = time.perf_counter()
engine.use_graphs = True
engine.generate(prompts, 1, params)
torch.cuda.synchronize()
print(f"generate with graphs: {time.perf_counter() - t0:.2f} s for {a.batch} x {params.max_new_tokens}")
