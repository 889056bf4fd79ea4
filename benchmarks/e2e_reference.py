"""End-to-end reference runs: gspo's algorithms and TRL's GRPOTrainer on the "a + b" task, side by side.

Reference settings (benchmarks/README.md#end-to-end-reference-run): SmolLM2-135M-Instruct, a, b in 1..20,
32 prompts x 8 completions, 4 minibatches of 64, 128 new tokens, temperature 1, lr 5e-6, beta 0, 160 optimizer steps.
These are the GPU values of configs/quickstart.toml.

  python benchmarks/e2e_reference.py run --model /root/smollm2/model.gguf --algos gspo,grpo --out $OUT [--tag _warm]
  python benchmarks/e2e_reference.py trl --script .gpu/b/peer_trl.py --model /root/smollm2/model.gguf --levels sequence,token --out $OUT
  python benchmarks/e2e_reference.py table $OUT      # table + JSON from the collected files

``run`` and ``trl`` write, per run, ``<name>/metrics.jsonl`` and ``<name>/timings.json`` (gspo) or ``trl_<level>.json``
(TRL) and a ``<name>.meta.json`` with the wall-clock and the card; ``table`` prints the comparison and where gspo's
seconds go, and writes ``summary.json`` beside them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _meta(out: Path, name: str, wall: float, cmd: list[str], rc: int) -> None:
    import torch
    import transformers

    (out / f"{name}.meta.json").write_text(json.dumps({
        "name": name, "wall_s": round(wall, 1), "card": _card(), "returncode": rc, "command": " ".join(cmd),
        "torch": torch.__version__, "transformers": transformers.__version__}, indent=1))


def cmd_run(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for algo in a.algos.split(","):
        name = f"{algo}{a.tag}"
        run_dir = Path(a.scratch) / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "gspo.cli", "train", str(ROOT / "configs/quickstart.toml"), "--run-dir", str(run_dir),
               f"algorithm='{algo}'", f"model.name='{a.model}'", f"seed={a.seed}", "log.checkpoint_every=0", *a.extra]
        t0 = time.time()
        rc = subprocess.call(cmd)
        wall = time.time() - t0
        (out / name).mkdir(exist_ok=True)
        for f in ("metrics.jsonl", "samples.jsonl", "config.json", "timings.json"):
            if (run_dir / f).exists():
                shutil.copy(run_dir / f, out / name / f)
        _meta(out, name, wall, cmd, rc)
        print(f"[e2e] {name}: rc={rc} wall={wall:.0f}s", flush=True)


def cmd_trl(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for level in a.levels.split(","):
        name = f"trl_{level}"
        cmd = [sys.executable, a.script, "--gguf", a.model, "--level", level, "--steps", str(a.steps), "--seed", str(a.seed),
               "--out", str(out / f"{name}.json")]
        t0 = time.time()
        rc = subprocess.call(cmd)
        _meta(out, name, time.time() - t0, cmd, rc)
        print(f"[e2e] {name}: rc={rc} wall={time.time() - t0:.0f}s", flush=True)


def _trl_summary(path: Path) -> dict:
    data = json.loads(path.read_text())
    steps = [h for h in data["log_history"] if "loss" in h]  # one line per optimizer step
    per_batch = [h["reward"] for h in steps if "reward" in h]  # reward is logged once per rollout batch
    # Steps 1-3 of every 4 are off-policy; TRL counts the clipped fraction per token (for GSPO: tokens of clipped sequences).
    clip = [h.get("clip_ratio/region_mean") for i, h in enumerate(steps) if i % 4 != 0]
    clip = [c for c in clip if c is not None]
    ent = [h["entropy"] for h in steps if "entropy" in h]
    return {"reward_first": per_batch[0], "reward_last10": sum(per_batch[-10:]) / len(per_batch[-10:]),
            "clip_frac_offpolicy": sum(clip) / len(clip) if clip else None,
            "entropy_first": ent[0] if ent else None, "entropy_last": ent[-1] if ent else None,
            "wall_s_trainer": data["summary"]["wall_s"]}


def cmd_table(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from gspo.runlog.metrics import summarize

    res = Path(a.results)
    rows = []
    for meta_path in sorted(res.glob("*.meta.json")):
        meta = json.loads(meta_path.read_text())
        name = meta["name"]
        if name.startswith("trl_"):
            s = _trl_summary(res / f"{name}.json")
            clip = f"{100 * s['clip_frac_offpolicy']:.2f}% ({'seq' if 'sequence' in name else 'tok'})" if s["clip_frac_offpolicy"] is not None else "-"
            rows.append({"run": f"TRL {name[4:]}", **s, **meta, "train_loop_s": s["wall_s_trainer"], "clip": clip})
        else:
            s = summarize(res / name)
            rows.append({"run": f"gspo {name}", **s, **meta, "train_loop_s": s["wall_s"],
                         "clip": f"{100 * s['clip_token_frac_offpolicy']:.2f}% tok / {100 * s['clip_seq_frac_offpolicy']:.1f}% seq"})
    head = ("| run | card | wall-clock (process) | training loop | reward first batch | reward last-10 mean | "
            "clipped (off-policy steps) | entropy start -> end |")
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ent = f"{r['entropy_first']:.2f} -> {r['entropy_last']:.2f}" if r.get("entropy_first") is not None else "-"
        print(f"| {r['run']} | {r['card']} | {r['wall_s']:.0f} s | {r['train_loop_s']:.0f} s | {r['reward_first']:.3f} | {r['reward_last10']:.3f} | {r['clip']} | {ent} |")
    timed = [(r, json.loads((res / r["name"] / "timings.json").read_text())) for r in rows
             if (res / r["name"] / "timings.json").exists()]
    if timed:  # where each second of gspo's process goes
        cols = [("process_start_to_trainer", "imports + config"), ("model_load", "model load"), ("engine", "engine"),
                ("first_rollout_at", "first rollout at"), ("first_collect_s", "first batch (engine warm-up)"),
                ("loop_s", "training loop"), ("final_checkpoint_s", "final checkpoint"), ("process_s", "process")]
        print("\n| run | " + " | ".join(c for _, c in cols) + " |\n|---|" + "---|" * len(cols))
        for r, t in timed:
            cells = [f"{t.get(k, float('nan')):.1f} s" for k, _ in cols]
            cells[4] = f"{t['first_collect_s']:.1f} s ({t['engine_warmup_s']:.1f} s)"
            print(f"| {r['run']} | " + " | ".join(cells) + " |")
            r["timings"] = t
    (res / "summary.json").write_text(json.dumps(rows, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2-135m-instruct")
    r.add_argument("--algos", default="gspo,grpo")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--out", required=True)
    r.add_argument("--scratch", default="/tmp/gspo-e2e")
    r.add_argument("--tag", default="", help="suffix of the run names (e.g. _warm for a second run on a warm cache)")
    r.add_argument("extra", nargs="*", help="extra key=value overrides for every run")
    r.set_defaults(func=cmd_run)
    t = sub.add_parser("trl")
    t.add_argument("--script", required=True)
    t.add_argument("--model", required=True)
    t.add_argument("--levels", default="sequence,token")
    t.add_argument("--steps", type=int, default=160)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--out", required=True)
    t.set_defaults(func=cmd_trl)
    b = sub.add_parser("table")
    b.add_argument("results")
    b.set_defaults(func=cmd_table)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
