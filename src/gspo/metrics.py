"""Metric sinks: ``metrics.jsonl`` (the source of truth, one line per optimizer step), ``samples.jsonl`` and the console.
The optional TensorBoard and W&B sinks are in :mod:`gspo.sinks`.

The metric names are a public interface documented in the README; keep them stable.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; null says "not measurable this step"
    return v


class JsonlWriter:
    """Append-only JSONL file flushed after every line, so a killed run loses at most the line being written."""

    def __init__(self, path: Path, *, keep: Callable[[dict[str, Any]], bool] | None = None):
        self.path = path
        if keep is not None and path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip() and keep(json.loads(ln))]
            path.write_text("".join(ln + "\n" for ln in lines))
        self._f = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


class Console:
    """Live progress: a rich progress bar on a terminal, one plain line per rollout batch elsewhere (CI, logs)."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.time()
        self.total = total_steps
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]gspo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.description}"), transient=False)
            self._task = self._bar.add_task("", total=total_steps, completed=start_step)
            self._bar.start()

    def update(self, step: int, row: dict[str, Any], end_of_batch: bool) -> None:
        if not self.enabled:
            return
        desc = (f"reward {row.get('reward/mean', float('nan')):.3f}  clip tok {100 * row.get('clip/token_total', 0):.2f}% "
                f"seq {100 * row.get('clip/seq_total', 0):.1f}%  len {row.get('completion/len_mean', 0):.0f}  "
                f"rollout {row.get('throughput/rollout_tok_s', 0):.0f} tok/s")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=desc)
        elif end_of_batch:
            print(f"[gspo] step {step}/{self.total}  {desc}  ({time.time() - self.t0:.0f}s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The headline numbers of a run from its metrics.jsonl: reward at the start and end, clipping, entropy, time."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    if not rows:
        return {"run_dir": str(run_dir), "steps": 0}
    batches: dict[int, dict[str, Any]] = {}
    for r in rows:
        batches.setdefault(r["rollout_batch"], r)
    rewards = [b["reward/mean"] for b in batches.values() if b.get("reward/mean") is not None]
    off = [r for r in rows if r.get("minibatch", 0) > 0] or rows

    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    return {
        "run_dir": str(run_dir), "steps": rows[-1]["step"], "rollout_batches": len(batches),
        "reward_first": rewards[0], "reward_first3": mean(rewards[:3]), "reward_last3": mean(rewards[-3:]),
        "reward_last10": mean(rewards[-10:]), "reward_best": max(rewards),
        "clip_token_frac_offpolicy": mean([r.get("clip/token_total") for r in off]),
        "clip_seq_frac_offpolicy": mean([r.get("clip/seq_total") for r in off]),
        "entropy_first": rows[0].get("entropy"), "entropy_last": rows[-1].get("entropy"),
        "len_first": rows[0].get("completion/len_mean"), "len_last": rows[-1].get("completion/len_mean"),
        "wall_s": rows[-1].get("time/elapsed"),
    }
