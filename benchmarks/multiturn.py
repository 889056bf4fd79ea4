"""Multi-turn rollouts: what a later turn's prefill costs, and tokens/s against single-turn rows.

  python benchmarks/multiturn.py --model /root/smollm2/model.gguf --out $OUT/multiturn.json
  python benchmarks/multiturn.py --model /root/smollm2/model.gguf --system-file benchmarks/agent_system.txt ...

Each row is a conversation: the arithmetic prompt in the chat template, then ``--turns`` assistant turns, each answered
with a user message (``--reply``, rendered by the model's chat template through :class:`gspo.envs.turns.Turns`, as
in a run). The LM head gets a bias of ``--stop-bias`` on the end-of-turn token so turns end after a few dozen tokens
(a model's natural turn length varies too much to compare); ``--turn-tokens`` caps a turn.

With ``--system-file`` every row starts with that system message: ``benchmarks/agent_system.txt`` is an agent's usual
preamble (five tool schemas in Hermes format and the calling convention, ~700 tokens), where the short default rows
(~40 prompt tokens) are a worst case for the ratio below: appended ids over history tokens is its floor when both
prefills cost the same per token.

1. **Prefill of later turns.** Each time the engine feeds the answers into the rows' own KV caches (``_extend``, one
   forward of the appended ids), the same rows' whole history -- prompt, earlier turns, the answer -- is also prefilled
   from scratch (a one-token ``generate`` of those histories: what an engine without the rows' caches must do). The
   table gives both, per turn, and their ratio.
2. **Tokens/s.** The same rows as single-turn rollouts (one turn each, up to ``--turns x --turn-tokens`` tokens, the
   same biased model) against the multi-turn rollouts: sampled tokens per second of each, the median of
   ``--repeats``. Single-turn rows end at their first end-of-turn token, so both count the same kind of tokens.
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
from gspo.envs.turns import Turns  # noqa: E402
from gspo.models.load import stop_token_ids  # noqa: E402
from gspo.prompts import encode_prompts  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.rollout.hf import HFEngine  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402
from shapes import bench_on_device  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Conversation:
    """The TurnEnds of the benchmark: every turn that ends on the end-of-turn token gets the same user reply, until
    the row has had ``turns`` turns."""

    def __init__(self, appended: list[int], turns: int):
        self.appended, self.turns, self.seen = appended, turns, {}

    def __call__(self, rows, turn_ids):
        out = []
        for r in rows:
            self.seen[r] = self.seen.get(r, 0) + 1
            out.append(list(self.appended) if self.seen[r] < self.turns else None)
        return out


def timed(engine, name, device, log):
    """Wrap ``engine.name`` so each call's seconds (device synchronised) and arguments are appended to ``log``."""
    inner = getattr(engine, name)

    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        sync(device)
        log.append((time.perf_counter() - t0, args))
        return out

    setattr(engine, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--reply", default="Check that once more, step by step, and give the answer again.")
    p.add_argument("--stop-bias", type=float, default=4.0)
    p.add_argument("--system-file", help="a system message for every row (e.g. benchmarks/agent_system.txt: five tool "
                   "schemas in Hermes format, an agent's usual preamble)")
    p.add_argument("--engines", default="graph,hf")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device, autocast, model, tok, card = bench_on_device(a.model, a.device)
    stop = stop_token_ids(tok, model)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.weight.shape[0], device=device))
    with torch.no_grad():
        head.bias[stop[-1]] = a.stop_bias
    task = ArithmeticTask(seed=0)
    system = Path(a.system_file).read_text().strip() if a.system_file else None
    prompts = encode_prompts(tok, [task[i] for i in range(a.rows)], system)
    appended = Turns(tok, stop).after([{"role": "user", "content": a.reply}])
    total = a.turns * a.turn_tokens
    multi = SamplingParams(max_new_tokens=total + a.turns * len(appended), temperature=1.0, max_turn_tokens=a.turn_tokens)
    single = SamplingParams(max_new_tokens=total, temperature=1.0)
    results = {"model": a.model, "card": card, "torch": torch.__version__, "rows": a.rows, "turns": a.turns,
               "turn_tokens": a.turn_tokens, "appended_ids": len(appended), "stop_bias": a.stop_bias, "system_file": a.system_file,
               "prompt_tokens_mean": statistics.mean(map(len, prompts)), "engines": {}}
    for name in a.engines.split(","):
        engine = (GraphEngine(model, tok, stop_ids=stop, device=device, autocast_dtype=autocast) if name == "graph"
                  else HFEngine(model, tok, stop_ids=stop, device=device, autocast_dtype=autocast))
        gen = torch.Generator(device=device).manual_seed(0)
        engine.generate(prompts, 1, single, generator=gen)  # warm-up: graphs captured, caches allocated
        engine.generate(prompts, 1, multi, generator=gen, turns=Conversation(appended, a.turns))

        def run(params, turns=None):
            sync(device)
            t0 = time.perf_counter()
            out = engine.generate(prompts, 1, params, generator=gen, turns=turns)
            sync(device)
            return time.perf_counter() - t0, out

        st, mt = [], []
        for _ in range(a.repeats):
            secs, out = run(single)
            st.append((secs, int(out.sampled.sum())))
            secs, out = run(multi, Conversation(appended, a.turns))
            mt.append((secs, int(out.sampled.sum()), out))
        single_tps = statistics.median(n / s for s, n in st)
        multi_tps = statistics.median(n / s for s, n, _ in mt)
        last = mt[-1][2]
        turns_per_row = [len([1 for i in range(1, len(m)) if m[i] and not m[i - 1]]) + int(bool(m[0]))
                         for m in last.sampled.tolist()]
        # Prefill of later turns: the extensions of one multi-turn generate, each against re-prefilling its rows
        extends = []
        timed(engine, "_extend", device, extends)
        histories = []
        convo = Conversation(appended, a.turns)

        def recording(rows, turn_ids):
            answers = convo(rows, turn_ids)
            histories.append([r for r, ans in zip(rows, answers) if ans])
            return answers

        _, out = run(multi, recording)
        del engine._extend  # the engine's own method again
        per_turn = []
        for k, ((secs, _), rows) in enumerate(zip(extends, [h for h in histories if h])):
            # row r's history at this extension: the prompt and its completion up to the end of its k-th answer
            full = []
            for r in rows:
                sampled, ids = out.sampled[r].tolist(), out.completion_ids[r].tolist()
                ends, seen = len(ids), 0
                for i in range(1, len(ids)):
                    if sampled[i] and not sampled[i - 1]:
                        seen += 1
                        if seen == k + 1:
                            ends = i
                            break
                full.append(prompts[r] + ids[:ends])
            one = SamplingParams(max_new_tokens=1, temperature=1.0)
            engine.generate(full, 1, one, generator=gen)  # warm-up of this shape
            again = statistics.median(run_prefill(engine, full, one, gen, device) for _ in range(a.repeats))
            per_turn.append({"turn": k + 2, "rows": len(rows), "history_tokens_mean": statistics.mean(map(len, full)),
                             "extend_ms": 1000 * secs, "reprefill_ms": 1000 * again, "ratio": secs / again})
        results["engines"][name] = {
            "single_turn_tokens_per_s": single_tps, "multi_turn_tokens_per_s": multi_tps,
            "multi_over_single": multi_tps / single_tps, "turns_per_row_mean": statistics.mean(turns_per_row),
            "sampled_tokens_per_row": statistics.mean(n for _, n, _ in mt) / a.rows, "later_turns": per_turn}
        Path(a.out).write_text(json.dumps(results, indent=1))
        engine = None
    print(f"\n{a.model} on {card}: {a.rows} rows, prompts of {results['prompt_tokens_mean']:.0f} tokens, up to {a.turns} "
          f"turns of up to {a.turn_tokens} tokens, {len(appended)} appended ids a turn")
    print("| engine | single-turn tokens/s | multi-turn tokens/s | multi / single | turns a row |")
    print("|---|---|---|---|---|")
    for name, r in results["engines"].items():
        print(f"| {name} | {r['single_turn_tokens_per_s']:,.0f} | {r['multi_turn_tokens_per_s']:,.0f} | "
              f"{r['multi_over_single']:.2f} | {r['turns_per_row_mean']:.2f} |")
    # appended / history: the ratio's floor where both prefills cost the same per token
    print("\n| engine | turn | rows | history tokens | later turn's prefill ms | re-prefill ms | ratio | appended / history |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results["engines"].items():
        for t in r["later_turns"]:
            print(f"| {name} | {t['turn']} | {t['rows']} | {t['history_tokens_mean']:.0f} | {t['extend_ms']:.1f} | "
                  f"{t['reprefill_ms']:.1f} | {t['ratio']:.3f} | {len(appended) / t['history_tokens_mean']:.3f} |")


def run_prefill(engine, prompts, params, gen, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.generate(prompts, 1, params, generator=gen)
    sync(device)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
