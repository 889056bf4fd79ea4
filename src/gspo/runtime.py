"""Where a run executes: the device, the precision rule, this process's rank in the job, the one reduce of metrics
per optimizer step, and the process's global random streams. Training, evaluation and the probe all ask this module;
nothing else decides these.

Precision (``model.precision``):
    auto            fp32 master weights with bf16 autocast on CUDA and on a CPU with native bf16 matmuls
                    (AVX512-BF16 or AMX on x86, the BF16 extension on Arm); plain fp32 on any other CPU
    bf16-autocast   fp32 master weights with bf16 autocast on any device (without native bf16 a CPU emulates it,
                    which is many times slower than fp32: a warning says so)
    fp32            no autocast

Why ``auto`` asks the CPU: on a 2-core Xeon with AMX a bf16 matmul of the 135M model's update shapes ran at 922
GFLOP/s against 257 in fp32, while with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, how an AVX2-only CPU such as
a Zen 3 EPYC runs it) bf16 fell to 1.5 GFLOP/s and fp32 stayed at 263 (``benchmarks/cpu_precision.py``;
benchmarks/README.md#quickstart-on-a-cpu); a quickstart forced to bf16 on such a CPU was at step 2 of 48 after 46
minutes (issue 33).
``GSPO_CPU_BF16=0`` (or ``1``) overrides what is read off the CPU; the test suite sets 0, so its CPU runs compute the
same numbers on every CPU.

Rank and world size come from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) when present.

CPU threads: on a GPU, torch's own CPU work is one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise (what
``torchrun`` does for several processes, here for one too).

Random streams: Python's, NumPy's, torch's and every CUDA device's global generators are seeded together
(:func:`seed_everything`), and captured and put back together (:func:`rng_state`, :func:`set_rng_state`): a checkpoint
stores them, and the vLLM engine restores them after vLLM reseeds them as it starts.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gspo.errors import UserError

log = logging.getLogger("gspo")

PRECISIONS = ("auto", "fp32", "bf16-autocast")

# Held by a thread while it captures a CUDA graph in torch's default global mode (the update's graphs), and by the
# asynchronous rollout thread while it collects (gspo.feed.ahead): a global-mode capture forbids other threads the
# calls (allocations, synchronisations) that the engine makes, so the two never overlap.
CAPTURE_LOCK = threading.RLock()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` (CUDA when visible, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; under torchrun plain ``cuda`` and
    ``auto`` mean this process's own GPU (``cuda:LOCAL_RANK``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device = {name!r} but no CUDA device is visible; use model.device = 'cpu' or 'auto'.")
    if name == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"Process {local_rank} of this machine would take GPU {local_rank}, and "
                            f"{torch.cuda.device_count()} are visible: launch as many processes as GPUs (gspo train "
                            f"--nproc {torch.cuda.device_count()}), or, for one trainer and its decode processes "
                            "(rollout.decode_processes), put them on its GPU with rollout.decode_gpu = 'shared'.")
        return torch.device("cuda", local_rank)
    return torch.device(name)


_GPU_SHARE: dict[int, float] = {}  # device index -> the share of its memory this process was capped at


def limit_gpu_memory(device: torch.device, share: float | None) -> None:
    """Cap PyTorch's allocator at ``share`` of ``device``'s memory (``model.gpu_memory``; None: no cap). Several runs
    on one GPU otherwise race for it, and which one runs out is luck: 5 of 9 multi-turn runs of the embedded model,
    5-6 on one H200 with allocation peaks of 24-34 GB each. Capped, each run's engine batch and update graphs size
    themselves within its share, cached blocks are given back before the cap is hit, and a run that needs more fails
    in one line naming the share."""
    if device.type != "cuda" or share is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(share, index)
    _GPU_SHARE[index] = share


def gpu_memory_cap() -> float | None:
    """The share of its GPU this process capped itself at (:func:`limit_gpu_memory`), None when it did not."""
    return next(iter(_GPU_SHARE.values()), None)


def free_gpu_bytes(device: torch.device) -> int:
    """GPU memory this process can still allocate on ``device``: what the GPU has free plus what PyTorch's allocator
    holds unused, within the share :func:`limit_gpu_memory` capped it at."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    within_gpu = free + torch.cuda.memory_reserved(index) - allocated
    return max(0, min(within_gpu, int(_GPU_SHARE.get(index, 1.0) * total) - allocated))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (x86: ``avx512_bf16`` or ``amx_bf16``; Arm: ``bf16``),
    as Linux's /proc/cpuinfo or macOS's sysctl report it, and oneDNN is not held below those instructions by
    ``ONEDNN_MAX_CPU_ISA``. ``GSPO_CPU_BF16=0`` / ``1`` overrides both."""
    forced = os.environ.get("GSPO_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa not in ("ALL", "DEFAULT") and not any(k in isa for k in ("BF16", "AMX", "AVX10")):
        return False
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (lower case): /proc/cpuinfo's ``flags`` / ``Features`` lines on Linux, the
    ``hw.optional.arm.FEAT_BF16`` sysctl on macOS; empty where neither answers."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(word for line in f if line.lower().startswith(("flags", "features"))
                             for word in line.split(":", 1)[1].lower().split())
    except OSError:
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=5)
        return frozenset({"bf16"}) if out.stdout.strip() == "1" else frozenset()
    except (OSError, subprocess.SubprocessError):
        return frozenset()


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``model.precision`` asks for on ``device`` (None: no autocast)."""
    if precision not in PRECISIONS:
        raise UserError(f"model.precision = {precision!r} is not one of {', '.join(PRECISIONS)}; pick one of those.")
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()) else None
    if precision == "bf16-autocast" and device.type == "cpu" and not cpu_has_native_bf16():
        log.warning("model.precision = 'bf16-autocast' on a CPU without native bf16 (AVX512-BF16, AMX or Arm BF16): "
                    "it is emulated, many times slower than fp32; set model.precision = 'auto' or 'fp32' for speed.")
    return torch.bfloat16 if precision == "bf16-autocast" else None


