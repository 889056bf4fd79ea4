"""The numbers of docs/experiments/ from the run directories of `gspo compare` (benchmarks/run_on_gpu.sh experiments):
per arm (mean over seeds, and the spread), per minibatch index, and per response-length bin. Prints markdown tables
and writes JSON.

    python benchmarks/experiments_summary.py runs/depth runs/engine --out summary.json

Collapse: a run whose mean reward over its last 10 rollout batches is below half its best 5-batch moving average (a
positive one). Runs that have not logged every step of their config are left out.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gspo.runlog.metrics import mean_present
from gspo.commands.report import key_metrics, length_bins_seen, load_run, minibatch_means, name_arms


def _mean(xs: list) -> float | None:
    """The mean of the values present; None (a "-" in the tables, null in the JSON) when there is none."""
    return mean_present(xs, empty=None)


def _runs(dirs: list[str]) -> dict[str, list]:
    """Finished runs (every optimizer step of their config logged) by arm, the label compare gave them, in the order
    met; an arm found in two of ``dirs`` is two arms, ``<dir>/<arm>``, and an arm's runs that differ in more than their
    seed are arms of their own, named by the settings that differ (as the report names them)."""
    found: dict[tuple[str, str], list] = {}
    for d in dirs:
        runs = [load_run(r) for r in sorted(Path(d).glob("*-seed*"))
                if ".incomplete-" not in r.name and (r / "metrics.jsonl").exists()]
        finished = [r for r in runs if r.metrics[-1]["step"] >= r.config.get("train", {}).get("steps", 0)]
        for run in name_arms(finished):
            found.setdefault((Path(d).name, run.algorithm), []).append(run)
    labels = [arm for _, arm in found]
    return {(arm if labels.count(arm) == 1 else f"{d}/{arm}"): runs for (d, arm), runs in found.items()}


def arm_row(arm: str, runs: list) -> dict:
    keys = [key_metrics(r) for r in runs]
    out = {"arm": arm, "seeds": len(runs)}
    for k in ("reward_first", "reward_final", "reward_best", "largest_drop", "clip_token", "clip_seq",
              "ratio_token_std", "ratio_seq_std", "engine_gap"):
        out[k] = _mean([m[k] for m in keys])
    finals = [m["reward_final"] for m in keys]
    out["reward_final_min"], out["reward_final_max"] = min(finals), max(finals)
    out["collapsed"] = sum(m["reward_final"] is not None and m["reward_best"] is not None and m["reward_best"] > 0
                           and m["reward_final"] < 0.5 * m["reward_best"] for m in keys)
    first = [[r for r in run.metrics if r.get("minibatch", 0) == 0] for run in runs]
    out["accuracy_final"] = _mean([_mean([r.get("accuracy") for r in b[-10:]]) for b in first])
    out["length_final"] = _mean([_mean([r.get("completion/len_mean") for r in b[-10:]]) for b in first])
    out["truncated_final"] = _mean([_mean([r.get("completion/truncated_frac") for r in b[-10:]]) for b in first])
    out["engine_seq_gap"] = _mean([_mean([r.get("logprob/engine_seq_diff_mean") for r in b])
                                   for b in first])
    out["logprob_pass_s"] = _mean([_mean([r.get("time/logprobs") for r in b]) for b in first])
    out["batch_s"] = _mean([(b[-1]["time/elapsed"] - b[0]["time/elapsed"]) / max(1, len(b) - 1) for b in first])
    return out


def depth_rows(arm: str, runs: list) -> list[dict]:
    keys = ("clip/token_total", "clip/seq_total", "ratio/token_std", "ratio/seq_std", "kl/old_new")
    by_key = {key: minibatch_means(runs, key) for key in keys}
    return [{"arm": arm, "minibatch": k, **{key: by_key[key][k] for key in keys}} for k in by_key[keys[0]]]


def length_rows(arm: str, runs: list) -> list[dict]:
    off = [r for run in runs for r in run.metrics if run.off_policy(r)]  # as the report's by-length figure
    return [{"arm": arm, "bin": n, "responses": int(sum(r.get(f"bylen/{n}/seqs") or 0 for r in off)),
             **{key: _mean([r.get(f"bylen/{n}/{key}") for r in off])
                for key in ("clip_token", "ratio_token_std", "ratio_seq_std")}}
            for n in length_bins_seen(off)]


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="output directories of gspo compare")
    ap.add_argument("--out", help="write the tables as JSON here")
    ap.add_argument("--arms", help="comma-separated arms to keep (default: all)")
    args = ap.parse_args()
    arms = _runs(args.dirs)
    if args.arms:
        keep = args.arms.split(",")
        arms = {a: arms[a] for a in keep if a in arms}
    summary = {"arms": [arm_row(a, rs) for a, rs in arms.items()],
               "by_minibatch": [row for a, rs in arms.items() for row in depth_rows(a, rs)],
               "by_length": [row for a, rs in arms.items() for row in length_rows(a, rs)]}
    print(_table(summary["arms"], ["arm", "seeds", "reward_first", "reward_final", "reward_final_min",
                                   "reward_final_max", "reward_best", "largest_drop", "collapsed", "accuracy_final",
                                   "length_final", "truncated_final", "clip_token", "clip_seq", "ratio_token_std",
                                   "ratio_seq_std", "engine_gap", "engine_seq_gap", "logprob_pass_s", "batch_s"]))
    print(_table(summary["by_minibatch"], ["arm", "minibatch", "clip/token_total", "clip/seq_total", "ratio/token_std",
                                           "ratio/seq_std", "kl/old_new"]))
    if summary["by_length"]:
        print(_table(summary["by_length"], ["arm", "bin", "responses", "clip_token", "ratio_token_std", "ratio_seq_std"]))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
