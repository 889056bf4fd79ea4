"""``log.profile_batch``: one rollout batch under ``torch.profiler`` on every process, to see where a batch's time
goes below the ``time/*`` metrics (host syncs, collectives, pickling, kernel launches).

Each process writes ``<run_dir>/profile/rank<r>.txt`` -- gspo's stages (the ``gspo/*`` ranges the loop opens with
:func:`stage`), then the operators by self host time and, on a GPU, by self device time -- and
``rank<r>.trace.json.gz``, a Chrome / Perfetto trace (chrome://tracing or ui.perfetto.dev). The profiled batch's own
``time/*`` metrics include the profiler's overhead.

The ranges cost nothing outside the profiled batch: :func:`stage` is a null context then. The same names tell the
console's progress line which phase runs (:func:`watch_stages`).
"""
from __future__ import annotations

import contextlib
import gzip
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger("gspo")

_recording = False  # True only while the profiled batch runs
_watcher: Callable[[str], None] | None = None  # told each stage's name as it starts (the live progress line)


def watch_stages(callback: Callable[[str], None] | None) -> None:
    """Call ``callback(name)`` as each :func:`stage` starts (None: stop)."""
    global _watcher
    _watcher = callback


def stage(name: str):
    """A named range ``gspo/<name>`` in the profile (a null context unless a batch is being profiled)."""
    if _watcher is not None:
        _watcher(name)
    return torch.profiler.record_function(f"gspo/{name}") if _recording else contextlib.nullcontext()


def _stage_table(events) -> str:
    """gspo's ranges: calls and wall-clock time on the host, in the order of their total (the device-side copies of
    the ranges, which a GPU profile also lists, are left out)."""
    from torch.autograd import DeviceType

    rows = sorted((e for e in events if e.key.startswith("gspo/") and e.device_type == DeviceType.CPU),
                  key=lambda e: -e.cpu_time_total)
    lines = [f"{'stage':<28}{'calls':>7}{'total ms':>11}{'mean ms':>10}"]
    lines += [f"{e.key:<28}{e.count:>7}{e.cpu_time_total / 1e3:>11.2f}{e.cpu_time_total / 1e3 / e.count:>10.3f}"
              for e in rows]
    return "\n".join(lines)


class BatchProfiler:
    """Profiles rollout batch ``batch`` (1-based; 0 = none) of a run on this process and writes the files."""

    def __init__(self, batch: int, run_dir: Path, rank: int, device: torch.device):
        self.batch, self.rank, self.device = batch, rank, device
        self.out = Path(run_dir) / "profile"

    @contextlib.contextmanager
    def around(self, rollout_batch: int) -> Iterator[None]:
        """Profile the body when ``rollout_batch`` (0-based, the batch about to run) is the chosen one."""
        global _recording
        if rollout_batch + 1 != self.batch:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            _recording = True
            try:
                yield
            finally:
                _recording = False
                if cuda:
                    torch.cuda.synchronize(self.device)
        self._write(prof, cuda)

    def _write(self, prof, cuda: bool) -> None:
        """The tables and the trace; a failure to write them is a warning (the run goes on)."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            events = prof.key_averages()
            parts = [f"rollout batch {self.batch}, process {self.rank} ({self.device})", "", _stage_table(events), "",
                     "operators by self host time", events.table(sort_by="self_cpu_time_total", row_limit=40)]
            if cuda:
                parts += ["", "operators by self device time",
                          events.table(sort_by="self_device_time_total", row_limit=40)]
            (self.out / f"rank{self.rank}.txt").write_text("\n".join(parts) + "\n")
            raw = self.out / f"rank{self.rank}.trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            if self.rank == 0:
                log.info("profile of rollout batch %d: %s", self.batch, self.out)
        except OSError as e:
            log.warning("the profile of rollout batch %d could not be written to %s (%s)", self.batch, self.out,
                        e.strerror or e)
