"""bf16 against fp32 matmuls on this CPU, at a shape of SmolLM2-135M's update (1,024 tokens x 576 -> 1,536): what
``model.precision = "auto"`` decides from the CPU's flags (native bf16 or not), measured. Prints a table, writes JSON.

    python benchmarks/cpu_precision.py --out cpu_precision.json
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_precision.py   # as an AVX2-only CPU runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.runtime import autocast_dtype, cpu_has_native_bf16  # noqa: E402


def gflops(dtype: torch.dtype, m: int = 1024, k: int = 576, n: int = 1536, reps: int = 20) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args()
    result = {"threads": torch.get_num_threads(), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
              "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "native_bf16": cpu_has_native_bf16(),
              "auto_precision": "bf16 autocast" if autocast_dtype("auto", torch.device("cpu")) else "fp32",
              "fp32_gflops": round(gflops(torch.float32), 1), "bf16_gflops": round(gflops(torch.bfloat16), 1)}
    print("| threads | ONEDNN_MAX_CPU_ISA | ATen capability | native bf16 | auto picks | fp32 GFLOP/s | bf16 GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['threads']} | {result['onednn_max_cpu_isa'] or '(unset)'} | {result['aten_cpu_capability']} | "
          f"{result['native_bf16']} | {result['auto_precision']} | {result['fp32_gflops']} | {result['bf16_gflops']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
