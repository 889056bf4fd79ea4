"""What the GPU does during the optimizer steps of a profiled rollout batch (``log.profile_batch``), from one
process's ``rank<r>.trace.json.gz``: how much of each gradient all-reduce (DDP) overlaps compute on another stream,
how busy the device is between two consecutive all-reduces (one optimizer step), and which kernels fill a step.
Prints a table and writes JSON.

    python benchmarks/trace_steps.py RUN_DIR/profile/rank0.trace.json.gz --out steps.json

Device kernels, copies and memsets are the trace's ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` events. The
all-reduces are NCCL's fp32 sum kernels of more than ``--min-us`` (the gradient sum; the metrics' reduce and the
log-prob share are smaller and other kernels). What it does not tell:

- an NCCL kernel's time includes its wait for the other processes, so the share of it under compute is not the time
  the overlap saved;
- a step's window runs from one gradient sum to the next: with more than one flat gradient buffer (mixed dtypes), or
  bf16 / fp16 buffers, the windows are not steps;
- "busy" counts every device event that starts in the window (the all-reduce itself and copies included), in full;
- it reads one process's trace (the others' are in the same directory).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> list[dict]:
    """The trace's device events, by start time."""
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                  key=lambda e: e["ts"])


def busy_us(events: list[dict]) -> float:
    """Microseconds in which at least one of ``events`` runs (the union of their intervals)."""
    total, start, end = 0.0, None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            total += 0.0 if end is None else end - start
            start, end = s, t
        else:
            end = max(end, t)
    return total + (0.0 if end is None else end - start)


def overlap_us(a: dict, others: list[dict]) -> float:
    """Microseconds of ``a`` during which one of ``others`` runs."""
    s, t = a["ts"], a["ts"] + a["dur"]
    inside = [{"ts": max(s, e["ts"]), "dur": min(t, e["ts"] + e["dur"]) - max(s, e["ts"])} for e in others
              if e["ts"] < t and e["ts"] + e["dur"] > s]
    return busy_us(inside)


def analyse(trace: dict, min_us: float = 500.0, top: int = 12) -> dict:
    events = device_events(trace)
    sums = [e for e in events if "AllReduce_Sum_f32" in e["name"] and e["dur"] > min_us]
    out = {"all_reduces": [], "steps": []}
    for a in sums:
        others = [e for e in events if e["args"].get("stream") != a["args"].get("stream")]
        out["all_reduces"].append({"us": a["dur"], "overlapped_us": overlap_us(a, others)})
    for a, b in zip(sums, sums[1:]):  # one optimizer step: from one gradient sum to the next
        inside = [e for e in events if a["ts"] <= e["ts"] < b["ts"]]
        kernels = collections.Counter()
        for e in inside:
            kernels[e["name"][:80]] += e["dur"]
        out["steps"].append({"window_ms": (b["ts"] - a["ts"]) / 1e3, "busy_ms": busy_us(inside) / 1e3,
                             "top_kernels_ms": {k: v / 1e3 for k, v in kernels.most_common(top)}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="rank<r>.trace.json.gz of a run's profile/ directory")
    p.add_argument("--min-us", type=float, default=500.0, help="smallest fp32 all-reduce counted as the gradient sum")
    p.add_argument("--top", type=int, default=40, help="kernels kept per step in the JSON (the table prints 12)")
    p.add_argument("--out", default="trace_steps.json")
    a = p.parse_args()
    with gzip.open(a.trace) as f:
        result = analyse(json.load(f), a.min_us, a.top)
    print(f"{'gradient all-reduce us':>24} {'of it under compute':>20}")
    for r in result["all_reduces"]:
        print(f"{r['us']:>24.0f} {r['overlapped_us']:>14.0f} ({r['overlapped_us'] / r['us']:.0%})")
    print(f"{'step window ms':>24} {'device busy ms':>20}")
    for s in result["steps"]:
        print(f"{s['window_ms']:>24.1f} {s['busy_ms']:>20.1f}")
    if result["steps"]:
        print("the first step's kernels (ms):")
        for name, ms in list(result["steps"][0]["top_kernels_ms"].items())[:12]:
            print(f"  {ms:7.2f}  {name}")
        gemm = sum(ms for name, ms in result["steps"][0]["top_kernels_ms"].items() if "gemm" in name.lower()
                   or name.startswith(("nvjet", "sm90_xmma", "cutlass")))
        print(f"  GEMMs among the first step's top {a.top} kernels: {gemm:.2f} ms")
    Path(a.out).write_text(json.dumps({"trace": a.trace, **result}, indent=1))


if __name__ == "__main__":
    main()
