"""rollout.exact on a GPU: is the engine's log-prob the trainer's, bit for bit, and what does exactness cost?

  python benchmarks/exact_engine.py --model /root/smollm2/model.gguf --out $OUT/exact.json

1. **Throughput** (fixed-length decoding, stop tokens ignored, median of ``--repeats`` after a warm-up): the graph
   engine's fused step against the same engine with ``exact`` at each ``--shapes`` (rows x new tokens).
2. **Exactness**: the exact engine samples ``--exact-batches`` batches of ``--exact-rows`` arithmetic prompts
   (temperature 1; every other batch with the real stop tokens, so rows end at mixed lengths and the engine compacts
   them, the others to ``--exact-new`` tokens); the trainer's exact pass (``gspo.train.exact.ExactPass``) recomputes
   every token in chunks of ``--chunk`` rows, another batch composition and other packed offsets. Reported: tokens
   compared, tokens that differ, max |diff|. For contrast, today's default: the fused engine's log-probs against the
   ordinary packed trainer pass (bf16 autocast) on the same kind of batch.
3. **Multi-turn** (``multiturn``): rows of 1-3 turns of up to 48 sampled tokens with an observation appended after
   each turn but the last; every sampled token's log-prob against the trainer's exact pass over the whole row.
4. **Routes** (``routes``, MoE): the experts the exact forward picks (the engine's and the exact pass's, one function)
   against those the ordinary pass picks (HF modules under bf16 autocast, the pass the update's gradient comes from),
   per (token, layer, top-k slot), on the sampled rows one at a time.
5. **Trainer cost** on a minibatch of the reference run's shape (``--train-rows`` rows of the arithmetic task's
   lengths): the update's forward + backward, ordinary (packed, CUDA-graphed) vs exact (the exact no-grad pass + the
   ordinary pass for the gradient); and the old-policy pass, ordinary (graphed, no grad) vs exact.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gspo.data.tasks import ArithmeticTask  # noqa: E402
from gspo.models import stop_token_ids  # noqa: E402
from gspo.prompts import encode_prompts  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.train.exact import ExactPass  # noqa: E402
from gspo.train.passes import PackedGraphs, sequence_logprobs  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402
from shapes import bench_on_device  # noqa: E402


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(a, model, tok, autocast, prompts_all, out: dict) -> None:
    from gspo.kernels import exact_kernels

    no_stop = [model.config.vocab_size + 1]
    default_config = exact_kernels.MATMUL_BLOCK
    configs = [None] + [tuple(int(x) for x in c.split("x")) for c in a.matmul_configs.split(",") if c]
    for config in configs:  # None: the fused step; then the exact engine with each matmul configuration
        exact = config is not None
        exact_kernels.MATMUL_BLOCK = config or default_config
        engine = GraphEngine(model, tok, stop_ids=no_stop, device="cuda", autocast_dtype=autocast, exact=exact)
        for shape in a.shapes.split(","):
            rows, new = (int(x) for x in shape.split("x"))
            params = SamplingParams(max_new_tokens=new, temperature=1.0)
            gen = torch.Generator("cuda").manual_seed(0)
            run = lambda: engine.generate(prompts_all[:rows], 1, params, generator=gen)  # noqa: E731
            t0 = time.perf_counter()
            run()
            warm = time.perf_counter() - t0
            s = timed(run, a.repeats)
            path = "exact " + "x".join(map(str, config)) if exact else "fused"
            row = {"path": path, "rows": rows, "new": new, "tokens_per_s": rows * new / s,
                   "ms_per_step": 1000 * s / new, "warmup_s": warm}
            out["throughput"].append(row)
            print(json.dumps(row), flush=True)
        engine = None  # (not del: the timed lambdas above name it) freed before the next configuration's
        torch.cuda.empty_cache()
    exact_kernels.MATMUL_BLOCK = default_config


def exactness(a, model, tok, autocast, prompts_all, out: dict) -> None:
    engine = GraphEngine(model, tok, stop_ids=stop_token_ids(tok, model), device="cuda", autocast_dtype=autocast,
                         exact=True)
    fixed = GraphEngine(model, tok, stop_ids=[model.config.vocab_size + 1], device="cuda", autocast_dtype=autocast,
                        exact=True)
    trainer = ExactPass(model, autocast, torch.device("cuda"))
    total = differ = 0
    worst = 0.0
    for i in range(a.exact_batches):
        rows = prompts_all[i * 7 % 100: i * 7 % 100 + a.exact_rows]
        eng = engine if i % 2 else fixed  # odd batches end at real stops (mixed lengths, compaction)
        r = eng.generate(rows, 1, SamplingParams(max_new_tokens=a.exact_new, temperature=1.0),
                         generator=torch.Generator("cuda").manual_seed(100 + i))
        for c in range(0, len(rows), a.chunk):
            sel = list(range(c, min(c + a.chunk, len(rows))))[::-1]  # reversed: other neighbours, other offsets
            part = r.select(sel)
            lp, _ = trainer.logprobs(part.prompt_ids, part.completion_ids, part.completion_mask, 1.0)
            m = part.completion_mask
            d = (lp.cpu() - part.logprobs).abs()[m]
            total += int(m.sum())
            differ += int((d > 0).sum())
            worst = max(worst, float(d.max()) if d.numel() else 0.0)
        row = {"batch": i, "stops": bool(i % 2), "tokens": int(r.completion_mask.sum()),
               "mean_length": float(r.lengths.float().mean()), "cumulative_tokens": total, "differ": differ,
               "max_abs_diff": worst}
        out["exactness"].append(row)
        print(json.dumps(row), flush=True)
    # today's default for contrast: fused engine (not exact) vs the ordinary packed trainer pass
    default = GraphEngine(model, tok, stop_ids=stop_token_ids(tok, model), device="cuda", autocast_dtype=autocast)
    r = default.generate(prompts_all[:a.exact_rows], 1, SamplingParams(max_new_tokens=a.exact_new, temperature=1.0),
                         generator=torch.Generator("cuda").manual_seed(7))
    diffs = []
    for c in range(0, len(r.prompt_ids), a.chunk):
        part = r.select(list(range(c, min(c + a.chunk, len(r.prompt_ids)))))
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, part.prompt_ids, part.completion_ids, part.completion_mask,
                                      pad_id=part.pad_id, autocast_dtype=autocast, packed=True)
        diffs.append((lp.cpu() - part.logprobs).abs()[part.completion_mask])
    d = torch.cat(diffs)
    out["default_gap"] = {"tokens": d.numel(), "differ": int((d > 0).sum()), "mean_abs_diff": float(d.mean()),
                          "max_abs_diff": float(d.max())}
    print(json.dumps(out["default_gap"]), flush=True)


class Observations:
    """Multi-turn rows for the benchmark: row r takes 1 + r % 3 turns; after each but the last, an observation of
    4 + r % 5 ids is appended (the prompt's first ids, so they are real tokens)."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts, self.left = prompts, {}

    def __call__(self, rows, turn_ids):
        out = []
        for r in rows:
            self.left[r] = self.left.get(r, 1 + r % 3) - 1
            out.append(self.prompts[r][:4 + r % 5] if self.left[r] > 0 else None)
        return out


def multiturn(a, model, tok, autocast, prompts_all, out: dict) -> None:
    engine = GraphEngine(model, tok, stop_ids=stop_token_ids(tok, model), device="cuda", autocast_dtype=autocast,
                         exact=True)
    trainer = ExactPass(model, autocast, torch.device("cuda"))
    rows = prompts_all[:a.exact_rows // 2]
    r = engine.generate(rows, 1, SamplingParams(max_new_tokens=160, temperature=1.0, max_turn_tokens=48),
                        generator=torch.Generator("cuda").manual_seed(5), turns=Observations(rows))
    total = differ = 0
    worst = 0.0
    for c in range(0, len(rows), a.chunk):
        part = r.select(list(range(c, min(c + a.chunk, len(rows))))[::-1])
        lp, _ = trainer.logprobs(part.prompt_ids, part.completion_ids, part.completion_mask, 1.0)
        d = (lp.cpu() - part.logprobs).abs()[part.sampled]
        total, differ = total + d.numel(), differ + int((d > 0).sum())
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    appended = r.completion_mask & ~r.sampled
    out["multiturn"] = {"rows": len(rows), "sampled_tokens": total, "appended_tokens": int(appended.sum()),
                        "rows_with_later_turns": int(appended.any(1).sum()), "differ": differ, "max_abs_diff": worst}
    print(json.dumps(out["multiturn"]), flush=True)


def routes(a, model, tok, autocast, prompts_all, out: dict) -> None:
    from gspo.kernels import exact_kernels
    from gspo.models import named_weights
    from gspo.models.moe import find_routers

    engine = GraphEngine(model, tok, stop_ids=stop_token_ids(tok, model), device="cuda", autocast_dtype=autocast,
                         exact=True)
    r = engine.generate(prompts_all[:64], 1, SamplingParams(max_new_tokens=256, temperature=1.0),
                        generator=torch.Generator("cuda").manual_seed(9))
    del engine
    exact = ExactPass(model, autocast, torch.device("cuda"), use_graphs=False)
    exact.weights.load(named_weights(model))
    seen_exact, seen_hf = [], []
    route = exact_kernels.route
    exact_kernels.route = lambda *args: (lambda w, e: seen_exact.append(e.long()) or (w, e))(*route(*args))
    hooks = [m.register_forward_hook(lambda mod, i, o: seen_hf.append(o[2].reshape(-1, o[2].shape[-1])))
             for m in find_routers(model)]
    slots = flips = 0
    try:
        for i in range(len(r.prompt_ids)):
            n = int(r.completion_mask[i].sum())
            ids = torch.tensor([*r.prompt_ids[i], *r.completion_ids[i, :n].tolist()], device="cuda")
            seen_exact.clear()
            seen_hf.clear()
            with torch.no_grad(), torch.autocast("cuda", dtype=autocast):
                exact._forward(ids, torch.arange(len(ids), device="cuda"),
                               exact_kernels.tile_table([len(ids)], [0], exact.decoder.heads // exact.decoder.kv_heads)
                               .cuda())
                model(ids[None])
            for e, h in zip(seen_exact, seen_hf):  # one per MoE layer, in order
                flips += int((e[:, :, None] != h[:, None, :]).all(-1).sum())
                slots += e.numel()
    finally:
        exact_kernels.route = route
        for h in hooks:
            h.remove()
    out["routes"] = {"rows": len(r.prompt_ids), "slots": slots, "exact_vs_ordinary_flips": flips,
                     "flip_rate": flips / max(slots, 1)}
    print(json.dumps(out["routes"]), flush=True)


def trainer_cost(a, model, tok, autocast, prompts_all, out: dict) -> None:
    engine = GraphEngine(model, tok, stop_ids=stop_token_ids(tok, model), device="cuda", autocast_dtype=autocast)
    r = engine.generate(prompts_all[:a.train_rows // 8], 8, SamplingParams(max_new_tokens=128, temperature=1.0),
                        generator=torch.Generator("cuda").manual_seed(1))
    del engine
    graphs = PackedGraphs(model, autocast)
    exact = ExactPass(model, autocast, torch.device("cuda"))
    model.train()

    def ordinary(grad: bool):
        with torch.set_grad_enabled(grad):
            lp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, pad_id=r.pad_id,
                                      autocast_dtype=autocast, packed=True, graphs=graphs)
            if grad:
                lp.sum().backward()

    def with_exact(grad: bool):  # the exact values with the ordinary pass's gradient (MoE's update; dense's before)
        with torch.no_grad():
            lp_exact, _ = exact.logprobs(r.prompt_ids, r.completion_ids, r.completion_mask, 1.0, version=0)
        if grad:
            ordinary(True)
        return lp_exact

    def differentiated():  # a dense model's update: the exact pass with its own backward (gspo.kernels.exact_grad)
        with torch.enable_grad():
            lp, _ = exact.logprobs(r.prompt_ids, r.completion_ids, r.completion_mask, 1.0, version=0)
            lp.sum().backward()

    for p in model.parameters():
        p.grad = None
    res = {"rows": len(r.prompt_ids), "tokens": int(r.completion_mask.sum()) + sum(map(len, r.prompt_ids))}
    parts = [("update_ordinary_s", lambda: ordinary(True)), ("update_exact_s", lambda: with_exact(True)),
             ("old_pass_ordinary_s", lambda: ordinary(False)), ("old_pass_exact_s", lambda: with_exact(False))]
    if exact.differentiable:
        parts.append(("update_exact_own_grad_s", differentiated))
    for name, fn in parts:
        fn()  # warm-up (graph capture, Triton compile)
        res[name] = timed(fn, a.repeats)
    res["update_extra_pct"] = 100 * (res["update_exact_s"] / res["update_ordinary_s"] - 1)
    if exact.differentiable:
        res["update_own_grad_extra_pct"] = 100 * (res["update_exact_own_grad_s"] / res["update_ordinary_s"] - 1)
    out["trainer"] = res
    print(json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shapes", default="512x128,1024x512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--matmul-configs", default="64x64x64x4",
                   help="the exact engine's matmul configurations to time (BLOCK_M x BLOCK_N x BLOCK_K x warps)")
    p.add_argument("--exact-batches", type=int, default=4)
    p.add_argument("--exact-rows", type=int, default=1024)
    p.add_argument("--exact-new", type=int, default=512)
    p.add_argument("--chunk", type=int, default=96)
    p.add_argument("--train-rows", type=int, default=64)
    p.add_argument("--exact-config", default="",
                   help="the matmul configuration of the exactness, multi-turn and trainer parts (default: gspo's)")
    p.add_argument("--upcycle", default="", help="EXK: upcycle the model to a Mixtral of E experts, top-K")
    p.add_argument("--drop", type=float, default=0.5, help="--upcycle's Drop-Upcycling fraction (0: copies)")
    p.add_argument("--parts", default="exactness,throughput,trainer")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device, autocast, model, tok, card = bench_on_device(a.model, "cuda")
    if a.upcycle:
        from gspo.commands.upcycle import upcycle

        experts, top_k = (int(x) for x in a.upcycle.split("x"))
        model = upcycle(model.cpu().float(), experts, top_k, drop=a.drop).to(device).eval()
    if a.exact_config:
        from gspo.kernels import exact_kernels

        exact_kernels.MATMUL_BLOCK = tuple(int(x) for x in a.exact_config.split("x"))
    task = ArithmeticTask(seed=0)
    prompts_all = encode_prompts(tok, [task[i] for i in range(max(1024, a.exact_rows + 100))])
    prompts_all = [[min(t, model.config.vocab_size - 1) for t in p] for p in prompts_all]  # a random model's vocabulary
    out = {"model": a.model + (f" upcycled {a.upcycle} drop {a.drop}" if a.upcycle else ""), "exact_config": a.exact_config,
           "card": card, "torch": torch.__version__, "throughput": [], "exactness": []}
    for part in a.parts.split(","):
        {"throughput": throughput, "exactness": exactness, "trainer": trainer_cost, "multiturn": multiturn,
         "routes": routes}[part](a, model, tok, autocast,
                                                                                          prompts_all, out)
        Path(a.out).write_text(json.dumps(out, indent=1))  # after every part: a later crash loses nothing
    print(table(out))


def table(out: dict) -> str:
    lines = [f"card: {out['card']}", "", "| path | rows x new | tokens/s | ms/step |", "|---|---|---|---|"]
    for r in out["throughput"]:
        lines.append(f"| {r['path']} | {r['rows']} x {r['new']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} |")
    if out["exactness"]:
        e = out["exactness"][-1]
        lines.append(f"\nexact: {e['cumulative_tokens']} tokens compared, {e['differ']} differ, max |diff| "
                     f"{e['max_abs_diff']}")
    if "default_gap" in out:
        g = out["default_gap"]
        lines.append(f"default (fused engine vs packed trainer): {g['tokens']} tokens, {g['differ']} differ, mean "
                     f"{g['mean_abs_diff']:.4g}, max {g['max_abs_diff']:.4g}")
    if "multiturn" in out:
        m = out["multiturn"]
        lines.append(f"multi-turn: {m['sampled_tokens']} sampled tokens ({m['rows_with_later_turns']} rows with later "
                     f"turns, {m['appended_tokens']} appended ids), {m['differ']} differ, max |diff| {m['max_abs_diff']}")
    if "routes" in out:
        t = out["routes"]
        lines.append(f"routes: exact forward vs the ordinary (gradient) pass, {t['slots']} slots, "
                     f"{t['exact_vs_ordinary_flips']} differ ({100 * t['flip_rate']:.3f}%)")
    if "trainer" in out:
        t = out["trainer"]
        lines.append(f"trainer ({t['rows']} rows, {t['tokens']} tokens): update {t['update_ordinary_s'] * 1e3:.1f} ms "
                     f"-> {t['update_exact_s'] * 1e3:.1f} ms ({t['update_extra_pct']:+.0f}%); old-policy pass "
                     f"{t['old_pass_ordinary_s'] * 1e3:.1f} ms ordinary, {t['old_pass_exact_s'] * 1e3:.1f} ms exact")
        if "update_exact_own_grad_s" in t:
            lines.append(f"  update with the exact pass's own backward: {t['update_exact_own_grad_s'] * 1e3:.1f} ms "
                         f"({t['update_own_grad_extra_pct']:+.0f}% over the ordinary update)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
