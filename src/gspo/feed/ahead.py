"""Asynchronous rollouts (``rollout.max_staleness = η > 0``): the engine collects the next rollout batches while the
actor trains on the current one, each sampled by a policy exactly η versions older than the one that trains it.

Versions. Rollout batch ``j`` is trained by version ``j`` and sampled by version g(j) = max(j - η, v0)
(:mod:`gspo.feed.lag`). η = 0 is the synchronous loop (:mod:`gspo.feed.inline`). The unit is the rollout batch, not the
optimizer step: the engine's weights change once per rollout batch, a whole batch (its DAPO refills too) is sampled by
one version, and a synchronous run's own minibatches are already 0 to M - 1 optimizer steps off-policy, so η rollout
batches are η·M to η·M + M - 1 optimizer steps (M = ``train.minibatches``).

A fixed lag, so a run is deterministic. g(j) depends on j alone, not on whether the engine or the actor got ahead: a
run is the same bit for bit whether it collects in a background thread (``rollout.overlap = "thread"``) or in turn
with the update (``"off"``), at any speed of either, and a checkpoint resumes it exactly. Taking the newest weights when
a batch starts (AReaL's rule) makes the staleness smaller on average but a function of timing, which no test could pin.

In-flight updates (``rollout.in_flight``) give up that determinism for fresher samples: a batch starts with the newest
version there is (at least g(j)), and the engine loads every newer one the actor publishes between two of its decode
steps (:class:`_InFlight`), so each token records its own version, between g(j) and j.

Admission. Batch ``j`` starts only once version g(j) exists, so while the actor trains batch ``v`` at most the η
batches after it are collected or being collected, and no batch is sampled to be thrown away: nothing is dropped for
staleness, by construction (AReaL bounds its rollouts with a capacity rule to the same end).

Weights to the engine. With η = 1 the engine needs version ``j`` for batch ``j + 1`` exactly when it has finished batch
``j`` and the actor, which waits for that batch, has not yet stepped: the actor copies its weights into the engine then,
with no extra memory. With η >= 2 the engine needs versions the actor has already moved past, so each version that a
batch will need is copied when it is published and the copy is freed once the engine has loaded it, on the policy's
device: at most η + 1 copies at once (versions v - η .. v when the actor publishes v), η + 1 only in the moment between
the engine finishing a batch and loading the next one's version.

Checkpoints. A checkpoint at version ``v`` first lets the engine finish every batch sampled by an older version (those
before ``v + η``), then holds it idle while the checkpoint takes its copy: the batches it saves (η of them, or η + 1
when the engine had started the next one already; in turn with the update, η + 1) and the collect stage's state (data
position, sampling stream) agree, and every later batch is sampled by the checkpoint's policy or a newer one. Nothing
is lost or sampled twice, and a resumed run is the uninterrupted one bit for bit. With η = 1 this waits for nothing the
actor would not wait for anyway (the next batch). Under torchrun the choice between η and η + 1 cannot depend on each
process's timing (the engines gather with each other inside a collect: one holding batch ``v + η`` back while another
collects it would hang both), so there a checkpoint always lets batch ``v + η`` be collected too and saves η + 1.

Processes. Under torchrun every process runs its own engine thread, which talks to the others through a gloo group of
its own (the collect's gathers, beside the update's collectives on the default group in the trainer's thread). Each
process samples its share of every batch, as in the synchronous loop, so the fixed lag holds job-wide. Before each
batch the engine threads agree whether any of them is stopping (a stop signal, a rollback), so they start the same
batches and stop at the same one: none waits in a gather for a peer that has already stopped. A process whose run
failed stops its engine alone, without waiting to agree: the others fail on their own once it is gone.

CUDA. The background collect runs on its own stream, and holds :data:`gspo.runtime.CAPTURE_LOCK` while it loads weights,
collects and synchronises its stream: the update's CUDA-graph captures take it too, so no capture overlaps the engine's
work (a capture in torch's default global mode forbids other threads the calls the engine makes). The engine's own
captures are thread-local.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.feed.base import Queue, Queued, Weights
from gspo.feed.lag import Lag
from gspo.parallel import comm
from gspo.runtime import CAPTURE_LOCK
from gspo.types import Batch



@dataclass
class _Copy:
    """A published version's weights, copied for the engine (η >= 2), and the event after the copy on a GPU."""

    weights: list[tuple[str, torch.Tensor]]
    ready: torch.cuda.Event | None


