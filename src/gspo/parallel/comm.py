"""The collectives the loop adds across the processes of a ``torchrun`` job: joining and leaving it, gathering objects
and rows, sums, agreement and barriers. One process (no ``torchrun``, or ``WORLD_SIZE`` 1) calls none of them: every
function here is the identity there. Imports nothing of gspo above ``errors``.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import torch

from gspo.errors import UserError


class PeerLost(UserError):
    """This process could not go on because another process of the job is gone or never came (crashed, killed,
    hung): the consequence of another's failure, not a cause of its own (the launcher names the cause). ``waited``:
    it gave up after ``dist.timeout_s`` (the others hung; one killed later was killed for hanging), as opposed to
    finding a connection closed (another ended first)."""

    def __init__(self, message: str, waited: bool):
        super().__init__(message)
        self.waited = waited


_THREAD = threading.local()  # .group: the group this thread's collectives use (see using())
_ROLE_GROUP = None  # the processes of this one's role, when a job splits into trainers and decoders (set_role_group)


def group():
    """The process group the functions here use in this thread: the one :func:`using` set, else this process's role's
    (:func:`set_role_group`), else None (the default group, every process of the job)."""
    return getattr(_THREAD, "group", None) or _ROLE_GROUP


@contextlib.contextmanager
def using(pg) -> Iterator[None]:
    """The collectives of this module called in this thread inside the block go through ``pg``: how a background
    rollout thread talks to the other processes beside the update's own collectives on the default group, which two
    threads must not share (their calls would interleave in different orders on different processes)."""
    before = getattr(_THREAD, "group", None)
    _THREAD.group = pg
    try:
        yield
    finally:
        _THREAD.group = before


def set_role_group(pg) -> None:
    """Make ``pg`` (the processes that share this one's role) the group of this process's collectives here."""
    global _ROLE_GROUP
    _ROLE_GROUP = pg


def new_group(ranks: list[int] | None = None, backend: str = "gloo"):
    """A group of ``ranks`` (default: every process; gloo: for host objects beside a job's other traffic), whose
    collectives give up after the job's ``dist.timeout_s`` as the default group's do (torch's default for a new group
    is 30 minutes). Every process of the job must call it, in the same order, members or not (torch's rule)."""
    return torch.distributed.new_group(ranks, backend=backend, timeout=_TIMEOUT)


def new_gloo_group(ranks: list[int] | None = None):
    return new_group(ranks, "gloo")


def in_job() -> bool:
    """Whether this process is one of several of a torchrun job (whichever group its collectives use)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def active() -> bool:
    """Whether this process is one of several in its initialised process group (:func:`group`)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group()) > 1)


def init(device: torch.device, timeout_s: float, subgroups: bool = False, shared_gpus: bool = False) -> None:
    """Join the ``torchrun`` job (NCCL on GPUs, gloo on CPUs); a collective that waits longer than ``timeout_s``
    (a rank that crashed or hangs) fails instead of waiting forever. ``subgroups``: the job will make groups of some
    of its processes (decode processes): NCCL's communicator is then made at its first collective, not at once (bound
    to the device, torch 2.11 makes every later group by splitting it, a collective of every process, which the
    processes outside a group never join: it hung). ``shared_gpus``: some processes share a GPU
    (``rollout.decode_gpu = 'shared'``), which NCCL refuses within a group: the job's default group is gloo, and the
    trainers make their NCCL group among themselves (:func:`gspo.parallel.roles.split`)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" and not shared_gpus else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" and not subgroups else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except dist.DistError as e:  # a store timeout: some process never joined
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PeerLost(f"Process {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']} waited dist.timeout_s = "
                       f"{timeout_s:g} s for the others to join the job and not all came ({first}): one failed or "
                       "hangs at start; fix that, or raise dist.timeout_s if starting takes longer.", waited=True) from e
    global _OWN_GROUP, _TIMEOUT
    _OWN_GROUP = True
    _TIMEOUT = datetime.timedelta(seconds=timeout_s)


_OWN_GROUP = False  # whether init() made the default process group (a colocated vLLM makes one of its own)
_TIMEOUT: datetime.timedelta | None = None  # dist.timeout_s of the job init() joined


def close() -> None:
    """Leave the job: destroy the process group init() made, and no other (vLLM in this process owns its own)."""
    global _OWN_GROUP
    if _OWN_GROUP and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWN_GROUP = False
    set_role_group(None)


def rank_world() -> tuple[int, int]:
    """This process's rank in :func:`group` and its size."""
    pg = group()
    return (torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)) if active() else (0, 1)


