"""The runtime: the one precision rule, the device rule, the one reduce of metrics (in one process and across
real torchrun processes on gloo), and the global random streams."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo.config import ModelConfig
from gspo.errors import UserError
from gspo.runtime import Runtime, autocast_dtype


def test_precision_rule_is_one_for_every_device(monkeypatch):
    """auto: bf16 autocast on CUDA and on a CPU with native bf16 only; bf16-autocast: on any device; fp32: never."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("GSPO_CPU_BF16", "0")
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setenv("GSPO_CPU_BF16", "1")
    assert autocast_dtype("auto", cpu) == torch.bfloat16
    assert autocast_dtype("bf16-autocast", cpu) == torch.bfloat16 and autocast_dtype("fp32", cuda) is None
    with pytest.raises(UserError, match="model.precision = 'bf16'"):
        autocast_dtype("bf16", cpu)


def test_a_process_past_the_last_gpu_is_refused_in_one_line(monkeypatch):
    """Under torchrun with more processes than GPUs (cuda:LOCAL_RANK would not exist), and a decode process placed
    on a trainer's GPU by rollout.decode_gpu = 'shared' instead, with its share of the memory."""
    from gspo.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="Process 1 of this machine would take GPU 1, and 1 are visible: .*--nproc 1.*"
                                        "put them on its GPU with rollout.decode_gpu = 'shared'"):
        resolve_device("cuda", 1)
    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    shares = []
    monkeypatch.setattr("gspo.runtime.limit_gpu_memory", lambda device, share: shares.append((device, share)))
    monkeypatch.setattr("gspo.runtime.limit_cpu_threads", lambda device: None)  # (it would hold this process to 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    runtime = Runtime.from_config(ModelConfig(device="cuda"), (0, 0.5))
    assert runtime.device == torch.device("cuda", 0) and shares == [(torch.device("cuda", 0), 0.5)]
    Runtime.from_config(ModelConfig(device="cuda", gpu_memory=0.3), (0, 0.5))  # the config's share wins
    assert shares[-1] == (torch.device("cuda", 0), 0.3)


@pytest.mark.parametrize("flags, isa, native", [
    ({"avx2", "fma"}, "", False),  # an AVX2-only CPU (e.g. AMD Zen 3): bf16 would be emulated
    ({"avx512f", "avx512_bf16"}, "", True),
    ({"avx512f", "amx_bf16", "amx_tile"}, "", True),
    ({"fp", "asimd", "bf16"}, "", True),  # Arm with the BF16 extension (Graviton 3, Apple M2)
    ({"avx512f", "amx_bf16"}, "AVX2", False),  # oneDNN held to AVX2 runs bf16 emulated
    ({"avx512f", "amx_bf16"}, "avx512_core_amx", True),
    (set(), "", False),  # nothing reported (no /proc/cpuinfo, no sysctl)
])
def test_native_bf16_is_read_off_the_cpu(monkeypatch, flags, isa, native):
    """`auto` on a CPU autocasts to bf16 only where the CPU's flags show bf16 matmul instructions oneDNN may use."""
    import gspo.runtime as runtime

    monkeypatch.delenv("GSPO_CPU_BF16", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: frozenset(flags))
    assert runtime.cpu_has_native_bf16() is native
    assert autocast_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else None)


def test_emulated_bf16_is_named(monkeypatch, caplog):
    """Asking for bf16 autocast on a CPU that would emulate it still gives bf16, with a warning that names the fix."""
    monkeypatch.setenv("GSPO_CPU_BF16", "0")
    with caplog.at_level("WARNING", logger="gspo"):
        assert autocast_dtype("bf16-autocast", torch.device("cpu")) == torch.bfloat16
    assert "emulated" in caplog.text and "model.precision = 'auto'" in caplog.text


def test_cpu_flags_read_here_are_a_set():
    """This machine's flags parse (Linux: /proc/cpuinfo), so the rule above is fed real input in CI."""
    from gspo.runtime import _cpu_flags

    flags = _cpu_flags()
    assert isinstance(flags, frozenset)
    if Path("/proc/cpuinfo").is_file():
        assert flags and all(f == f.lower() for f in flags)


