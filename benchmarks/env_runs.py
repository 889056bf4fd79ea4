"""Multi-turn learning runs (``gspo compare`` of an ``[env]`` config), one row per run: reward at the start and at the
end, turns and tool calls per trajectory, and how far each run got. Prints a markdown table and writes JSON.

    python benchmarks/env_runs.py runs/guess runs/calculator --out env_runs.json

"Start" is the mean over the first 5 rollout batches (the untrained policy's reward, as sampled for training),
"end" over the last 10; with the task's verifier as the reward (the calculator: 1 for the right product) that is the
accuracy of the sampled trajectories.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gspo.commands.report import load_run
from gspo.runlog.metrics import mean_present


def _mean(xs) -> float | None:
    return mean_present([x for x in xs if x is not None], empty=None)


def summarize(run_dir: Path) -> dict:
    run = load_run(run_dir)
    per = lambda key: run.per_batch(key)  # noqa: E731  one value per rollout batch
    reward = per("reward/mean")
    return {"run": run.name, "algorithm": run.algorithm, "seed": run.seed, "steps": run.metrics[-1]["step"],
            "batches": len(reward), "reward_start": _mean(reward[:5]), "reward_end": _mean(reward[-10:]),
            "turns_start": _mean(per("env/turns_mean")[:5]), "turns_end": _mean(per("env/turns_mean")[-10:]),
            "tool_calls_start": _mean(per("env/tool_calls")[:5]), "tool_calls_end": _mean(per("env/tool_calls")[-10:]),
            "tool_errors_end": _mean(per("env/tool_errors")[-10:]),
            "seconds": run.metrics[-1].get("time/elapsed")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = [summarize(d) for root in a.dirs for d in sorted(Path(root).glob("*-seed*")) if (d / "metrics.jsonl").exists()]
    Path(a.out).write_text(json.dumps(rows, indent=1))
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    print("| run | steps | reward start | reward end | turns start -> end | tool calls start -> end | tool errors end |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['steps']} | {f(r['reward_start'], 3)} | {f(r['reward_end'], 3)} | "
              f"{f(r['turns_start'])} -> {f(r['turns_end'])} | {f(r['tool_calls_start'], 1)} -> "
              f"{f(r['tool_calls_end'], 1)} | {f(r['tool_errors_end'], 1)} |")


if __name__ == "__main__":
    main()
