"""Decode processes (``rollout.decode_processes = k``, under torchrun): the last ``k`` processes of the job only sample
rollout batches, the others only train, and the weights travel from trainer 0 to them after every update
(:mod:`gspo.parallel.roles` has the layout and the groups).

The schedule is :mod:`gspo.feed.lag`'s fixed lag: rollout batch ``j`` is sampled by policy version
``g(j) = max(j - η, v0)``, so a job with decode processes computes what the same job does with its rollouts in one
process: 1 trainer + 1 decode process equals a one-process run of the same ``rollout.max_staleness`` bit for bit (same
sampling stream, same data, same update), and its checkpoints resume either way.

The conversation, all of it in order, so that no process depends on another's timing:

* trainer 0 -> decode processes (``link``, then ``weights``): ``reset`` (where the trainers' timeline starts: a new
  run, a resume, a rollback; the collect stage's state from the checkpoint), ``weights`` (version ``v`` and its
  tensors, sent when published, only if a batch still to collect needs it), ``stop``. Trainer 0 sends from a thread of
  its own (a copy of each version, made when published), so that an update never waits for a decode process.
* decode process 0 -> trainers (``batches``): each batch once collected, with the version that sampled it and the
  collect stage's state after it (data position, every decode process's sampling stream); ``error`` (the collect
  failed: the trainers raise it, in its one line); ``end`` (after ``stop``). Every trainer receives in a thread of its
  own into a queue, so a decode process never waits for an update either.

The weights travel by a broadcast of one flat buffer per dtype (``rollout.decode_gpu = 'own'``: NCCL between GPUs),
or, with ``'shared'`` (a decode process on a trainer's GPU, where NCCL cannot go), through :class:`SharedWeights`:
buffers trainer 0 writes and the decode processes map (CUDA IPC; a mapped file on CPUs), the order naming the slot.

A decode process collects every batch whose version it has, in order, then waits for the next order. So what it will
send before reading the next one is known to the trainers exactly (every batch ``j < sent + η + 1``, ``sent``: the
newest version sent): a checkpoint waits for those (it saves them and the state after the last, as the one-process
feed does), and so does a rollback before its ``reset`` (they belong to the abandoned timeline) and the end of
the run before ``stop``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from gspo.errors import UserError
from gspo.feed.base import Queue, Queued, Weights
from gspo.feed.lag import Lag
from gspo.feed.transport import SharedWeights, copying, pack
from gspo.parallel import comm
from gspo.parallel.roles import Roles
from gspo.types import Batch

log = logging.getLogger("gspo")



class RemoteCollector:
    """The trainers' stand-in for the collect stage, which runs in the decode processes: what a checkpoint saves of it
    (the state after the newest batch received) and restores (sent to the decode processes with the next reset).
    Its checkpoint keys are a one-process run's (``generator``: decode process 0's stream) plus every decode process's
    stream (``decoder_generators``)."""

    generator = None  # the trainers sample nothing

    def __init__(self, decoders: int, seed: int, device: torch.device):
        self.decoders, self.seed, self.device = decoders, seed, device
        self.saved: dict | None = None  # from the checkpoint restored, for the decode processes
        self.latest: dict | None = None  # the state after the newest batch received

    def state_dict(self) -> dict:
        state = self.latest or self.saved
        # (a checkpoint waits for the batches the decode processes owe, and a new run's first one for its first batch)
        assert state is not None, "a checkpoint before the decode processes collected anything"
        return {"generator": state["generators"][0], "decoder_generators": state["generators"], "data": state["data"],
                "skipped_prompts": state["skipped_prompts"]}

    def load_state_dict(self, payload: dict) -> None:
        gens = payload.get("decoder_generators")
        if gens is None and payload.get("world_size", 1) == 1 and self.decoders == 1:
            gens = [payload["generator"]]  # a one-process run's stream: the one decode process's
        if gens is None or len(gens) != self.decoders:  # another layout: the streams cannot be mapped; each is seeded
            # afresh from (seed, step, index), here, so that a checkpoint written before a batch arrives has them too
            step = int(payload["step"])
            gens = [torch.Generator(device=self.device).manual_seed(self.seed + 1_000_003 * step + i).get_state()
                    for i in range(self.decoders)]
        self.saved = {"generators": gens, "data": payload["data"], "skipped_prompts": payload.get("skipped_prompts", 0),
                      "step": int(payload["step"])}
        self.latest = None

    def close(self) -> None:
        pass


class Remote(Queue):
    """The trainers' side of a job with decode processes: the feed's interface over them (see the module
    docstring)."""

    def __init__(self, eta: int, roles: Roles, weights: Weights, device: torch.device, collector: RemoteCollector,
                 shared: bool = False):
        super().__init__()
        self.eta, self.roles, self.weights, self.device = eta, roles, weights, device
        self.collector = collector
        # rollout.decode_gpu = 'shared': trainer 0 writes the weights into memory the decode processes map
        self.shared = SharedWeights(eta, device, roles.decoders) if shared and roles.rank == 0 else None
        self.sends: queue.Queue | None = queue.Queue() if roles.rank == 0 else None
        self.error: BaseException | None = None
        self.arrived = self.start = self.version = 0
        self.lag = Lag(eta, 0, 0)
        self.sent: int | None = None
        self.timeline = 0  # started timelines (a rollback starts another)
        self.receiver = threading.Thread(target=self._receive, name="gspo-batches", daemon=True)
        self.receiver.start()
        self.sender = None
        if self.sends is not None:
            self.sender = threading.Thread(target=self._send, name="gspo-orders", daemon=True)
            self.sender.start()

    # ------------------------------------------------------------------------------------------ the trainers' side

    def reset(self, version: int, total: int) -> None:
        """First the batches the decode processes owe the timeline before (they are dropped)."""
        if self.timeline:
            self._drain()
            if self.shared is not None:
                self.shared.read_through(None)
        self.timeline += 1
        with self.cond:
            self.version = version
            self.lag = Lag(self.eta, version, total)
            self.queue = self.restored(version)
            self.start = self.arrived = version + len(self.queue)
            self.sent = None
        saved = self.collector.saved
        self._order(("reset", version, self.start, total, self.eta, saved))
        if self.lag.needed(version, self.start):
            self._publish_weights(version)

    def take(self, j: int) -> Batch:
        t0 = time.perf_counter()
        with self.cond:
            self._wait(lambda: j in self.queue)
            q = self.queue.pop(j)
            ahead = len(self.queue)
        return q.taken(j, time.perf_counter() - t0, ahead)

    def publish(self, version: int) -> None:
        self.version = version
        if self.lag.needed(version, self.start):
            self._publish_weights(version)

    def pause(self) -> None:
        """For a checkpoint: wait for the batches the decode processes owe (they send nothing more before the next
        order); the collect state after the last of them is :attr:`RemoteCollector.latest`."""
        self._drain()

    def drop(self) -> None:
        """A rollback: the decode processes finish what they owe the abandoned timeline (dropped at the next reset)."""
        self._drain()

    def close(self, timeout: float | None = None) -> None:
        """The end of the run: the decode processes finish what they owe and stop. ``timeout``: the run failed; wait
        at most that long for anything. At the end of a run that did not fail, a decode process that never says it
        stopped (its ``end`` did not come within dist.timeout_s) fails the run as a lost process does mid-run: the
        trainers finishing without it would leave torchrun waiting for it for ever."""
        if self.receiver is None:
            return
        try:
            if timeout is None:
                self._drain()
            self._order(("stop",))
        finally:
            if self.sender is not None:
                self.sender.join(timeout)
            self.receiver.join(timeout)
            self.receiver = None
            if self.shared is not None:
                self.shared.close()
        if timeout is None and self.error is not None:
            raise self.error

    # ------------------------------------------------------------------------------------------ internals

    def _owed_end(self) -> int:
        """One past the last batch the decode processes send before they read another order."""
        return self.start if self.sent is None else self.lag.runs_until(self.sent, self.start)

    def _drain(self) -> None:
        with self.cond:
            end = self._owed_end()
            self._wait(lambda: self.arrived >= end)

    def _wait(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.error is not None:
                raise self.error
            if not self.receiver.is_alive():
                raise RuntimeError("the decode processes stopped sending before the batch the update waits for")
            self.cond.wait(1.0)

    def _publish_weights(self, v: int) -> None:
        """Every trainer takes the weights (under FSDP2 a collective among them); trainer 0 sends a copy."""
        pairs = list(self.weights())
        self.sent = v
        if self.sends is None:
            return
        meta, flats = pack(pairs)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._order(("weights", v, meta), flats, event)

    def _order(self, header, flats=None, event=None) -> None:
        if self.sends is not None:
            self.sends.put((header, flats, event))

    def _send(self) -> None:
        """Trainer 0's sending thread: every order, in order."""
        roles = self.roles
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            while True:
                header, flats, event = self.sends.get()
                if flats is not None and self.shared is not None:
                    slot = self.shared.reserve(header[1], lambda: self.error is not None)
                    if slot is None:  # the run failed while the slot was still being read: it says why
                        return
                    with copying(stream, event):
                        handles = self.shared.write(header[1], slot, flats)
                    comm.send_from((*header, slot, handles), 0, roles.link)
                    continue
                comm.send_from(header, 0, roles.link)
                if flats is not None:
                    with copying(stream, event):
                        for flat in flats:
                            torch.distributed.broadcast(flat, src=0, group=roles.weights)
                if header[0] == "stop":
                    return
        except BaseException as e:  # noqa: BLE001 -- raised in the trainer's thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _receive(self) -> None:
        """Every trainer's receiving thread: the batches, in order, into the queue."""
        try:
            while True:
                msg = comm.send_from(None, self.roles.first_decoder, self.roles.batches)
                if msg[0] == "end":
                    return
                if msg[0] == "error":
                    _, text, user = msg
                    raise UserError(text) if user else RuntimeError(f"a decode process failed: {text}")
                _, j, version, batch, state, engine_wait, sync = msg
                if self.shared is not None:  # (before the update can take the batch and publish the next version)
                    self.shared.read_through(version)
                with self.cond:
                    self.queue[j] = Queued(batch, version, engine_wait, sync)
                    self.arrived = j + 1
                    self.collector.latest = state
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 -- raised in the trainer's thread by take()
            with self.cond:
                self.error = e
                self.cond.notify_all()
