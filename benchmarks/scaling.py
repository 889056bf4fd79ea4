"""Weak scaling of `gspo train` under torchrun (DDP or FSDP2, as `dist.strategy` picks): the reference run with a fixed
number of prompts per GPU, at 1, 2, 4 ... GPUs of one host, side by side on one machine. Prints a table and writes JSON.

    python benchmarks/scaling.py --gpus 1,2,4 --batches 6 [--equal-batch] --out results/scaling.json [key=value ...]
    python benchmarks/scaling.py --summarize RUN_DIR ... --device "NVIDIA H200" --out table.json   # finished runs

``--equal-batch`` adds a one-GPU run with the largest run's total batch: the GPUs sample with their own random
streams, so the curves are two samples of the same training, not the same numbers.

Completions per second are counted over the rollout batches after the first (engine warm-up, CUDA-graph capture and
the first checkpoint-free batch's allocations are left out): (batches - 1) x P x G / the wall-clock time between the
end of the first batch and the end of the last (``time/elapsed`` of their last metrics lines). The median-batch rate,
P x G / the median of those batches' wall-clock times, leaves out the few batches that capture CUDA graphs of the update
for a new packed size, which a short run does not amortise (the reference run has 40 rollout batches).

A rollout ends with its longest response, and a job of W processes waits for the longest of W times as many: once
training shortens responses, the longest of 1,024 is usually longer than the longest of 256. The speed-up "at equal
longest response" separates that wait from the rest: each run's batch time is fitted as a line in the batch's longest
response (``completion/len_max``), least squares over its timed batches, and every run is compared with the one-GPU
baseline at the baseline's mean longest response. What the fit leaves to the longest response it cannot tell from what
goes with it (a batch with a long response tends to have more tokens): it is a decomposition, not a measurement. It
needs longest responses that vary: in short runs every batch is cut at max_new_tokens, and the column stays empty.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.runlog.metrics import read_jsonl  # noqa: E402


def run(n_gpus: int, args, out_dir: Path, prompts: int | None = None) -> dict:
    prompts = prompts or args.prompts_per_gpu * n_gpus
    run_dir = out_dir / f"gpus{n_gpus}-prompts{prompts}"
    base, k = run_dir, 1
    while run_dir.exists():  # the same count listed twice (--gpus 1,2,4,1), or an output directory reused
        run_dir, k = base.with_name(f"{base.name}-{k}"), k + 1
    cmd = [sys.executable, "-m", "gspo.cli", "train", args.config, f"rollout.prompts_per_batch={prompts}",
           f"rollout.group_size={args.group_size}", f"train.steps={args.batches * args.minibatches}",
           f"train.minibatches={args.minibatches}", "log.checkpoint_every=0", "log.progress=false",
           *args.overrides, "--run-dir", str(run_dir), "--nproc", str(n_gpus)]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        return {"gpus": n_gpus, "error": done.stderr[-2000:]}
    return {**summarize(run_dir, n_gpus), "wall_s": wall}


def summarize(run_dir: Path, n_gpus: int) -> dict:
    """A finished run's throughput, stages and reward curve, from its ``metrics.jsonl`` and ``config.json``."""
    cfg = json.loads((run_dir / "config.json").read_text())
    prompts, group_size = cfg["rollout"]["prompts_per_batch"], cfg["rollout"]["group_size"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    ends = {}
    for r in rows:  # the last line of each rollout batch
        ends[r["rollout_batch"]] = r
    batches = sorted(ends)
    span = ends[batches[-1]]["time/elapsed"] - ends[batches[0]]["time/elapsed"]
    # each timed batch's wall-clock time: the median leaves out the few batches that capture a CUDA graph for a new
    # packed size (0.3-0.6 s each, in any run; a 12-batch run has one or two, a long run amortises them)
    batch_s = [ends[b]["time/elapsed"] - ends[a]["time/elapsed"] for a, b in zip(batches, batches[1:])]
    completions = (len(batches) - 1) * prompts * group_size
    first = [r for r in rows if r["minibatch"] == 0]
    timed = [r for r in rows if r["rollout_batch"] > 0]

    def per_batch(key: str, rows_: list) -> float:
        return sum(r.get(key, 0.0) for r in rows_) / max(1, len(batches) - 1)

    # Where a batch's wall-clock time goes, per timed rollout batch (the stages are rank 0's; the rest is logging,
    # the sentinel and the waits between stages)
    stages = {"sync_weights": per_batch("time/sync_weights", first[1:]), "collect": per_batch("time/collect", first[1:]),
              "gather": per_batch("time/gather", first[1:]), "logprobs": per_batch("time/logprobs", first[1:]),
              "updates": per_batch("time/update", timed)}
    stages["batch"] = span / max(1, len(batches) - 1)
    stages["other"] = stages["batch"] - sum(stages[k] for k in ("sync_weights", "collect", "logprobs", "updates"))
    longest = [ends[b]["completion/len_max"] for b in batches[1:]]  # the longest response of each timed batch
    return {"gpus": n_gpus, "prompts_per_batch": prompts, "group_size": group_size, "run": run_dir.name,
            "len_max_mean": statistics.fmean(longest), "len_max_spread": statistics.pstdev(longest),
            "batch_s_fit": fit_line(longest, batch_s),
            "completions_per_s": completions / span,
            "completions_per_s_median_batch": prompts * group_size / statistics.median(batch_s),
            "batch_s": batch_s,
            "reward_first": first[0]["reward/mean"], "reward_last": first[-1]["reward/mean"],
            "reward_curve": [r["reward/mean"] for r in first],
            "stages_s": stages,
            "rollout_s_mean": sum(r["time/rollout"] for r in first[1:]) / max(1, len(first) - 1),
            "update_s_mean": sum(r["time/update"] for r in rows if r["rollout_batch"] > 0) / max(
                1, sum(1 for r in rows if r["rollout_batch"] > 0))}


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line y = a + b x (b = 0 where every x is the same)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((v - mx) ** 2 for v in x)
    b = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx if sxx else 0.0
    return my - b * mx, b


def speedups(results: list[dict]) -> None:
    """Each run's speed-up over the fastest one-GPU run at the per-GPU batch, by both rates, and by the runs' fits at
    that one-GPU run's mean longest response (in place)."""
    done = [r for r in results if "error" not in r]
    ones = [r for r in done if r.get("gpus") == 1 and not r.get("equal_batch_reference")]
    for key, name in (("completions_per_s", "speedup"), ("completions_per_s_median_batch", "speedup_median_batch")):
        best = max((r[key] for r in ones), default=None)
        for r in done:
            r[name] = r[key] / best if best else None
    if not ones:
        return
    base = max(ones, key=lambda r: r["completions_per_s"])
    length = base["len_max_mean"]

    def rate(r: dict) -> float | None:  # completions per second of a batch whose longest response is `length`
        a, b = r["batch_s_fit"]
        seconds = a + b * length
        return r["prompts_per_batch"] * r["group_size"] / seconds if seconds > 0 else None

    theirs = rate(base) if base["len_max_spread"] > 0 else None
    for r in done:
        # a run whose batches all had one longest response (every one cut at max_new_tokens, as in short runs)
        # has no line to read another length off
        known = r["len_max_spread"] > 0 or r["len_max_mean"] == length
        mine = rate(r)
        r["speedup_equal_longest"] = mine / theirs if known and mine and theirs else None


def gpus_of(run_dir: Path) -> int:
    """The GPU count in a run directory's name (``gpus4-prompts128``, ``gpus4-prompts128-1``)."""
    return int(run_dir.name.split("-")[0].removeprefix("gpus"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts")
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--prompts-per-gpu", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--batches", type=int, default=6, help="rollout batches per run (the first is not timed)")
    p.add_argument("--equal-batch", action="store_true",
                   help="also run 1 GPU with the largest run's total batch, to compare reward curves at equal batch")
    p.add_argument("--summarize", nargs="+", metavar="RUN_DIR",
                   help="train nothing: the table and JSON of these finished runs (named gpusN-promptsP[-k])")
    p.add_argument("--device", help="with --summarize: the card the runs ran on, for the JSON")
    p.add_argument("--out", default="scaling.json")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        dirs = [Path(d) for d in args.summarize]
        results = [summarize(d, gpus_of(d)) for d in dirs]
        counts = [r["gpus"] for r in results]
        # a one-GPU run with a larger batch than another one-GPU run is the --equal-batch reference
        per_gpu = min((r["prompts_per_batch"] for r in results if r["gpus"] == 1), default=0)
        for r in results:
            if r["gpus"] == 1 and r["prompts_per_batch"] > per_gpu:
                r["equal_batch_reference"] = True
    else:
        counts = [int(n) for n in args.gpus.split(",")]
        results = [run(n, args, out.parent / "scaling-runs") for n in counts]
        if args.equal_batch and max(counts) > 1:
            same = run(1, args, out.parent / "scaling-runs", prompts=args.prompts_per_gpu * max(counts))
            same["equal_batch_reference"] = True
            results.append(same)
    # The baseline: the fastest one-GPU run at the per-GPU batch (list --gpus 1 twice, e.g. 1,2,4,1, to see how much
    # one GPU varies within the lease)
    speedups(results)
    print(f"{'GPUs':>4} {'prompts':>7} {'compl/s':>9} {'speed-up':>8} {'median-batch compl/s':>21} {'speed-up':>8} "
          f"{'rollout s':>9} {'update s':>8} {'reward':>13} {'longest':>7} {'s/batch = a + b x longest':>25} "
          f"{'speed-up at equal longest':>25}")
    for r in results:
        if "error" in r:
            print(f"{r['gpus']:>4} failed: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        sp, spm, spl = (f"{r[k]:.2f}x" if r.get(k) is not None else "-"
                        for k in ("speedup", "speedup_median_batch", "speedup_equal_longest"))
        print(f"{r['gpus']:>4} {r['prompts_per_batch']:>7} {r['completions_per_s']:>9.1f} {sp:>8} "
              f"{r['completions_per_s_median_batch']:>21.1f} {spm:>8} {r['rollout_s_mean']:>9.2f} "
              f"{r['update_s_mean']:>8.3f} {r['reward_first']:.3f}->{r['reward_last']:.3f} {r['len_max_mean']:>7.1f} "
              f"{r['batch_s_fit'][0]:>14.3f} + {r['batch_s_fit'][1] * 1e3:.2f}e-3 x "
              f"{spl:>25}")
    print("seconds per rollout batch: " + " ".join(f"{k:>12}" for k in next(
        (r["stages_s"] for r in results if "error" not in r), {})))
    for r in results:
        if "error" not in r:
            print(f"{r['gpus']} GPU(s), {r['prompts_per_batch']:>3} prompts: "
                  + " ".join(f"{v:>12.3f}" for v in r["stages_s"].values()))
    for r in results:  # the reward curves at equal total batch: the largest run next to one GPU with its batch
        if r.get("equal_batch_reference") and "error" not in r:
            peer = next(x for x in results if x["gpus"] == max(counts) and "error" not in x)
            print(f"reward per rollout batch at {r['prompts_per_batch']} prompts: {max(counts)} GPUs "
                  f"{[round(v, 3) for v in peer['reward_curve']]}; 1 GPU {[round(v, 3) for v in r['reward_curve']]}")
    device = args.device
    if device is None:
        try:
            import torch

            device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 -- the name is a label
            device = "unknown"
    out.write_text(json.dumps({"device": device, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
