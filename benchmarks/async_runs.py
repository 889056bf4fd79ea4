"""Asynchronous rollouts against the synchronous loop: the reference run (configs/quickstart.toml, or ``--config``) at several
``rollout.max_staleness`` values, one process at a time on one GPU, then a table of wall-clock and reward.

  python benchmarks/async_runs.py run --model /root/smollm2/model.gguf --out $OUT \\
      --runs gspo:0:1,gspo:1:1,gspo:1:1:off [-- key=value ...]
      # algorithm:eta:seed[:overlap[:nproc[:decode[:in_flight[:decode_gpu]]]]], e.g. gspo:1:1:thread:2:1:off:shared
  python benchmarks/async_runs.py table $OUT                       # prints the table, writes async_summary.json

Per run: the process's and the loop's wall-clock (``timings.json``), the first batch's time, the loop's median time
per batch over the run's first third and over its last half, the reward of the first and the last 10 rollout batches,
the loop time at which the 5-batch running mean of the reward first reached ``--target`` (default 0.8), the
staleness, and how long the actor and the engine waited for each other per batch (means, and medians after the first
batch); the slowest batch after the first, every batch's reward and a digest of every step's loss (two runs that
computed the same thing have the same). ``metrics.jsonl`` and
``timings.json`` of each run are copied under ``--out/<name>/``.

With ``log.profile_batch = b`` among the overrides, each run's profiled batch is also read from its Chrome trace: how
long the GPU ran kernels of any stream in that batch, of each stream, and of two streams at once (the overlap of the
engine's decode with the update's passes), written to ``--out/<name>/gpu_busy.json`` with the profile's tables.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_name(spec: str) -> tuple[str, list[str], int, int]:
    """``algorithm:eta:seed[:overlap[:nproc[:decode[:in_flight[:decode_gpu]]]]]`` -> the run's name, its overrides, its
    processes and its GPUs (``nproc`` processes under ``gspo train --nproc``, ``decode`` of them decode processes, each
    on a GPU of its own or, with ``decode_gpu`` = ``shared``, on a trainer's; ``in_flight`` is ``rollout.in_flight``)."""
    algo, eta, seed, *rest = spec.split(":")
    overlap = rest[0] if rest else "thread"
    nproc = int(rest[1]) if len(rest) > 1 else 1
    decode = int(rest[2]) if len(rest) > 2 else 0
    in_flight = rest[3] if len(rest) > 3 else "off"
    decode_gpu = rest[4] if len(rest) > 4 else "own"
    name = (f"{algo}_eta{eta}_s{seed}" + ("" if overlap == "thread" else f"_{overlap}")
            + (f"_n{nproc}" if nproc > 1 else "") + (f"_d{decode}" if decode else "")
            + ("" if in_flight == "off" else f"_{in_flight}") + ("" if decode_gpu == "own" else f"_{decode_gpu}"))
    return name, [f"algorithm='{algo}'", f"rollout.max_staleness={eta}", f"rollout.overlap='{overlap}'", f"seed={seed}",
                  f"rollout.decode_processes={decode}", f"rollout.in_flight='{in_flight}'",
                  f"rollout.decode_gpu='{decode_gpu}'"], nproc, nproc - decode if decode_gpu == "shared" else nproc


def gpu_busy(trace: Path) -> dict:
    """The GPU's kernel time in a ``torch.profiler`` Chrome trace: the union of all kernels' intervals, each stream's,
    and the time two or more streams ran kernels at once, against the trace's span (first kernel start to last end)."""
    import gzip

    events = json.loads(gzip.open(trace).read())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1)) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not kernels:
        return {}
    # a sweep over start/end points: how many streams are busy between consecutive points
    points = sorted([(a, 1, s) for a, _, s in kernels] + [(b, -1, s) for _, b, s in kernels])
    running: dict[int, int] = {}
    busy = overlap = 0.0
    per_stream: dict[int, float] = {}
    last = points[0][0]
    for t, d, s in points:
        live = [k for k, v in running.items() if v > 0]
        if live:
            busy += t - last
            if len(live) > 1:
                overlap += t - last
            for k in live:
                per_stream[k] = per_stream.get(k, 0.0) + t - last
        running[s] = running.get(s, 0) + d
        last = t
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "busy_fraction": busy / span, "two_streams_ms": overlap / 1e3,
            "kernels": len(kernels), "stream_busy_ms": {str(k): v / 1e3 for k, v in sorted(per_stream.items())}}


