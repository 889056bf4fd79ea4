"""The update's passes on an MoE: transformers' experts implementations side by side (the per-expert loop ``eager`` is
the baseline; ``grouped_mm`` is transformers' default where torch has grouped GEMMs; ``batched_mm``), and the cost of
the routing hooks (flip rate only, R2 replay) on the fastest one.

A Mixtral with the upcycled SmolLM2's shapes (30 layers, hidden 576, 8 experts of 1536, top-2; random weights: speed
does not depend on them), bf16 autocast over fp32 weights as gspo trains, gspo's own log-prob pass
(``sequence_logprobs``, padded layout) forward + backward over ``--rows`` sequences of prompt 60 + completion
``--tokens``. Prints a table and writes JSON.

    python benchmarks/moe_passes.py --out moe_passes.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def build(experts: int, top_k: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                        num_local_experts=experts, num_experts_per_tok=top_k, tie_word_embeddings=True,
                        router_jitter_noise=0.0)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).cuda().float()


def time_pass(model, batch, routing, iters: int) -> float:
    from gspo.train.passes import sequence_logprobs

    prompts, ids, mask = batch
    rows = torch.arange(len(prompts))

    def once():
        with routing.updating() if routing is not None else _null():
            logp, _ = sequence_logprobs(model, prompts, ids, mask, pad_id=0, autocast_dtype=torch.bfloat16,
                                        routing=routing, row_ids=rows)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)

    once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def set_experts(model, impl: str) -> None:
    """transformers' switch between experts implementations (``set_experts_implementation`` where it exists)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    from gspo.models.moe import Routing

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="moe_passes.json")
    args = ap.parse_args()
    model = build(8, 2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (60,), generator=g).tolist() for _ in range(args.rows)]
    ids = torch.randint(3, 49152, (args.rows, args.tokens), generator=g)
    lengths = torch.randint(args.tokens // 4, args.tokens + 1, (args.rows,), generator=g)
    mask = torch.arange(args.tokens)[None] < lengths[:, None]
    batch = (prompts, ids, mask)
    tokens = int(mask.sum()) + 60 * args.rows
    results = []
    for impl in ("eager", "batched_mm", "grouped_mm"):
        try:
            set_experts(model, impl)
            seconds = time_pass(model, batch, None, args.iters)
        except Exception as e:  # an implementation this torch / GPU cannot run is reported, not hidden
            results.append({"experts": impl, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        results.append({"experts": impl, "hooks": "none", "s_per_pass": seconds, "tok_s": tokens / seconds})
    best = min((r for r in results if "s_per_pass" in r), key=lambda r: r["s_per_pass"])["experts"]
    set_experts(model, best)
    for replay in ("off", "old"):
        routing = Routing(model, replay)
        routing.begin_batch(args.rows, 60 + args.tokens, torch.device("cuda"))
        with routing.recording(), torch.no_grad():  # the old-policy pass records
            from gspo.train.passes import sequence_logprobs

            sequence_logprobs(model, prompts, ids, mask, pad_id=0, autocast_dtype=torch.bfloat16, routing=routing,
                              row_ids=torch.arange(args.rows))
        seconds = time_pass(model, batch, routing, args.iters)
        results.append({"experts": best, "hooks": f"flip rate + replay {replay}", "s_per_pass": seconds,
                        "tok_s": tokens / seconds, "record_mb": routing.record_bytes() / 2**20})
        routing.close()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
           "completion_tokens": args.tokens, "tokens_per_pass": tokens, "results": results}
    print(f"{'experts':<12} {'hooks':<26} {'s / pass':>9} {'tokens/s':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['experts']:<12} error: {r['error']}")
        else:
            print(f"{r['experts']:<12} {r['hooks']:<26} {r['s_per_pass']:>9.3f} {r['tok_s']:>10.0f}")
    open(args.out, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
