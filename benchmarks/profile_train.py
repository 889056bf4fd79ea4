"""Where a short training run spends its time: start-up phases, the Python functions (cProfile) and the GPU kernels
(torch.profiler) of a few rollout batches with the reference settings (configs/quickstart.toml).

  python benchmarks/profile_train.py --model /root/smollm2/model.gguf --out $OUT/profile_train.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from gspo.config import build_config, load_toml  # noqa: E402
from gspo.runlog import RunLog  # noqa: E402
from gspo.train import Trainer  # noqa: E402

T_IMPORT = time.perf_counter() - T0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", type=int, default=3, help="rollout batches under each profiler")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    lines = [f"import torch + gspo: {T_IMPORT:.2f} s"]
    cfg = build_config(load_toml(ROOT / "configs/quickstart.toml"), [f"model.name={a.model!r}", "log.checkpoint_every=0",
                                                                     "log.progress=false"],
                       device="cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, Path(tmp) / "run")
        device = trainer.runtime.device
        lines.append(f"Trainer(): {time.perf_counter() - t0:.2f} s on {device}")
        trainer.t_start = time.time()
        runlog = RunLog(Path(tmp) / "run", cfg, step=0, rollout_batch=0)

        def batches(n: int) -> None:
            for _ in range(n):
                trainer.engine.sync_weights(trainer.actor.weights())
                trainer.update(trainer.collector.collect(), runlog)
            if device.type == "cuda":
                torch.cuda.synchronize()

        t0 = time.perf_counter()
        batches(1)
        lines.append(f"first rollout batch + update (warm-up included): {time.perf_counter() - t0:.2f} s")
        t0 = time.perf_counter()
        batches(a.batches)
        lines.append(f"{a.batches} rollout batches + updates: {time.perf_counter() - t0:.2f} s")
        prof = cProfile.Profile()
        prof.enable()
        batches(a.batches)
        prof.disable()
        for key, n in (("tottime", 45), ("cumtime", 70)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
            lines.append(s.getvalue())
        if device.type == "cuda":
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as tp:
                batches(a.batches)
            ka = tp.key_averages()
            lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=35, max_name_column_width=70))
            lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70))
        runlog.close()
        trainer.rewards.close()
    text = "\n".join(lines)
    Path(a.out).write_text(text)
    print(text[:3000])


if __name__ == "__main__":
    main()