def cmd_run(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in a.runs.split(","):
        name, overrides, nproc, gpus = run_name(spec)
        run_dir = Path(a.scratch) / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "gspo.cli", "train", str(ROOT / a.config), "--run-dir",
               str(run_dir), f"model.name='{a.model}'", "log.checkpoint_every=0", *overrides, *a.extra,
               *(["--nproc", str(nproc)] if nproc > 1 else [])]
        t0 = time.time()
        rc = subprocess.call(cmd)
        wall = time.time() - t0
        (out / name).mkdir(exist_ok=True)
        for f in ("metrics.jsonl", "timings.json", "profile/rank0.txt"):
            if (run_dir / f).exists():
                shutil.copy(run_dir / f, out / name / Path(f).name)
        if (run_dir / "profile/rank0.trace.json.gz").exists():
            (out / name / "gpu_busy.json").write_text(json.dumps(gpu_busy(run_dir / "profile/rank0.trace.json.gz"),
                                                                 indent=1))
        import torch

        card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        card = card if gpus == 1 else f"{gpus} x {card}"
        card += "" if gpus == nproc else f" ({nproc} processes)"
        (out / name / "meta.json").write_text(json.dumps({"name": name, "wall_s": round(wall, 1), "rc": rc,
                                                          "card": card, "command": " ".join(cmd)}, indent=1))
        print(f"[async] {name}: rc={rc} wall={wall:.0f}s", flush=True)


