"""Plain-text tables of ``gspo summary`` and ``gspo eval`` for a terminal: a label column and a value column per run,
aligned with spaces and no wider than 80 columns where the values allow (``--json`` gives the same numbers whole)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

WIDTH = 80
GAP = "  "


def _number(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def _percent(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{100 * v:.{digits}f}%"


def _seconds(v: Any) -> str:
    return f"{v:.1f} s"


# key -> (label, format); keys not listed here are shown under their own name.
SUMMARY = {
    "steps": ("optimizer steps", str),
    "rollout_batches": ("rollout batches", str),
    "reward_first": ("reward, first batch", _number(3)),
    "reward_first3": ("reward, first 3 batches", _number(3)),
    "reward_last3": ("reward, last 3 batches", _number(3)),
    "reward_last10": ("reward, last 10 batches", _number(3)),
    "reward_best": ("reward, best batch", _number(3)),
    "clip_token_frac_offpolicy": ("clipped tokens, off-policy", _percent(2)),
    "clip_seq_frac_offpolicy": ("clipped sequences, off-policy", _percent(2)),
    "entropy_first": ("entropy, first step", _number(3)),
    "entropy_last": ("entropy, last step", _number(3)),
    "len_first": ("response tokens, first step", _number(1)),
    "len_last": ("response tokens, last step", _number(1)),
    "wall_s": ("training time", _seconds),
    "moe_flip_rate_mean": ("MoE routing flips per update", _percent(3)),
}

EVAL = {
    "model": ("model", str),
    "task": ("task", str),
    "n": ("examples", str),
    "greedy_accuracy": ("greedy accuracy", _number(3)),
    "samples": ("samples per example", str),
    "pass@1": ("pass@1 over the samples", _number(3)),
    "greedy_reward": ("greedy mean reward", _number(3)),
    "greedy_turns": ("greedy assistant turns", _number(2)),
    "reward": ("mean reward over the samples", _number(3)),
    "turns": ("assistant turns over the samples", _number(2)),
    "greedy_len_p10": ("greedy response tokens, p10", _number(1)),
    "greedy_len_median": ("greedy response tokens, median", _number(1)),
    "greedy_len_p90": ("greedy response tokens, p90", _number(1)),
    "greedy_len_max": ("greedy response tokens, most", str),
    "greedy_truncated": ("greedy responses cut off", _percent(1)),
    "wall_s": ("wall-clock", _seconds),
}


def _cell(formats: dict, key: str, value: Any) -> str:
    if value is None:
        return "-"
    fmt = formats.get(key, (key, lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)))[1]
    return fmt(value)


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    return "\n".join(GAP.join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _rows(formats: dict, records: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> list[list[str]]:
    """A row per key, in ``formats``' order and then any other key the records carry: its label, then one value per
    record."""
    keys = [k for k in formats if any(k in r for r in records)]
    keys += [k for r in records for k in r if k not in formats and k not in keys]
    return [[formats.get(k, (k,))[0], *(_cell(formats, k, r.get(k)) for r in records)] for k in keys if k not in skip]


def _blocks(rows: list[list[str]], width: int) -> list[list[list[str]]]:
    """The value columns split into tables that each fit ``width`` (at least one column each), the labels in each."""
    label = max(len(row[0]) for row in rows)
    blocks, used, start = [], label, 1
    for j in range(1, len(rows[0])):
        column = max(len(row[j]) for row in rows) + len(GAP)
        if used + column > width and j > start:
            blocks.append([[row[0], *row[start:j]] for row in rows])
            used, start = label, j
        used += column
    blocks.append([[row[0], *row[start:]] for row in rows])
    return blocks


def _run_names(run_dirs: list[str]) -> list[str]:
    """Each run's folder name, or the paths as given where two names are the same."""
    names = [Path(d).name or d for d in run_dirs]
    return names if len(set(names)) == len(names) else run_dirs


def window_label(label: str, window: int, batches: list[int]) -> str:
    """``label`` of a number over ``window`` rollout batches, as computed for runs of ``batches`` batches each: over
    all of them where a run has fewer ("last 10" of a 2-batch run is its 2)."""
    short = {n for n in batches if n < window}
    if not short:
        return label
    if len(short) == 1 and len(set(batches)) == 1:
        n = short.pop()
        return label.replace(f" {window}", f" {n}", 1).replace(" 1 batches", " 1 batch")
    return f"{label} (or all, where fewer)"


# the SUMMARY keys taken over a window of rollout batches, and its size
WINDOWS = {"reward_first3": 3, "reward_last3": 3, "reward_last10": 10}


def summary_table(summaries: list[dict[str, Any]], width: int = WIDTH) -> str:
    """The headline numbers of runs, one column per run (headed by its directory), as many tables as 80 columns
    need; a number over a window of batches is labelled with what it was computed over on short runs."""
    batches = [s.get("rollout_batches", 0) for s in summaries]
    formats, seen = {}, set()
    for k, (label, fmt) in SUMMARY.items():
        if k in WINDOWS and max(batches, default=0) <= 1:
            continue  # one batch each: every window is the first batch, which has its row
        label = window_label(label, WINDOWS[k], batches) if k in WINDOWS else label
        if label not in seen:  # (a 2-batch run's last 3 and last 10 are one number: one row)
            formats[k] = (label, fmt)
            seen.add(label)
    skip = ("run_dir", *(k for k in SUMMARY if k not in formats))
    rows = [["run", *_run_names([s["run_dir"] for s in summaries])], *_rows(formats, summaries, skip=skip)]
    return "\n\n".join(_aligned(block) for block in _blocks(rows, width))


def eval_table(result: dict[str, Any]) -> str:
    """An evaluation's numbers, one per line."""
    return _aligned(_rows(EVAL, [result]))
