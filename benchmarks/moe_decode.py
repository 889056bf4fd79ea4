"""Rollout throughput on an MoE against the dense model of the same shapes, side by side on one GPU.

Models (random weights: decode speed does not depend on them; bf16 autocast over fp32 masters, as gspo trains):
dense = SmolLM2-135M's shapes (Llama, 30 layers, hidden 576, MLP 1536); moe = the same with 8 experts of 1536, top-2
(what `gspo upcycle` builds). ``--rows`` prompts of 40 tokens, exactly ``--tokens`` new tokens each (no stop token can
end a row early: the stop id is one the sampler is never allowed to pick). Engines:

- ``graph-fused``: gspo's graph engine with the fused Triton step (on the MoE: the fused attention kernels around the
  family's sparse block, whose experts are transformers' grouped GEMMs);
- ``graph``: gspo's graph engine on the HF modules' step, CUDA-graphed;
- ``hf``: gspo's simple engine (HF modules, dynamic cache, no graphs);
- ``generate-static``: ``model.generate`` with a static cache, on bf16 weights (the issue's reference).

    python benchmarks/moe_decode.py --rows 512 --tokens 128 --out moe_decode.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def build(moe: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                 rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    if moe:
        return MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=8, num_experts_per_tok=2)).cuda().float().eval()
    return LlamaForCausalLM(LlamaConfig(**shape)).cuda().float().eval()


class Tok:
    pad_token_id = 2

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def timed(fn) -> float:
    fn()  # warm-up (graph capture, autotuning)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    from gspo.rollout import HFEngine
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="moe_decode.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49000, (40,), generator=g).tolist() for _ in range(args.rows)]
    # top_k 49000 never samples the last ids: the stop id 49151 cannot end a row, so every row decodes --tokens tokens
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, top_k=49000)
    stop = [49151]
    results = []
    for name in ("dense", "moe"):
        model = build(name == "moe")
        engines = {"graph-fused": lambda: GraphEngine(model, Tok(), stop_ids=stop, autocast_dtype=torch.bfloat16,
                                                      fused=True),
                   "graph": lambda: GraphEngine(model, Tok(), stop_ids=stop, autocast_dtype=torch.bfloat16, fused=False),
                   "hf": lambda: HFEngine(model, Tok(), stop_ids=stop, autocast_dtype=torch.bfloat16)}
        for kind, make in engines.items():
            try:
                engine = make()
                gen = torch.Generator(device="cuda").manual_seed(0)
                seconds = timed(lambda: engine.generate(prompts, 1, params, generator=gen))
            except Exception as e:  # reported, not hidden
                results.append({"model": name, "engine": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            results.append({"model": name, "engine": kind, "s": seconds, "tok_s": args.rows * args.tokens / seconds})
            engine = None  # (not del: the timed lambda names it) freed before the next engine
            torch.cuda.empty_cache()
        ids = torch.tensor(prompts, device="cuda")
        model.to(torch.bfloat16)  # a static cache takes the model's dtype: bf16 weights, as the engines' copies

        def static():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=49000,
                           max_new_tokens=args.tokens, min_new_tokens=args.tokens, cache_implementation="static",
                           eos_token_id=stop, pad_token_id=2)

        try:
            seconds = timed(static)
            results.append({"model": name, "engine": "generate-static", "s": seconds,
                            "tok_s": args.rows * args.tokens / seconds})
        except Exception as e:
            results.append({"model": name, "engine": "generate-static", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        model = None  # (not del: the engines' lambdas name it) freed before the next model
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
           "new_tokens": args.tokens, "results": results}
    print(f"{'model':<6} {'engine':<16} {'s':>8} {'tokens/s':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<6} {r['engine']:<16} error: {r['error']}")
        else:
            print(f"{r['model']:<6} {r['engine']:<16} {r['s']:>8.2f} {r['tok_s']:>10.0f}")
    fused = {r["model"]: r.get("tok_s") for r in results if r["engine"] == "graph-fused"}
    if fused.get("dense") and fused.get("moe"):
        print(f"MoE fused step: {fused['moe'] / fused['dense']:.0%} of the dense fused step's tokens/s (target >= 60%)")
    open(args.out, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