def test_evaluation_and_training_share_the_rule(monkeypatch):
    """`gspo eval` asks the same runtime as training: bf16-autocast on a CPU is bf16 for both (it used to be fp32 in
    evaluation)."""
    rt = Runtime.from_config(ModelConfig(device="cpu", precision="bf16-autocast"))
    assert rt.autocast == torch.bfloat16 and rt.world_size == 1 and rt.is_main


def test_reduce_is_one_transfer_of_floats():
    """Tensors and numbers come back as floats, float32 values exactly as .item() gives them, keys in order."""
    x = torch.tensor(0.1, dtype=torch.float32)
    out = Runtime(torch.device("cpu")).reduce({"b": x, "a": 3, "c": torch.tensor(2.5, dtype=torch.float64)})
    assert list(out) == ["b", "a", "c"] and out == {"b": x.item(), "a": 3.0, "c": 2.5}


def test_reduce_across_torchrun_processes(tmp_path):
    """Two torchrun ranks on gloo: means average, sums add, max and min combine (a float32 value exactly as .item()
    gives it); rank and world come from torchrun. Objects of different sizes gather in rank order, and a list's work
    split over the ranks comes back whole and in order, every other item computed by each."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).parent / "dist" / "reduce_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["is_main"] for g in got] == [True, False] and {g["world"] for g in got} == {2}
    for g in got:  # in the order given, whether numbers or tensors; a NaN on one process stays NaN
        assert list(g["values"]) == ["mean", "count", "max", "min", "nan_max", "half"]
        assert math.isnan(g["values"].pop("nan_max"))
        assert g["values"] == {"mean": 0.5, "count": 3.0, "max": 2.0, "min": -5.0, "half": torch.tensor(0.1).item()}
        assert g["gathered"] == [[r, 1000 * (r + 1), list(range(3 + r)), [r + 0.5] * 2, [0.0, 3.0, 6.0, 9.0]]
                                 for r in (0, 1)]
        assert g["split"] == [[x, x % 2] for x in range(7)]


def test_gpu_runs_use_one_cpu_thread_unless_omp_num_threads_says_otherwise(tmp_path):
    """On a GPU torch's CPU work gets one thread (as torchrun sets for its processes); OMP_NUM_THREADS wins; a CPU run
    keeps torch's default. In subprocesses: the thread count is process-wide."""
    import os
    import subprocess
    import sys

    code = ("import torch; from gspo.runtime import limit_cpu_threads as f; n = torch.get_num_threads(); "
            "f(torch.device('cpu')); a = torch.get_num_threads(); f(torch.device('cuda')); print(n, a, torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    n, on_cpu, on_gpu = map(int, subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                                check=True).stdout.split())
    assert (on_cpu, on_gpu) == (n, 1)
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["2", "2", "2"]


def test_every_global_stream_is_seeded_captured_and_put_back_together():
    """seed_everything seeds Python's, NumPy's and torch's generators alike each time; set_rng_state(rng_state())
    rewinds all three to the capture (what a checkpoint and the vLLM engine's start-up rely on)."""
    import random

    import numpy as np

    from gspo.runtime import rng_state, seed_everything, set_rng_state

    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    outer = rng_state()  # the tests after this one keep their streams
    try:
        seed_everything(7)
        first = draw()
        seed_everything(7)
        assert draw() == first
        saved = rng_state()
        after = draw()
        seed_everything(8)
        set_rng_state(saved)
        assert draw() == after
    finally:
        set_rng_state(outer)



def test_bytecode_warning_names_the_fix_only_when_torch_has_no_cache(monkeypatch, tmp_path):
    """The start-up warning fires where torch was imported from source (no .pyc where Python looks, writing off), and
    goes away once the cache exists: Python's own lookup, pointed at an empty cache tree with sys.pycache_prefix (what
    PYTHONPYCACHEPREFIX sets), then at one holding torch's compiled __init__."""
    import importlib.util
    import py_compile

    from gspo.runtime import bytecode_warning

    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode_warning() is None  # writing is on: the next process will have the cache
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    msg = bytecode_warning()
    assert msg is not None and "compileall" in msg and "PYTHONDONTWRITEBYTECODE" in msg and "\n" not in msg
    py_compile.compile(torch.__file__, cfile=importlib.util.cache_from_source(torch.__file__), doraise=True)
    assert bytecode_warning() is None
