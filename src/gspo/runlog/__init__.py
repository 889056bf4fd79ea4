"""The run log: everything a run writes about itself beside its checkpoints, and the console it talks to.

- ``log.py``: :class:`RunLog`, the files and sinks of one ``train()`` call, rewound on resume and rollback;
- ``metrics.py``: the JSONL writer and reader, the console's progress line, a run's summary (torch-free: ``gspo
  report`` and ``gspo summary`` read runs with it);
- ``sinks.py``: the optional TensorBoard and W&B sinks;
- ``diagnostics.py``: ratio histograms and per-token traces (``histograms.jsonl``, ``traces.jsonl``);
- ``profiler.py``: ``log.profile_batch`` and the named stages the progress line follows.

The run log records what the trainer hands it and never imports :mod:`gspo.train` (``tests/test_layout.py``).
"""
from __future__ import annotations

__all__ = ["RunLog"]


def __getattr__(name: str):
    # Lazy: readers of finished runs import gspo.runlog.metrics, which must not import torch on the way.
    if name == "RunLog":
        from gspo.runlog.log import RunLog

        return RunLog
    raise AttributeError(f"module 'gspo.runlog' has no attribute {name!r}")