def precision_name(autocast: torch.dtype | None) -> str:
    """How a run's precision reads in its start-up line."""
    return "bf16 autocast, fp32 master weights" if autocast == torch.bfloat16 else "fp32"


def limit_cpu_threads(device: torch.device) -> None:
    """One intra-op CPU thread for a run on a GPU, unless ``OMP_NUM_THREADS`` is set. Its CPU work is small tensor ops
    (rollout bookkeeping, metrics, batch assembly), which torch's default of one OpenMP thread per core slows down: on
    a 64-core host with 4 H100s, a one-GPU reference run did 203-285 completions/s while another process used the host
    and 428.5 with one thread (``benchmarks/README.md#scale-out``); on a 16-core H100 machine one thread was 4% faster."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every CUDA device too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global generator's state, for :func:`set_rng_state`."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the generators :func:`rng_state` captured (the CUDA ones only where both sides have CUDA)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Runtime:
    """The device, precision and process layout of one run."""

    device: torch.device
    autocast: torch.dtype | None = None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files and talks to the user."""
        return self.rank == 0

    @classmethod
    def from_config(cls, model_cfg, placement: tuple[int, float] | None = None) -> "Runtime":
        """The runtime a ``[model]`` section asks for, in this process of the job. ``placement``: ``(GPU, share)`` when
        the job puts several processes on a GPU (:func:`gspo.parallel.roles.placement`): this process's GPU instead of
        ``LOCAL_RANK``'s, and its memory share unless ``model.gpu_memory`` sets one."""
        rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
        gpu, share = placement if placement is not None else (local, None)
        device = resolve_device(model_cfg.device, gpu)
        limit_cpu_threads(device)
        limit_gpu_memory(device, model_cfg.gpu_memory if model_cfg.gpu_memory is not None else share)
        return cls(device=device, autocast=autocast_dtype(model_cfg.precision, device), rank=rank, world_size=world,
                   local_rank=local)

    def reduce(self, metrics: dict[str, float | torch.Tensor], ops: dict[str, str] | None = None) -> dict[str, float]:
        """Metrics as Python floats, with one host synchronisation for all of them (per device they live on); across
        the processes of a job each is combined by its op in ``ops`` (default ``mean``; ``sum``, ``max``, ``min``).

        Values may be floats, ints or 0-dim tensors; the keys must be the same on every rank."""
        ops = ops or {}
        names = list(metrics)
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return self._all_reduce(metrics, names, ops)
        out: dict[str, float] = {}
        by_device: dict[torch.device, list[str]] = {}
        for name in names:
            value = metrics[name]
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(name)
            else:
                out[name] = float(value)
        for group in by_device.values():
            # float64 holds every float32 value exactly: the same numbers as one .item() each, in one transfer.
            values = torch.stack([metrics[n].detach().reshape(()).double() for n in group]).tolist()
            out.update(zip(group, values))
        return {name: out[name] for name in names}

    def _all_reduce(self, metrics, names: list[str], ops: dict[str, str]) -> dict[str, float]:
        """Every process's values in one all-gather and one host synchronisation, combined on the host (a column per
        metric: its mean, sum, max or min over the processes; NaN stays NaN)."""
        import torch.distributed as dist

        from gspo.parallel import comm

        group = comm.group()
        device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        numbers = [n for n in names if not isinstance(metrics[n], torch.Tensor)]
        tensors = [n for n in names if isinstance(metrics[n], torch.Tensor)]
        parts = []
        if numbers:  # host values: one pinned copy that does not wait for the device's queue
            host = torch.tensor([float(metrics[n]) for n in numbers], dtype=torch.float64)
            parts.append(host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host)
        if tensors:
            parts.append(torch.stack([metrics[n].detach().reshape(()).to(device, torch.float64) for n in tensors]))
        local = torch.cat(parts)  # (n,)
        table = torch.empty(self.world_size * local.numel(), dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(table, local, group=group)
        table = table.view(self.world_size, -1).cpu()  # (W, n): the one host sync
        combined = {"sum": table.sum(0), "max": table.amax(0), "min": table.amin(0)}
        combined["mean"] = combined["sum"] / self.world_size
        columns = {op: col.tolist() for op, col in combined.items()}
        out = {name: columns[ops.get(name, "mean")][j] for j, name in enumerate(numbers + tensors)}
        return {name: out[name] for name in names}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to a GPU through pinned memory without blocking, so the host does not wait
    for the kernels queued before the copy (a plain ``.to()`` from pageable memory synchronises the stream). The
    caching host allocator keeps the pinned block until the copy has run."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def process_seconds() -> float:
    """Seconds since this process started (interpreter start-up and imports included), from /proc on Linux; elsewhere
    since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def bytecode_warning() -> str | None:
    """One line when this process imported torch from source because no byte-code cache exists and writing one is off
    (``PYTHONDONTWRITEBYTECODE`` / ``-B``), as in images that ship packages without ``.pyc`` files: every process then
    compiles some 2,000 modules again (10 s of a 35 s run on an H200 host, benchmarks/README.md). None otherwise."""
    import importlib.util
    import sys

    if not sys.dont_write_bytecode or not torch.__file__:
        return None
    try:
        cached = importlib.util.cache_from_source(torch.__file__)
    except (NotImplementedError, ValueError):  # no cache tag, or an optimisation level it cannot name
        return None
    if os.path.exists(cached):
        return None
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return (f"torch was imported without byte-code ({cached} is absent and PYTHONDONTWRITEBYTECODE or -B keeps Python "
            f"from writing it), so each process compiles its packages again, seconds of start-up: run "
            f"`python -m compileall -q {site}` once, or unset PYTHONDONTWRITEBYTECODE.")


def seconds_since(started: float | None) -> float:
    """Seconds since ``started`` (a ``time.perf_counter()`` reading), or since this process started when it is None."""
    return process_seconds() if started is None else time.perf_counter() - started


_IMPORTED = time.perf_counter()
