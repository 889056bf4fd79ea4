"""What every feed is: the interface the trainer calls (:class:`Feed`) and a collected batch waiting for the update
(:class:`Queued`), which is also what a checkpoint of an asynchronous run saves of it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from gspo.types import Batch

# The policy's ``(name, tensor)`` pairs as the engine takes them, on demand: what every feed loads or sends
Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass
class Queued:
    """A collected rollout batch waiting for the actor, with the version that sampled it."""

    batch: Batch
    version: int  # the version that sampled it (in-flight updates: its first tokens; later ones are newer)
    engine_wait_s: float = 0.0  # the engine's wait for that version before collecting it
    sync_s: float = 0.0  # loading that version into the engine (0 when it had it), and in-flight updates
    swaps: int = 0  # in-flight updates while it was sampled

    def taken(self, j: int, waited: float, ahead: int) -> Batch:
        """The batch, trained as rollout batch ``j``, with its ``async/*`` metrics: ``waited``, the actor's wait for
        it; ``ahead``, the batches collected after it. The staleness is per sampled token: one value for a batch one
        version sampled, the mean and the largest over its tokens under in-flight updates."""
        mean = top = float(j - self.version)
        versions = self.batch.rollout.versions
        if versions is not None:
            staleness = (j - versions[self.batch.rollout.sampled]).double()
            if staleness.numel():
                mean, top = float(staleness.mean()), float(staleness.max())
        self.batch.metrics.update({"async/staleness_mean": mean, "async/staleness_max": top,
                                   "async/actor_wait_s": waited, "async/engine_wait_s": self.engine_wait_s,
                                   "async/ahead": float(ahead), "time/sync_weights": self.sync_s})
        if versions is not None:
            self.batch.metrics["async/swaps"] = float(self.swaps)
        return self.batch


class Feed:
    """How rollout batches reach the update. The trainer calls :meth:`reset` with where the run is (a new run, a
    resume, a rollback), then per rollout batch :meth:`take` and, after the update, :meth:`publish`; :meth:`pause` and
    :meth:`resume` around a checkpoint, whose payload gets :meth:`state_dict`; :meth:`drop` before a rollback;
    :meth:`close` at the end. The defaults are the synchronous loop's: nothing is held between batches."""

    def reset(self, version: int, total: int) -> None:
        """Start a timeline at policy ``version`` (the rollout batches trained so far) that ends before rollout batch
        ``total``, with the batches the checkpoint restored last had waiting (:meth:`load_state_dict`)."""

    def take(self, j: int) -> Batch:
        """Rollout batch ``j``, to be trained by policy version ``j``."""
        raise NotImplementedError

    def publish(self, version: int) -> None:
        """The actor's weights are ``version`` now (after training rollout batch ``version - 1``)."""

    def pause(self) -> None:
        """Before a checkpoint: what :meth:`state_dict` returns stays as it is until :meth:`resume`."""

    def resume(self) -> None:
        """After a checkpoint: collecting goes on."""

    def drop(self) -> None:
        """A rollback: what was collected for the abandoned timeline is dropped (:meth:`reset` starts the next)."""

    def close(self, timeout: float | None = None) -> None:
        """Stop collecting; ``timeout``: the run is failing, wait at most that long."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the feed (merged into its payload)."""
        return {}

    def load_state_dict(self, payload: dict) -> None:
        """From a checkpoint's payload, for the next :meth:`reset`."""


class Queue(Feed):
    """A feed that collects ahead of the update: its batches wait in ``queue`` (rollout batch -> :class:`Queued`,
    guarded by ``cond``), and a checkpoint saves those waiting (``async_queue``), which the resumed run trains first."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: dict[int, Queued] = {}
        self.saved: list[Queued] = []  # from the checkpoint restored last: batches version, version + 1, ...

    def state_dict(self) -> dict:
        with self.cond:
            return {"async_queue": [self.queue[j] for j in sorted(self.queue)]}

    def load_state_dict(self, payload: dict) -> None:
        self.saved = list(payload.get("async_queue", []))

    def restored(self, version: int) -> dict[int, Queued]:
        """The saved batches as the queue of a timeline starting at ``version`` (used once: a later reset without a
        restore starts empty)."""
        queue, self.saved = {version + i: q for i, q in enumerate(self.saved)}, []
        return queue
