"""Decode processes (``rollout.decode_processes = k``, under torchrun): the last ``k`` processes of the job only sample
rollout batches, the others only train, and the weights travel from trainer 0 to them after every update
(:mod:`gspo.parallel.roles` has the layout and the groups).

The schedule is :mod:`gspo.train.pipeline`'s fixed lag: rollout batch ``j`` is sampled by policy version
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
pipeline does), and so does a rollback before its ``reset`` (they belong to the abandoned timeline) and the end of
the run before ``stop``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gspo.errors import UserError
from gspo.parallel import comm
from gspo.parallel.roles import Roles
from gspo.runtime import CAPTURE_LOCK
from gspo.train.pipeline import Queued
from gspo.types import Batch

log = logging.getLogger("gspo")

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def pack(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]],
                                                                 list[torch.Tensor]]:
    """The weights as one flat buffer per dtype (a copy, on their device) and what :func:`unpack` needs: one broadcast
    per dtype instead of one per tensor."""
    items = [(name, t.detach()) for name, t in weights]
    meta = [(name, tuple(t.shape), t.dtype) for name, t in items]
    dtypes = list(dict.fromkeys(t.dtype for _, t in items))
    return meta, [torch.cat([t.reshape(-1) for _, t in items if t.dtype == d]) for d in dtypes]


def unpack(meta, flats: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of :func:`pack`'s buffers."""
    dtypes = list(dict.fromkeys(d for _, _, d in meta))
    offsets = dict.fromkeys(dtypes, 0)
    out = []
    for name, shape, dtype in meta:
        flat, n = flats[dtypes.index(dtype)], math.prod(shape)
        out.append((name, flat[offsets[dtype]:offsets[dtype] + n].view(shape)))
        offsets[dtype] += n
    return out


def _sizes(meta) -> list[tuple[torch.dtype, int]]:
    dtypes = list(dict.fromkeys(d for _, _, d in meta))
    return [(d, sum(math.prod(s) for _, s, dt in meta if dt == d)) for d in dtypes]