class Ahead(Queue):
    """Collects rollout batches ahead of the update (see the module docstring): :meth:`take` blocks until the batch
    is collected."""

    def __init__(self, eta: int, threaded: bool, collect: Callable[[], Batch], engine, weights: Weights,
                 device: torch.device, group=None, in_flight: str = "off"):
        """``group``: under torchrun, the process group the engine thread's collectives go through (a group of its
        own: the update's collectives on the default group run at the same time in the trainer's thread).
        ``in_flight``: ``rollout.in_flight`` (see :class:`_InFlight`)."""
        super().__init__()
        self.eta, self.threaded = eta, threaded
        self.in_flight = in_flight != "off"
        if self.in_flight:
            if not threaded:
                raise ValueError("in-flight weight updates need the background thread")
            # (make_engine refused an engine that cannot take weights in flight: this one polls its swaps)
            engine.swaps = _InFlight(self, in_flight == "recompute")
        self.collect, self.engine, self.weights = collect, engine, weights
        self.device = device
        self.group = group
        self.thread: threading.Thread | None = None
        self.stream = torch.cuda.Stream(device) if threaded and device.type == "cuda" else None
        self.reset(0, 0)

    # ------------------------------------------------------------------------------------------ the trainer's side

    def reset(self, version: int, total: int) -> None:
        """Stops a running collect first (a collapse rollback); what it had collected is dropped."""
        self.close()
        self.version = version
        self.lag = Lag(self.eta, version, total)
        self.queue = self.restored(version)
        self.next = version + len(self.queue)  # the next batch to collect
        self.engine_version: int | None = None  # unknown: loaded when the feed starts
        self.engine_waits: int | None = None  # the version the engine thread is waiting for, if it is
        self.copies: dict[int, _Copy] = {}
        self.ready_event: torch.cuda.Event | None = None  # after the actor's own copy into the engine, on a GPU
        self.error: BaseException | None = None
        self.stopping = False
        self.alone = False  # stopping without the other processes' engines (close with a timeout)
        self.started = False
        self.paused = False  # held idle for a checkpoint: batches from _held_from() on wait
        self.collecting = False  # the engine thread is collecting a batch
        self.swaps, self.swap_s = 0, 0.0  # in-flight updates of the batch being collected, and their seconds

    def take(self, j: int) -> Batch:
        """Rollout batch ``j``, once collected, with its ``async/*`` metrics; before returning, the engine has (or has
        a copy of) every version it will still need that only the actor's weights hold now."""
        self._start()
        t0 = time.perf_counter()
        with self.cond:
            self._wait(lambda: j in self.queue and self._safe())
            q = self.queue.pop(j)
            ahead = len(self.queue)
        batch = q.taken(j, time.perf_counter() - t0, ahead)
        if self.stream is not None:  # the batch's device tensors were made on the engine's stream
            _use_on_current_stream(batch)
        return batch

    def publish(self, version: int) -> None:
        """The actor's weights are ``version`` now (after training batch ``version - 1``): collect what it unblocks
        (in turn with the update), or hand it to the engine thread (a copy, with η >= 2, when a batch needs it)."""
        with self.cond:
            self.version = version
            # The engine loads the newest version when it can. Decided on version and total alone, never on how far
            # this process's engine has got: under FSDP2 the copy is a collective every process must make.
            if self.in_flight and version < self.lag.total:
                self.copies = {version: self._copy()}
            elif self.threaded and self.eta >= 2 and self.lag.needed(version, self.next) \
                    and version != self.engine_version:
                self.copies[version] = self._copy()
            self.cond.notify_all()
        if not self.threaded:
            self._collect_ready()

    def pause(self) -> None:
        """For a checkpoint: wait until every batch sampled by an older version than the actor's is collected and hold
        the engine idle (its sampling stream and the data position stay as they are, and so do the batches waiting
        for the actor, which :meth:`state_dict` saves). :meth:`resume` lets the engine go on."""
        self._start()
        with self.cond:
            self.paused = True
            self._wait(lambda: self.next >= self._held_from() and not self.collecting)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def drop(self) -> None:
        """A rollback: stop collecting for the abandoned timeline (:meth:`reset` starts the next one)."""
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine thread after the batch it is collecting (what it collected is dropped); ``timeout``: wait
        at most that long (a run that is failing does not wait for a long collect)."""
        thread = getattr(self, "thread", None)
        if thread is None:
            return
        with self.cond:
            self.stopping = True
            # a failing run stops alone: its peers' engines may never come to agree, and it must not wait in a
            # collective for them (they fail on their own once this process is gone)
            self.alone = timeout is not None
            self.cond.notify_all()
        thread.join(timeout)
        self.thread = None

    # ------------------------------------------------------------------------------------------ internals

    def _held_from(self) -> int:
        """While paused for a checkpoint (the actor's version fixed): the first batch the engine holds back. Every
        batch an older version samples comes before it, and under torchrun the one the actor's own version samples too
        (module docstring: every process saves the same batches)."""
        return min(self.lag.total, self.version + self.eta + (self.group is not None))

    def _safe(self) -> bool:
        """The actor may change its weights: no batch still to collect needs the version it holds, or the engine has
        that version, or a copy of it."""
        v = self.version
        return not self.lag.needed(v, self.next) or self.engine_version == v or v in self.copies

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait (holding ``cond``) until ``done()``, raising the engine thread's error; whenever the engine thread
        waits for the version the actor holds, load it into the engine from the actor's weights directly."""
        while not done():
            if self.error is not None:
                raise self.error
            if not self.threaded:
                raise RuntimeError("in turn with the update, a batch or version the update needs was not collected")
            if (self.engine_waits == self.version and self.engine_version != self.version
                    and self.version not in self.copies):
                self._load(self.weights())
                if self.device.type == "cuda":
                    self.ready_event = torch.cuda.Event()
                    self.ready_event.record()
                self.engine_version = self.version
                self.cond.notify_all()
                continue
            if self.threaded and (self.thread is None or not self.thread.is_alive()) and not done():
                raise RuntimeError("the rollout thread ended without the batch the update waits for")
            self.cond.wait()

    def _copy(self) -> _Copy:
        """The actor's weights now, copied (the actor's next steps leave them as they are)."""
        weights = [(name, t.detach().clone()) for name, t in self.weights()]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return _Copy(weights, event)

    def _load(self, weights) -> float:
        t0 = time.perf_counter()
        self.engine.sync_weights(weights)
        return time.perf_counter() - t0

    def _newest(self) -> int:
        """The newest version the engine has or may load (under ``cond``)."""
        return max((self.engine_version, *self.copies))

    def _load_copy(self, version: int, copy: _Copy) -> float:
        """In the engine thread: load a published version's copy into the engine, on its stream, and drop the copy
        once the engine has read it; the seconds it took."""
        if copy.ready is not None:
            torch.cuda.current_stream().wait_event(copy.ready)
        seconds = self._load(copy.weights)
        if self.stream is not None:  # the copy is freed only once the engine has read it
            self.stream.synchronize()
        with self.cond:
            if self.copies.get(version) is copy:  # (in flight, a newer version may have replaced it)
                del self.copies[version]
            self.engine_version = version
            self.cond.notify_all()
        return seconds

    def _start(self) -> None:
        """On the first take: the engine gets the resumed policy's weights, then the collect starts."""
        if self.started:
            return
        self.started = True
        self._load(self.weights())
        self.engine_version = self.lag.v0
        if not self.threaded:
            self._collect_ready()
            return
        if self.device.type == "cuda":
            self.ready_event = torch.cuda.Event()
            self.ready_event.record()
        self.thread = threading.Thread(target=self._run, name="gspo-rollout", daemon=True)
        self.thread.start()

    def _collect_ready(self) -> None:
        """In turn with the update: collect every batch whose version exists (the actor holds it: no copy)."""
        while self.next < self.lag.total and self.lag.version_of(self.next) <= self.version:
            g = self.lag.version_of(self.next)
            assert g == self.version, "in turn with the update, a batch's version is the actor's"
            sync = 0.0
            if self.engine_version != g:
                sync = self._load(self.weights())
                self.engine_version = g
            self.queue[self.next] = Queued(self.collect(), g, 0.0, sync)
            self.next += 1

    def _run(self) -> None:
        """The engine thread: collect batches in order, each once its version is in the engine."""
        try:
            with (torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext(),
                  comm.using(self.group)):
                while True:
                    with self.cond:
                        j = self.next
                        if j >= self.lag.total or self.stopping and (self.group is None or self.alone):
                            return
                        g = self.lag.version_of(j)
                        t0 = time.perf_counter()
                        self.engine_waits = g
                        self.cond.notify_all()
                        # paused for a checkpoint: only the batches it saves (see pause)
                        self.cond.wait_for(lambda: self.stopping or (not self.paused or j < self._held_from()) and (
                            self.engine_version == g or g in self.copies
                            or self.in_flight and self._newest() >= g))
                        self.engine_waits = None
                        stopping, alone = self.stopping, self.alone
                        # batch j is claimed before the lock is let go: a pause waits for it
                        self.collecting = not stopping
                        waited = time.perf_counter() - t0
                        if self.in_flight:  # the newest version there is, never older than the lag allows
                            g = self._newest()
                        copy = self.copies.get(g)
                        ready, self.ready_event = self.ready_event, None
                    if self.group is not None and not alone:  # every engine thread starts batch j, or none does
                        stopping = comm.any_rank(stopping)
                    if stopping:
                        with self.cond:
                            self.collecting = False
                            self.cond.notify_all()
                        return
                    with CAPTURE_LOCK:
                        if ready is not None:  # the actor's copy into the engine was queued on its stream
                            torch.cuda.current_stream().wait_event(ready)
                        sync = 0.0 if copy is None else self._load_copy(g, copy)
                        del copy
                        self.swaps, self.swap_s = 0, 0.0
                        batch = self.collect()
                        if self.stream is not None:
                            self.stream.synchronize()
                    with self.cond:
                        self.queue[j] = Queued(batch, g, waited, sync + self.swap_s, self.swaps)
                        self.next = j + 1
                        self.collecting = False
                        self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 -- raised in the trainer's thread by take()
            with self.cond:
                self.error = e
                self.cond.notify_all()


class _InFlight:
    """In-flight weight updates (``rollout.in_flight``): the engine polls this between decode steps
    (:class:`gspo.rollout.graph.InFlight`) and loads the newest version the actor has published since its own.

    The actor copies every version it publishes (:meth:`Ahead.publish`) and drops the previous copy if the engine
    never took it, so at most two copies of the weights exist at once: the one the engine is loading and the newest.
    A batch still starts only once the lag's version g(j) exists, and with the newest version there is, so every
    token is sampled by a version between g(j) and j: the staleness bound holds per token."""

    def __init__(self, feed: Ahead, recompute: bool):
        self.feed, self.recompute = feed, recompute

    @property
    def version(self) -> int:
        return self.feed.engine_version

    def poll(self) -> bool:
        p = self.feed
        with p.cond:
            newest = p._newest()
            if newest == p.engine_version:
                return False
            copy = p.copies[newest]
        p.swap_s += p._load_copy(newest, copy)
        p.swaps += 1
        return True


def _use_on_current_stream(obj) -> None:
    """Mark every CUDA tensor in ``obj`` (dataclasses, dicts, lists) as used on the current stream, so the caching
    allocator does not hand its memory back to the engine's stream while the update's kernels may still read it."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(torch.cuda.current_stream(obj.device))
    elif isinstance(obj, dict):
        for v in obj.values():
            _use_on_current_stream(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, torch.Tensor) or dataclasses.is_dataclass(v):
                _use_on_current_stream(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _use_on_current_stream(getattr(obj, f.name))
