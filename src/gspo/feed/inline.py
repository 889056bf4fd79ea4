"""The synchronous feed (``rollout.max_staleness = 0``): rollout batch ``j`` is collected when the update asks for it,
by the policy that trains it (version ``j``), so nothing is held between batches and a checkpoint keeps nothing of it.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from gspo.feed.base import Feed, Weights
from gspo.runlog.profiler import stage
from gspo.types import Batch



class Inline(Feed):
    """At :meth:`take` the engine gets the weights the update starts from, then the collect stage samples the batch;
    ``time/sync_weights`` is the copy's seconds."""

    def __init__(self, collect: Callable[[], Batch], engine, weights: Weights):
        self.collect, self.engine, self.weights = collect, engine, weights

    def take(self, j: int) -> Batch:
        t0 = time.perf_counter()
        with stage("sync_weights"):
            self.engine.sync_weights(self.weights())
        t_sync = time.perf_counter() - t0
        batch = self.collect()
        batch.metrics["time/sync_weights"] = t_sync
        return batch
