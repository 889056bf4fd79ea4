"""Rollout throughput: the CUDA-graph engine against the simple engine and ``model.generate``, same prompts.

  python benchmarks/rollout.py --model /root/smollm2/model.gguf --out $OUT/rollout.json
  python benchmarks/rollout.py --model qwen2.5-0.5b-shape --baselines none --out $OUT/rollout_qwen.json   # random init, same shape

Prompts are "What is a + b? Put the final answer after 'Answer:'." in the chat template, temperature 1. Every row
decodes exactly ``new`` tokens (stop tokens ignored) so tokens/s counts the same work for every path. Warm-up
(graph capture, first-call allocation) is timed separately from the timed repeats; the table reports the median.
The memory-bandwidth floor per decode step reads the weights once (bf16) plus the KV cache of every row; % of floor
is that floor time over the measured step time, at the card's nominal bandwidth.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gspo.data.tasks import ArithmeticTask  # noqa: E402
from gspo.prompts import encode_prompts  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.rollout.hf import HFEngine  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402
from shapes import bench_on_device  # noqa: E402

BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()

def time_call(fn, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", default="64,256,512,1024")
    p.add_argument("--new", default="128,512")
    p.add_argument("--baseline-batch", type=int, default=256, help="batch for the slow paths (simple engine, generate)")
    p.add_argument("--baselines", default="hf,generate,compile",
                   help="hf: gspo's simple engine; generate: model.generate eager; compile: model.generate with a static "
                        "cache, which transformers compiles (torch.compile) on the first call")
    p.add_argument("--compile-batch", type=int, default=512)
    p.add_argument("--module-batch", type=int, default=512, help="batch for the graph engine's HF-module step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device, autocast, model, tok, card = bench_on_device(a.model, a.device)
    bw = next((v for k, v in BANDWIDTH.items() if k in card), None)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * heads * head_dim * 2  # bf16 K and V
    task = ArithmeticTask(seed=0)
    prompts_all = encode_prompts(tok, [task[i] for i in range(max(int(b) for b in a.batches.split(",")))])
    prompts_all = [[min(t, cfg.vocab_size - 1) for t in p] for p in prompts_all]
    no_stop = [cfg.vocab_size + 1]  # never sampled: fixed-length decoding
    rows = []

    def record(path, batch, new, seconds, warmup, steps):
        toks = batch * new
        ctx = statistics.mean(len(p) for p in prompts_all[:batch]) + new / 2
        floor = (n_params * 2 + batch * ctx * kv_per_token) / bw if bw else None
        step_ms = 1000 * seconds / steps
        row = {"path": path, "batch": batch, "new_tokens": new, "tokens_per_s": toks / seconds, "ms_per_step": step_ms,
               "warmup_s": warmup, "pct_of_bandwidth_floor": 100 * floor * 1000 / step_ms if floor else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps({"model": a.model, "card": card, "params": n_params, "torch": torch.__version__,
                                           "rows": rows}, indent=1))  # after every row: a later crash loses nothing

    params_for = lambda new: SamplingParams(max_new_tokens=new, temperature=1.0)  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(0)
    # The fused decode step over the whole grid; the HF-module step (fused=False) at the target shape, for comparison.
    module_shape = (int(a.module_batch), int(a.new.split(",")[0]))
    variants = [("gspo graph engine (fused step)", True, None), ("gspo graph engine (HF modules step)", False, module_shape)]
    for path, fused, only in variants:
        if fused and device.type != "cuda":
            continue
        engine = GraphEngine(model, tok, stop_ids=no_stop, device=device, autocast_dtype=autocast, fused=fused)
        for new in [int(x) for x in a.new.split(",")]:
            for batch in [int(x) for x in a.batches.split(",")]:
                if only is not None and (batch, new) != only:
                    continue
                prompts = prompts_all[:batch]
                before = engine.warmup_s
                t0 = time.perf_counter()
                engine.generate(prompts, 1, params_for(new), generator=gen)
                sync(device)
                first = time.perf_counter() - t0
                secs = time_call(lambda: engine.generate(prompts, 1, params_for(new), generator=gen), device, a.repeats)
                record(path, batch, new, secs, max(first - secs, engine.warmup_s - before), new)
        engine = None  # frees its caches and graphs before the next variant
    b, new = a.baseline_batch, int(a.new.split(",")[0])
    prompts = prompts_all[:b]
    if "hf" in a.baselines:
        simple = HFEngine(model, tok, stop_ids=no_stop, device=device, autocast_dtype=autocast)
        secs = time_call(lambda: simple.generate(prompts, 1, params_for(new), generator=gen), device, 1)
        record("gspo simple engine (eager, dynamic cache)", b, new, secs, 0.0, new)
    if "generate" in a.baselines:
        from gspo.models import pad_prompts

        ids, mask = pad_prompts(prompts, tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)

        def hf_generate():
            with torch.no_grad(), torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)

        secs = time_call(hf_generate, device, 1)
        record("model.generate (eager, dynamic cache)", b, new, secs, 0.0, new)
    if "compile" in a.baselines:
        from gspo.models import pad_prompts

        b = a.compile_batch
        ids, mask = pad_prompts(prompts_all[:b], tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        # A static cache is allocated in the model's dtype, and autocast writes bf16 K/V into it: run a bf16 copy.
        half = copy.deepcopy(model).to(autocast) if autocast is not None else model

        def hf_static():
            with torch.no_grad():
                half.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id,
                               cache_implementation="static")

        sync(device)
        t0 = time.perf_counter()
        hf_static()
        sync(device)
        first = time.perf_counter() - t0
        secs = time_call(hf_static, device, 2)
        record("model.generate (static cache + torch.compile)", b, new, secs, first - secs, new)
    out = {"model": a.model, "card": card, "params": n_params, "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\n{a.model} on {card}\n| path | batch | new tokens | tokens/s | ms/step | warm-up s | % of bandwidth floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pct = f"{r['pct_of_bandwidth_floor']:.0f}%" if r["pct_of_bandwidth_floor"] else "-"
        print(f"| {r['path']} | {r['batch']} | {r['new_tokens']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
              f"{r['warmup_s']:.1f} | {pct} |")

if __name__ == "__main__":
    main()