def summary(run: Path, target: float) -> dict:
    """One run's numbers (see the module docstring)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = [r for r in rows if r.get("minibatch", 0) == 0]  # one line per rollout batch
    rewards = [r["reward/mean"] for r in first]
    # time/elapsed is logged after each optimizer step: a batch's reward is known once its first step is logged
    reached = None
    # the loop's time per batch (between two batches' first logged steps), its median over the first third of the run
    # (longer responses) and over the last half, where the one-off costs (the first batch, a graph captured for a new
    # shape) do not weigh as they do in the loop's total
    elapsed = [r["time/elapsed"] for r in first]
    gaps = [b - a for a, b in zip(elapsed, elapsed[1:])]
    for i in range(4, len(first)):
        if sum(rewards[i - 4:i + 1]) / 5 >= target:
            reached = first[i]["time/elapsed"]
            break
    timings = json.loads((run / "timings.json").read_text()) if (run / "timings.json").exists() else {}
    meta = json.loads((run / "meta.json").read_text()) if (run / "meta.json").exists() else {}

    def mean(key, lines=first):
        vals = [r[key] for r in lines if key in r]
        return sum(vals) / len(vals) if vals else None

    def waits(key):
        vals = [r[key] for r in first[1:] if key in r]
        if not vals:
            return None
        return {"after_first": statistics.median(vals), "first_third": statistics.median(vals[:max(len(vals) // 3, 1)]),
                "last_half": statistics.median(vals[len(vals) // 2:])}

    off_policy = [r for r in rows if r.get("minibatch", 0) > 0]  # where ratios move and the clip acts

    return {"name": run.name, "card": meta.get("card"), "process_s": meta.get("wall_s"),
            "loop_s": timings.get("loop_s"),
            "batches": len(first), "first_batch_s": elapsed[0],
            "batch_s_first_third": statistics.median(gaps[:max(len(gaps) // 3, 1)]) if gaps else None,
            "batch_s_last_half": statistics.median(gaps[len(gaps) // 2:]) if gaps else None,
            "reward_first": rewards[0], "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
            "time_to_target_s": reached, "staleness_max": max((r.get("async/staleness_max", 0.0) for r in first)),
            "staleness_mean": mean("async/staleness_mean"), "swaps": mean("async/swaps"),
            "actor_wait_s": mean("async/actor_wait_s"), "engine_wait_s": mean("async/engine_wait_s"),
            "collect_s": mean("time/collect"), "update_s": sum(r["time/update"] for r in rows) / max(len(first), 1),
            "logprobs_s": mean("time/logprobs"),
            "clip_seq": mean("clip/seq_total", off_policy), "clip_token": mean("clip/token_total", off_policy),
            "mismatch_weight_mean": mean("mismatch/weight_mean"), "mismatch_weight_max": mean("mismatch/weight_max"),
            "entropy_last": first[-1].get("entropy"), "final_step": rows[-1]["step"],
            "memory_peak_gib": max((r["memory/peak_gib"] for r in rows if r.get("memory/peak_gib")), default=None),
            "explained_variance_last": first[-1].get("critic/explained_variance"),
            "gpu_busy": json.loads((run / "gpu_busy.json").read_text()) if (run / "gpu_busy.json").exists() else None,
            # after the first batch (whose wait is the whole first collect): the median waits, over the same thirds
            # and halves as the time per batch, and the slowest batch
            "actor_wait_median_s": waits("async/actor_wait_s"), "engine_wait_median_s": waits("async/engine_wait_s"),
            "slowest_batch": max(((i + 1, g) for i, g in enumerate(gaps)), key=lambda x: x[1], default=None),
            "completion_len_last": first[-1].get("completion/len_mean"),
            # to tell whether two runs computed the same thing: every batch's reward, and a digest of every step's loss
            "rewards": rewards,
            "losses_sha256": hashlib.sha256(repr([r.get("loss") for r in rows]).encode()).hexdigest()}


def cmd_table(a: argparse.Namespace) -> None:
    res = Path(a.results)
    out = [summary(run, a.target) for run in sorted(p for p in res.iterdir() if (p / "metrics.jsonl").exists())]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"| run | card | process | loop | first batch | loop per batch: first third / last half (median) | "
          f"reward first → last 10 | loop time to 5-batch mean {a.target} | "
          "staleness | per batch: collect / old log-probs / updates | actor waits | engine waits | profiled batch: "
          "GPU busy, two streams at once |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['name']} | {r['card']} | {f(r['process_s'], '.0f')} s | {f(r['loop_s'], '.1f')} s | "
              f"{r['first_batch_s']:.1f} s | {f(r['batch_s_first_third'], '.3f')} / "
              f"{f(r['batch_s_last_half'], '.3f')} s | "
              f"{r['reward_first']:.3f} → {r['reward_last10']:.3f} | {f(r['time_to_target_s'], '.1f')} s | "
              f"{r['staleness_max']:.0f} | {f(r['collect_s'], '.3f')} / {f(r['logprobs_s'], '.3f')} / "
              f"{f(r['update_s'], '.3f')} s | {f(r['actor_wait_s'], '.3f')} s | {f(r['engine_wait_s'], '.3f')} s | "
              + (f"{g['busy_ms']:.0f} of {g['span_ms']:.0f} ms, {g['two_streams_ms']:.0f} ms |" if (g := r["gpu_busy"])
                 else "- |"))
    (res / "async_summary.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2-135m-instruct")
    r.add_argument("--config", default="configs/quickstart.toml", help="the runs' config, relative to the repository")
    r.add_argument("--runs", default="gspo:0:1,gspo:1:1")
    r.add_argument("--out", required=True)
    r.add_argument("--scratch", default="/tmp/gspo-async")
    r.add_argument("extra", nargs="*", help="extra key=value overrides for every run")
    r.set_defaults(func=cmd_run)
    t = sub.add_parser("table")
    t.add_argument("results")
    t.add_argument("--target", type=float, default=0.8)
    t.set_defaults(func=cmd_table)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
