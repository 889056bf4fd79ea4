"""Run directories as one compressed file that holds what `gspo report` and benchmarks/experiments_summary.py read,
so that a docs page keeps the data its figures were drawn from without the raw runs (samples, checkpoints, logs).

    python benchmarks/pack_runs.py pack RUN_DIR ... --out docs/<page>/runs.json.gz [--title TITLE]
    python benchmarks/pack_runs.py unpack docs/<page>/runs.json.gz DIR      # DIR/<run>/config.json, metrics.jsonl, ...
    python benchmarks/pack_runs.py redraw docs/<page>/runs.json.gz --out DIR  # the report's figures, page and tables

What is kept of a run: its whole ``config.json`` (the arm and seed come from it); the metrics lines with only the keys
below; the histogram lines of the off-policy steps of the first run of each arm (the ratio figure draws those alone);
and only the one trace that the token-strip figure picks. ``--keys`` keeps those metrics instead, and no histograms or
traces (the stage timings that benchmarks/scaling.py reads, for tests/fixtures/). ``redraw`` passes the runs in their
packed order, which decides the report's arm order and colours.

Every number comes back bit for bit, and the file is a third smaller than gzipped JSON lines: the metrics are stored
by column; a column whose floats are all float32 values (most metrics are) is written with the shortest decimals that
round to them in float32; any other float that is exactly n / d for d <= 10**6 (the MoE flip rates are counts over
tokens) is written as ``[n, d]``. A key absent from a line is null in its column and absent again after unpacking.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import struct
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# The metrics the report's figures and key numbers, experiments_summary.py's tables and the docs' MoE tables read.
KEYS = {"step", "rollout_batch", "minibatch", "reward/mean", "time/elapsed", "clip/token_total", "clip/seq_total",
        "completion/len_mean", "completion/truncated_frac", "entropy", "ratio/token_std", "ratio/seq_std",
        "logprob/engine_diff_mean", "logprob/engine_seq_diff_mean", "accuracy", "time/logprobs", "kl/old_new",
        "memory/peak_gib"}
PREFIXES = ("bylen/", "moe/")
FORMAT = 1


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _short_f32(v: float) -> float:
    """The shortest decimal that rounds to the float32 value ``v`` (repr of a float32 as numpy prints it)."""
    for digits in range(1, 10):
        s = float(f"{v:.{digits}g}")
        if _f32(s) == v:
            return s
    return v


def _encode(values: list) -> tuple[list, bool]:
    """A column's values as stored, and whether its floats are float32 values."""
    floats = [v for v in values if isinstance(v, float)]
    if floats and all(math.isfinite(v) and _f32(v) == v for v in floats):
        return [_short_f32(v) if isinstance(v, float) else v for v in values], True
    out = []
    for v in values:
        if isinstance(v, float) and math.isfinite(v):
            f = Fraction(v).limit_denominator(10**6)
            if f.denominator > 1 and f.numerator / f.denominator == v:
                v = [f.numerator, f.denominator]
        out.append(v)
    return out, False


def _decode(values: list, f32: bool) -> list:
    if f32:
        return [_f32(v) if isinstance(v, float) else v for v in values]
    return [v[0] / v[1] if isinstance(v, list) else v for v in values]


def pack(run_dirs: list[str], out: str, title: str, keys: set[str] | None = None) -> dict:
    from gspo.commands.report import _pick_trace, group_runs, load_runs

    runs = load_runs(run_dirs)  # an arm's runs that differ in more than their seed are told apart, as the report does
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"two runs share a directory name ({names}); the report names runs by it")
    groups = group_runs(runs)
    picked = None if keys else _pick_trace(groups)
    first_of_arm = set() if keys else {id(g[0]) for g in groups.values()}
    packed = []
    for run in runs:
        hist = [{k: h[k] for k in ("minibatch", "edges", "token", "seq")} for h in run.histograms
                if run.off_policy(h)] if id(run) in first_of_arm else []  # those the report draws
        traces = [picked[1]] if picked and any(t is picked[1] for t in run.traces) else []
        kept = [k for k in dict.fromkeys(k for r in run.metrics for k in r)
                if (k in keys if keys else k in KEYS or k.startswith(PREFIXES))]
        columns, f32 = {}, []
        for k in kept:
            columns[k], is_f32 = _encode([r.get(k) for r in run.metrics])
            if is_f32:
                f32.append(k)
        packed.append({"name": run.name, "config": run.config, "rows": len(run.metrics), "columns": columns,
                       "f32": f32, "histograms": hist, "traces": traces})
    doc = {"format": FORMAT, "title": title, "runs": packed}
    # no name and no time in the header: packing the same runs again gives the same bytes
    with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(json.dumps(doc, separators=(",", ":")).encode())
    return doc


def load(path: str | Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT:
        raise SystemExit(f"{path}: format {doc.get('format')!r}, this script reads {FORMAT}")
    return doc


def metrics(run: dict) -> list[dict]:
    """A packed run's metrics lines."""
    columns = {k: _decode(v, k in run["f32"]) for k, v in run["columns"].items()}
    return [{k: col[i] for k, col in columns.items() if col[i] is not None} for i in range(run["rows"])]


def unpack(path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the packed runs as run directories under ``out_dir``; returns them in their packed order."""
    dirs = []
    for run in load(path)["runs"]:
        d = Path(out_dir) / run["name"]
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(run["config"], indent=1))
        for name, rows in (("metrics", metrics(run)), ("histograms", run["histograms"]), ("traces", run["traces"])):
            if rows:
                (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dirs.append(d)
    return dirs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("run_dirs", nargs="+")
    a.add_argument("--out", required=True)
    a.add_argument("--title", default="gspo report")
    a.add_argument("--keys", help="comma-separated metrics keys to keep instead of the report's")
    u = sub.add_parser("unpack")
    u.add_argument("packed")
    u.add_argument("out_dir")
    r = sub.add_parser("redraw")
    r.add_argument("packed")
    r.add_argument("--out", required=True, help="directory for the report; the runs are unpacked under OUT/runs")
    args = p.parse_args()
    if args.cmd == "pack":
        doc = pack(args.run_dirs, args.out, args.title, set(args.keys.split(",")) if args.keys else None)
        print(f"{args.out}: {len(doc['runs'])} runs, {Path(args.out).stat().st_size:,} bytes")
    elif args.cmd == "unpack":
        for d in unpack(args.packed, args.out_dir):
            print(d)
    else:
        from gspo.commands.report import write_report

        dirs = unpack(args.packed, Path(args.out) / "runs")
        print(f"report: {write_report(dirs, args.out, title=load(args.packed)['title'])}")


if __name__ == "__main__":
    main()
