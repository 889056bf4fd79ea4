"""How a policy version's weights travel from trainer 0 to the decode processes (``rollout.decode_processes``):
packed into one flat buffer per dtype (:func:`pack` / :func:`unpack`), then broadcast (``rollout.decode_gpu = 'own'``:
NCCL between GPUs, gloo on CPUs) or written into shared slots the decode processes map
(:class:`SharedWeights`, ``rollout.decode_gpu = 'shared'``). Both sides use it: the trainers' feed
(:mod:`gspo.feed.remote`) sends, the decode process (:mod:`gspo.collect.decoder`) receives.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gspo.errors import UserError
from gspo.runtime import CAPTURE_LOCK


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


def sizes(meta) -> list[tuple[torch.dtype, int]]:
    """Each flat buffer's dtype and length, from :func:`pack`'s meta: what a receiver allocates before a broadcast."""
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


@contextlib.contextmanager
def copying(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None):
    """Trainer 0's sending thread moving a version's buffers: on its own stream (``stream``; None on a CPU), after the
    update's copy into them (``event``), finished on leaving; and with no CUDA call while the update captures a graph
    (:data:`gspo.runtime.CAPTURE_LOCK`)."""
    with CAPTURE_LOCK, (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        yield
        if stream is not None:
            stream.synchronize()