def _comm_device(device: torch.device | None = None) -> torch.device:
    """Where a collective's tensors must be: this process's GPU under NCCL, the CPU under gloo."""
    if torch.distributed.get_backend(group()) != "nccl":
        return torch.device("cpu")
    return device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def _tensor_from_array(array) -> torch.Tensor:
    return torch.from_numpy(array)


def _bfloat16_from_array(array) -> torch.Tensor:
    return torch.from_numpy(array).view(torch.bfloat16)


class _ArrayPickler(pickle.Pickler):
    """Pickles tensors as numpy arrays of their CPU values: torch's own reduction writes each storage through
    ``torch.save`` and reads it back through ``torch.load``, ~20x slower to load than an array's bytes; a process's
    share of a rollout batch's gather (its Python lists included) unpickles ~2.5x faster this way
    (``benchmarks/gather_pickle.py``). A GPU tensor travels as its CPU copy (what a receiver on another device can
    load), bfloat16 (which numpy lacks) as its int16 bits; a tensor that requires grad or a subclass keeps torch's
    reduction."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and not obj.requires_grad and type(obj) is torch.Tensor:
            cpu = obj.detach().cpu()
            if cpu.dtype == torch.bfloat16:
                return _bfloat16_from_array, (cpu.view(torch.int16).numpy(),)
            return _tensor_from_array, (cpu.numpy(),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as :func:`gather_objects` sends it (tensors as numpy arrays on the CPU); ``pickle.loads`` reads
    it."""
    buf = io.BytesIO()
    _ArrayPickler(buf, protocol=4).dump(obj)  # protocol 4: unpickled arrays own writable memory
    return buf.getvalue()


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` in one process), pickled by :func:`dumps`.

    Written here rather than with ``all_gather_object``, which pickles the pickle again and brings each rank's bytes to
    the host with a copy and a synchronisation of its own: here one exchange of sizes, one all-gather of the padded
    bytes and one copy to the host."""
    if not active():
        return [obj]
    data = dumps(obj)
    dev = _comm_device()
    pg = group()
    world = torch.distributed.get_world_size(pg)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    torch.distributed.all_gather_into_tensor(sizes, size, group=pg)
    sizes = sizes.tolist()
    width = max(sizes)
    send = torch.zeros(width, dtype=torch.uint8)
    send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a pickle is never empty
    every = torch.empty(world * width, dtype=torch.uint8, device=dev)
    torch.distributed.all_gather_into_tensor(every, send.to(dev), group=pg)
    host = memoryview(every.cpu().numpy())
    return [pickle.loads(host[r * width:r * width + n]) for r, n in enumerate(sizes)]


def split_work(items: list, fn) -> list:
    """``fn(items)`` (a list with one result per item) computed by the processes together: each applies ``fn`` to its
    1/W of ``items`` (every W-th one) and every process receives all results in order. Every process must call it with
    the same items. For host work that every process needs whole, such as encoding a sampling round's prompts."""
    if not active() or len(items) < 2:
        return fn(items)
    rank, world = rank_world()
    parts = gather_objects(fn(items[rank::world]))
    out = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::world] = part
    return out


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` (same shape on all), concatenated on dimension 0 in rank order."""
    if not active():
        return local
    dev = _comm_device(local.device)
    pg = group()
    parts = [torch.empty_like(local, device=dev) for _ in range(torch.distributed.get_world_size(pg))]
    torch.distributed.all_gather(parts, local.to(dev).contiguous(), group=pg)
    return torch.cat(parts).to(local.device)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ranks (a new tensor on ``t``'s device)."""
    if not active():
        return t
    dev = _comm_device(t.device)
    out = t.detach().to(dev, copy=True)
    torch.distributed.all_reduce(out, group=group())
    return out.to(t.device)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: how ranks agree to stop together."""
    if not active():
        return flag
    t = torch.tensor([float(flag)], device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group())
    return bool(t.item())


def barrier() -> None:
    if active():
        torch.distributed.barrier(group=group())


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, group=group(), group_src=0)
    return box[0]


def send_from(obj: Any, src: int, pg) -> Any:
    """``obj`` of process ``src`` (its rank in the job) on every member of the gloo group ``pg``: what ``src`` passes
    is returned to all of them (the others pass None). Pickled by :func:`dumps`, in two broadcasts (the size, then
    the bytes): how a decode process hands a rollout batch to the trainers and trainer 0 its orders to the decode
    processes."""
    mine = torch.distributed.get_rank() == src
    data = dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    torch.distributed.broadcast(size, src=src, group=pg)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(size), dtype=torch.uint8)
    torch.distributed.broadcast(buf, src=src, group=pg)
    return obj if mine else pickle.loads(memoryview(buf.numpy()))