class SharedWeights:
    """The weights' way to decode processes on the same machine (``rollout.decode_gpu = 'shared'``): ``eta + 1`` slots
    of memory that trainer 0 writes and every decode process maps, version ``v`` in slot ``v mod (eta + 1)``, with the
    version stamped on it. On GPUs the slots are CUDA memory shared by IPC handles (NCCL refuses two processes of one
    group on one GPU); on CPUs, files under /dev/shm mapped by both sides. Hand-written because no library offers a
    ring of IPC buffers between two torchrun processes; torch provides the handles (one set per decode process: torch
    counts each set's users).

    A slot is written again only once the decode processes are done with the version in it (:meth:`read_through`):
    they load versions in order, and a batch sampled by version ``u`` tells that every version up to ``u`` was loaded.
    The fixed lag keeps that from ever waiting: version ``v`` is published after batch ``v - 1``, sampled by version
    ``v - 1 - eta`` or a later one, and slot ``v mod (eta + 1)`` held version ``v - 1 - eta``. A write clears the stamp
    before it copies and stamps the version after, and a decode process reads the stamp before and after its copy, so
    a slot written while it was read fails in one line instead of loading a mix of two versions."""

    def __init__(self, eta: int, device: torch.device, decoders: int):
        self.count, self.device, self.decoders = eta + 1, device, decoders
        self.slots: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}  # slot -> (flat buffers, stamp)
        self.pending: dict[int, int] = {}  # slot -> the version written there, not yet known to be loaded
        self.cond = threading.Condition()
        self.dir = None
        if device.type != "cuda":
            self.dir = Path(tempfile.mkdtemp(prefix="gspo-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                             else None))

    def reserve(self, v: int, failed: Callable[[], bool]) -> int | None:
        """The slot version ``v`` goes into, once the version in it is loaded; None when ``failed()`` says the run
        failed meanwhile."""
        slot = v % self.count
        with self.cond:
            while slot in self.pending:
                if failed():
                    return None
                self.cond.wait(1.0)
            self.pending[slot] = v
        return slot

    def write(self, v: int, slot: int, flats: list[torch.Tensor]) -> list | None:
        """Version ``v``'s buffers into ``slot`` (:meth:`reserve`'s; copies on the current stream, the stamp cleared
        first and set last); the first time the slot is used, the handles that map it, a set per decode process."""
        handles = None
        if slot not in self.slots:
            self.slots[slot], handles = self._allocate(slot, flats)
        buffers, stamp = self.slots[slot]
        if [(b.dtype, b.numel()) for b in buffers] != [(f.dtype, f.numel()) for f in flats]:
            raise RuntimeError("the policy's weights changed shape between two versions; shared slots cannot hold them")
        stamp.fill_(-1)
        for buffer, flat in zip(buffers, flats):
            buffer.copy_(flat)
        stamp.fill_(v)
        return handles

    def read_through(self, version: int | None) -> None:
        """The decode processes loaded every version up to ``version`` (None: every version written, after they
        finished what they owed a timeline)."""
        with self.cond:
            self.pending = {s: v for s, v in self.pending.items() if version is not None and v > version}
            self.cond.notify_all()

    def close(self) -> None:
        self.slots.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _allocate(self, slot: int, flats: list[torch.Tensor]) -> tuple[tuple[list[torch.Tensor], torch.Tensor], list]:
        specs = [(f.dtype, f.numel()) for f in flats] + [(torch.int64, 1)]  # the buffers, then the stamp
        if self.dir is None:
            from torch.multiprocessing.reductions import reduce_tensor

            tensors = [torch.empty(n, dtype=d, device=self.device) for d, n in specs]
            handles = [[reduce_tensor(t) for t in tensors] for _ in range(self.decoders)]
        else:
            need = sum(n * d.itemsize for d, n in specs) * (self.count - len(self.slots))
            free = shutil.disk_usage(self.dir).free
            if need > free:
                raise UserError(f"rollout.decode_gpu = 'shared' needs {need / 2**20:.0f} MiB more in {self.dir.parent} "
                                f"for the weights' slots, and it has {free / 2**20:.0f} MiB free; give it more (docker "
                                "run --shm-size), or set rollout.decode_gpu = 'own'.")
            files = [(str(self.dir / f"slot{slot}-{i}"), n, d) for i, (d, n) in enumerate(specs)]
            tensors = map_shared(files)
            handles = [files] * self.decoders
        tensors[-1].fill_(-1)
        return (tensors[:-1], tensors[-1]), handles


def map_shared(handles: list) -> list[torch.Tensor]:
    """A decode process's view of a :class:`SharedWeights` slot from the handles trainer 0 sent."""
    out = []
    for handle in handles:
        if isinstance(handle[0], str):  # a file on a CPU: (path, numel, dtype)
            path, n, dtype = handle
            out.append(torch.from_file(path, shared=True, size=n, dtype=dtype))
        else:  # CUDA IPC: torch's (rebuild function, arguments)
            rebuild, args = handle
            out.append(rebuild(*args))
    return out


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


class RemotePipeline:
    """The trainers' side: :class:`gspo.train.pipeline.Pipeline`'s interface over the decode processes."""

    def __init__(self, eta: int, roles: Roles, weights: Weights, device: torch.device, collector: RemoteCollector,
                 shared: bool = False):
        self.eta, self.roles, self.weights, self.device = eta, roles, weights, device
        self.collector = collector
        # rollout.decode_gpu = 'shared': trainer 0 writes the weights into memory the decode processes map
        self.shared = SharedWeights(eta, device, roles.decoders) if shared and roles.rank == 0 else None
        self.cond = threading.Condition()
        self.sends: queue.Queue | None = queue.Queue() if roles.rank == 0 else None
        self.error: BaseException | None = None
        self.queue: dict[int, Queued] = {}
        self.arrived = self.start = self.v0 = self.version = self.total = 0
        self.sent: int | None = None
        self.timeline = 0  # started timelines (a rollback starts another)
        self.receiver = threading.Thread(target=self._receive, name="gspo-batches", daemon=True)
        self.receiver.start()
        self.sender = None
        if self.sends is not None:
            self.sender = threading.Thread(target=self._send, name="gspo-orders", daemon=True)
            self.sender.start()

    def version_of(self, j: int) -> int:
        return max(j - self.eta, self.v0)

    # ------------------------------------------------------------------------------------------ the trainers' side

    def reset(self, version: int, total: int, queued: list[Queued]) -> None:
        """Start a timeline at policy ``version`` with the batches a checkpoint saved (after the batches the decode
        processes owe the one before it, which are dropped)."""
        if self.timeline:
            self._drain()
            if self.shared is not None:
                self.shared.read_through(None)
        self.timeline += 1
        with self.cond:
            self.v0 = self.version = version
            self.total = total
            self.queue = {version + i: q for i, q in enumerate(queued)}
            self.start = self.arrived = version + len(queued)
            self.sent = None
        saved = self.collector.saved
        self._order(("reset", version, self.start, total, self.eta, saved))
        if self._needed(version):
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
        if self._needed(version):
            self._publish_weights(version)

    def pause(self) -> list[Queued]:
        """For a checkpoint: the batches the decode processes owe (they send nothing more before the next order), in
        order; the collect state after the last of them is :attr:`RemoteCollector.latest`."""
        self._drain()
        with self.cond:
            return [self.queue[j] for j in sorted(self.queue)]

    def resume(self) -> None:
        pass

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

    def _needed(self, v: int) -> bool:
        """Whether a batch the decode processes still collect in this timeline is sampled by version ``v``."""
        return any(self.version_of(j) == v for j in range(max(self.start, v), min(self.total, v + self.eta + 1)))

    def _owed_end(self) -> int:
        """One past the last batch the decode processes send before they read another order."""
        return self.start if self.sent is None else max(self.start, min(self.total, self.sent + self.eta + 1))

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
                    with _copying(stream, event):
                        handles = self.shared.write(header[1], slot, flats)
                    comm.send_from((*header, slot, handles), 0, roles.link)
                    continue
                comm.send_from(header, 0, roles.link)
                if flats is not None:
                    with _copying(stream, event):
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


@contextlib.contextmanager
def _copying(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None):
    """Trainer 0's sending thread moving a version's buffers: on its own stream (``stream``; None on a CPU), after the
    update's copy into them (``event``), finished on leaving; and with no CUDA call while the update captures a graph
    (:data:`gspo.runtime.CAPTURE_LOCK`)."""
    with CAPTURE_LOCK, (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        yield
        if stream is not None:
            stream.synchronize()


class Decoder:
    """A decode process: collects every batch whose version it has, in order, sends it (process 0 of them) and waits
    for the next order (see the module docstring)."""

    def __init__(self, cfg, roles: Roles, runtime):
        from gspo.train.parts import build_sampler

        self.cfg, self.roles, self.runtime = cfg, roles, runtime
        self.engine, self.collector = build_sampler(cfg, runtime, roles.index)
        self.first = roles.index == 0
        self.slots: dict[int, list[torch.Tensor]] = {}  # rollout.decode_gpu = 'shared': the slots mapped so far

    def run(self) -> None:
        """Until trainer 0 says stop."""
        roles, c = self.roles, self.collector
        eta = v0 = total = j = 0
        engine_version: int | None = None
        try:
            while True:
                t0 = time.perf_counter()
                order = comm.send_from(None, 0, roles.link)
                waited, sync = time.perf_counter() - t0, 0.0
                if order[0] == "stop":
                    self.slots.clear()  # (unmapped before trainer 0, which owns them, frees them)
                    if self.first:
                        comm.send_from(("end",), roles.first_decoder, roles.batches)
                    return
                if order[0] == "reset":
                    _, v0, j, total, eta, saved = order
                    engine_version = None
                    if saved is not None:
                        self._restore(saved)
                    continue
                _, engine_version, meta, *where = order
                t1 = time.perf_counter()
                if where:
                    self._load_shared(engine_version, meta, *where)
                else:
                    flats = [torch.empty(n, dtype=d, device=self._weights_device()) for d, n in _sizes(meta)]
                    for flat in flats:
                        torch.distributed.broadcast(flat, src=0, group=roles.weights)
                    self.engine.sync_weights(unpack(meta, flats))
                    del flats
                sync = time.perf_counter() - t1
                while j < total and max(j - eta, v0) == engine_version:
                    batch = c.collect()
                    own = c.state_dict()
                    generators = comm.gather_objects(own["generator"])  # every decode process's, in order
                    if self.first:
                        state = {"generators": generators, "data": own["data"],
                                 "skipped_prompts": own["skipped_prompts"]}
                        comm.send_from(("batch", j, engine_version, batch, state, waited, sync), roles.first_decoder,
                                       roles.batches)
                    waited = sync = 0.0
                    j += 1
        except BaseException as e:
            if self.first and not isinstance(e, comm.PeerLost):
                try:
                    comm.send_from(("error", str(e), isinstance(e, UserError)), roles.first_decoder, roles.batches)
                except Exception:  # noqa: BLE001 -- the trainers are gone too; the launcher names the cause
                    pass
            raise
        finally:
            c.close()

    def _load_shared(self, version: int, meta, slot: int, handles: list | None) -> None:
        """Version ``version`` from :class:`SharedWeights`' slot ``slot`` into the engine (mapping the slot first when
        ``handles`` come with it: this process's set), its stamp checked before and after."""
        if handles is not None:
            self.slots[slot] = map_shared(handles[self.roles.index])
        *flats, stamp = self.slots[slot]
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        before = int(stamp.item())
        self.engine.sync_weights(unpack(meta, flats))
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        after = int(stamp.item())
        if before != version or after != version:
            raise RuntimeError(f"shared weights slot {slot} held version {before} then {after} while this decode "
                               f"process loaded version {version}: trainer 0 wrote it too soon")

    def _weights_device(self) -> torch.device:
        return self.runtime.device if self.runtime.device.type == "cuda" else torch.device("cpu")

    def _restore(self, saved: dict) -> None:
        """The collect stage's state from the trainers' checkpoint (:meth:`RemoteCollector.load_state_dict`): this
        process's sampling stream when the same number of decode processes wrote it, else one seeded from (seed, step,
        index)."""
        c, index = self.collector, self.roles.index
        c.stream.load_state_dict(saved["data"])
        c.skipped_prompts = saved["skipped_prompts"]
        c.generator.set_state(saved["generators"][index])


def decode_if_mine(cfg) -> int | None:
    """Under ``rollout.decode_processes``: if this process of the job is a decode process, run it as one until the
    trainers stop, and return its exit code (130 / 143 when a stop signal reached it too: the trainers stop on it and
    say so); None in a trainer, or in a job without decode processes."""
    import dataclasses

    from gspo.parallel import roles
    from gspo.train.guards import StopSignals

    world, rank = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0)))
    if not cfg.rollout.decode_processes or world <= 1 or rank < world - cfg.rollout.decode_processes:
        return None  # (a trainer: the Trainer checks the layout)
    runtime, mine = roles.join(cfg)
    runtime = dataclasses.replace(runtime, rank=mine.index, world_size=mine.decoders)
    # the first stop signal is the trainers' to act on (they finish the batch, checkpoint, and send stop)
    with StopSignals(lambda: "decoding") as stop:
        Decoder(cfg, mine, runtime).run()
    return 0 if stop.received is None else (130 if stop.received == "SIGINT" else 143)
