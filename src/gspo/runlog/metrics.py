"""Metric sinks: ``metrics.jsonl`` (the source of truth, one line per optimizer step), ``samples.jsonl`` and the console.
The optional TensorBoard and W&B sinks are in :mod:`gspo.runlog.sinks`.

The metric names are a public interface documented in the README; keep them stable.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gspo.errors import UserError


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; null says "not measurable this step"
    return v


class JsonlWriter:
    """Append-only JSONL file flushed after every line, so a killed run loses at most the line being written.

    ``keep`` rewinds the file to the lines it accepts (on resume and rollback): the kept lines go to a temporary file
    beside it, which is fsynced and renamed over the original, so a process killed mid-rewind leaves either the old
    file or the new one, never an empty or half-written one. A line that does not parse (torn by a full disk or a
    kill) is dropped there. A write that fails (a full disk) truncates the file back to its last whole line and ends
    in one error naming the file.
    """

    def __init__(self, path: Path, *, keep: Callable[[dict[str, Any]], bool] | None = None):
        self.path = path
        try:
            if keep is not None and path.exists():
                lines = [json.dumps(row) for row in read_jsonl(path) if keep(row)]
                replace_atomically(path, "".join(ln + "\n" for ln in lines))
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"Rewriting or opening {str(path)!r} failed ({e.strerror or e}); free disk space or fix the "
                            "directory, then continue with --resume (the file keeps its lines).") from None
        # Unbuffered, at the OS level: a line is on its way to the disk when write() returns, and a failed write can be
        # cut back exactly (a buffered file would keep the failed bytes and flush them again later).
        self._fd = fd

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps({k: _clean(v) for k, v in row.items()}) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # the torn line stays; every reader skips a line that does not parse
            raise UserError(f"Writing a line to {str(self.path)!r} failed ({e.strerror or e}); free disk space or fix "
                            "the directory, then continue with --resume (the file keeps its whole lines).") from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def replace_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the original is untouched; do not leave the half-written copy taking space
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line that does not parse (torn by a full disk or a kill) is skipped with a warning."""
    rows, torn = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                torn += 1
    if torn:
        logging.getLogger("gspo").warning("%s: %d line(s) that do not parse were skipped (torn by a full disk or a "
                                          "kill)", path, torn)
    return rows


class Console:
    """Live progress. On a terminal: a progress line (steps, elapsed time, an estimate of the time left, the phase
    running now: rollout, rewards, old log-probs, update k/M) with each rollout batch's metrics printed above it;
    elsewhere (CI, logs): one plain line per rollout batch. Every line fits 80 columns. While the bar is live, log
    records are printed above it, never onto its line."""

    PHASES = {"rollout": "rollout", "reward": "rewards", "old_logprobs": "old log-probs", "step": "update"}

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, minibatches: int = 1):
        self.enabled = enabled
        self.t0 = time.time()
        self.total = total_steps
        self.start_step = start_step
        self.minibatches = minibatches
        self._minibatch = 0
        self._bar = None
        self._rerouted: list[tuple[logging.StreamHandler, Any]] = []
        if enabled and sys.stderr.isatty():
            from rich.console import Console as Terminal
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            # On stderr, where the run's log goes (stdout may be a pipe); rich prints both streams above the bar.
            self._bar = Progress(TextColumn("[bold]gspo"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), TextColumn("{task.fields[phase]}"),
                                 console=Terminal(file=sys.stderr), transient=False, redirect_stderr=True,
                                 redirect_stdout=True)
            self._task = self._bar.add_task("", total=total_steps, completed=start_step, phase="starting", eta="")
            self._bar.start()
            self._reroute_logs()

    def _reroute_logs(self) -> None:
        """Point the logging handlers that write to the terminal at the bar's console (which prints above the bar);
        their own reference to the terminal would print onto the bar's line, and its next refresh would erase it."""
        for handler in logging.getLogger().handlers + logging.getLogger("gspo").handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stderr__, sys.__stdout__):
                self._rerouted.append((handler, handler.setStream(sys.stderr)))  # rich's proxy, while the bar is live

    def phase(self, stage: str) -> None:
        """The loop entered ``stage`` (a :func:`gspo.runlog.profiler.stage` name); the bar shows the phases users
        know."""
        name = self.PHASES.get(stage)
        if name is None or self._bar is None:
            return
        if stage == "old_logprobs":
            self._minibatch = 0
        elif stage == "step":
            self._minibatch += 1
            name = f"update {self._minibatch}/{self.minibatches}"
        self._bar.update(self._task, phase=name)

    def eta(self, step: int) -> str:
        """The time left at this run's mean pace so far (steps of this process only: a resumed run's earlier ones are
        not its pace); rich's own estimate forgets steps older than 30 s, so it shows nothing when a step is slower."""
        done = step - self.start_step
        if done <= 0:
            return "eta …"
        return f"eta {_clock((time.time() - self.t0) / done * max(self.total - step, 0))}"

    def line(self, step: int, row: dict[str, Any]) -> str:
        """One rollout batch's metrics: reward, clipped tokens and sequences (per cent), mean length."""
        return (f"{step}/{self.total} reward {row.get('reward/mean', float('nan')):.3f} "
                f"clip tok {100 * (row.get('clip/token_total') or 0):.2f}% seq {100 * (row.get('clip/seq_total') or 0):.1f}% "
                f"len {row.get('completion/len_mean') or 0:.0f}")

    def update(self, step: int, row: dict[str, Any], end_of_batch: bool) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, eta=self.eta(step))
            if end_of_batch:
                self._bar.console.print(f"step {self.line(step, row)}", highlight=False, soft_wrap=True)
        elif end_of_batch:  # within 80 columns up to 99,999 steps
            print(f"[gspo] {self.line(step, row)} {self.eta(step)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []


def _clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: hours only when there are any."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def mean_present(values: list[float | None], empty: float | None = float("nan")) -> float | None:
    """The mean of the values that are not None (a metric not measured on some steps); ``empty`` when there is none."""
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else empty


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
    mean = mean_present
    return {
        "run_dir": str(run_dir), "steps": rows[-1]["step"], "rollout_batches": len(batches),
        "reward_first": rewards[0], "reward_first3": mean(rewards[:3]), "reward_last3": mean(rewards[-3:]),
        "reward_last10": mean(rewards[-10:]), "reward_best": max(rewards),
        "clip_token_frac_offpolicy": mean([r.get("clip/token_total") for r in off]),
        "clip_seq_frac_offpolicy": mean([r.get("clip/seq_total") for r in off]),
        "entropy_first": rows[0].get("entropy"), "entropy_last": rows[-1].get("entropy"),
        "len_first": rows[0].get("completion/len_mean"), "len_last": rows[-1].get("completion/len_mean"),
        "wall_s": rows[-1].get("time/elapsed"),
        **({"moe_flip_rate_mean": mean([r.get("moe/flip_rate") for r in rows])}
           if any(r.get("moe/flip_rate") is not None for r in rows) else {}),
    }
