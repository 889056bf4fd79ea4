"""Data parallelism across the processes of a ``torchrun`` job: torch's FSDP2 (``fully_shard``) shards the policy
(``dist.strategy = "fsdp"``) or every process keeps a whole copy and the gradients are summed before each optimizer
step (``"ddp"``), and this module holds the few collectives the loop adds. One process (no ``torchrun``, or
``WORLD_SIZE`` 1) calls none of them: every function here is the identity there.

How a rollout batch is split (``W`` ranks, ``P`` prompts, ``G`` completions):

* every rank reads the same data stream and draws the same prompts (each encodes 1/W of them and they exchange the
  ids, so that all agree on which fit ``data.max_prompt_tokens``); rank ``r`` generates and scores its ``P / W``
  prompts, each group on one rank, with its own engine and reward workers (DAPO refill rounds are taken together:
  each round every rank says how many groups it still needs, all draw that many prompts from the stream and each
  takes its share, so the stream stays one and the same on every rank);
* the scored groups are gathered (token ids, masks, rewards: kilobytes), so every rank holds the whole batch; the
  advantages, the metrics and the minibatch shuffle are the single-process ones;
* in every minibatch rank ``r`` trains the ``r``-th contiguous slice of its rows. The loss denominators (tokens,
  sequences) are those of the whole minibatch, which every rank knows; FSDP averages the gradients over ranks, so
  each rank's loss is scaled by ``W`` (DDP sums them: no scale): the gradient is the single-process one (verl #5625
  is what happens otherwise);
* each rank's new log-probs are gathered, so the diagnostics and the metrics are computed over the whole minibatch
  as one process would, and reduced once a step.
"""
from __future__ import annotations

import datetime
import heapq
import io
import os
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gspo.errors import UserError


def active() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def init(device: torch.device, timeout_s: float) -> None:
    """Join the ``torchrun`` job (NCCL on GPUs, gloo on CPUs); a collective that waits longer than ``timeout_s``
    (a rank that crashed or hangs) fails instead of waiting forever."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    global _OWN_GROUP
    _OWN_GROUP = True


_OWN_GROUP = False  # whether init() made the default process group (a colocated vLLM makes one of its own)


def close() -> None:
    """Leave the job: destroy the process group init() made, and no other (vLLM in this process owns its own)."""
    global _OWN_GROUP
    if _OWN_GROUP and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWN_GROUP = False


def rank_world() -> tuple[int, int]:
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if active() else (0, 1)


def check_layout(cfg, world: int) -> None:
    """Refuse a device that ``world`` processes would share, and a batch shape that they cannot share evenly (every group on one rank, every minibatch cut
    into equal slices, so that every rank runs the same number of forwards and collectives)."""
    if world <= 1:
        return
    if cfg.model.device.startswith("cuda:"):
        raise UserError(f"model.device = {cfg.model.device!r} would put all {world} processes on one GPU; use 'cuda' or "
                        "'auto' under torchrun (each process takes its own GPU, cuda:LOCAL_RANK).")
    if cfg.rollout.engine == "vllm":
        raise UserError("rollout.engine = 'vllm' under torchrun is not built (each process would need vLLM's "
                        "external-launcher executor); use rollout.engine = 'auto' with several processes, or vLLM in "
                        "one process.")
    if cfg.lora.rank and cfg.dist.strategy == "fsdp":
        raise UserError(f"lora.rank = {cfg.lora.rank} with dist.strategy = 'fsdp': LoRA trains with every process "
                        "holding the whole frozen base (it needs no gradients or optimizer state), so adapters are not "
                        "built for FSDP2; set dist.strategy = 'ddp' or 'auto'.")
    r, t = cfg.rollout, cfg.train
    mb = r.prompts_per_batch * r.group_size // t.minibatches
    if r.prompts_per_batch % world:
        raise UserError(f"rollout.prompts_per_batch = {r.prompts_per_batch} cannot be shared by {world} processes (each "
                        f"keeps whole groups); use a multiple of {world}.")
    if mb % world:
        raise UserError(f"A minibatch of {mb} sequences (prompts_per_batch x group_size / train.minibatches) cannot be "
                        f"cut into {world} equal slices; change train.minibatches or the batch so it is a multiple "
                        f"of {world}.")
    if t.micro_batch_size and (mb // world) % t.micro_batch_size:
        raise UserError(f"train.micro_batch_size = {t.micro_batch_size} must divide each process's slice of a minibatch "
                        f"({mb // world} sequences on {world} processes), or be 0.")


def _comm_device(device: torch.device | None = None) -> torch.device:
    """Where a collective's tensors must be: this process's GPU under NCCL, the CPU under gloo."""
    if torch.distributed.get_backend() != "nccl":
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
    world = torch.distributed.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    torch.distributed.all_gather_into_tensor(sizes, size)
    sizes = sizes.tolist()
    width = max(sizes)
    send = torch.zeros(width, dtype=torch.uint8)
    send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a pickle is never empty
    every = torch.empty(world * width, dtype=torch.uint8, device=dev)
    torch.distributed.all_gather_into_tensor(every, send.to(dev))
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
    parts = [torch.empty_like(local, device=dev) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local.to(dev).contiguous())
    return torch.cat(parts).to(local.device)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ranks (a new tensor on ``t``'s device)."""
    if not active():
        return t
    dev = _comm_device(t.device)
    out = t.detach().to(dev, copy=True)
    torch.distributed.all_reduce(out)
    return out.to(t.device)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: how ranks agree to stop together."""
    if not active():
        return flag
    t = torch.tensor([float(flag)], device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def slice_of(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``rows`` (its length a multiple of ``world``)."""
    n = len(rows) // world
    return rows[rank * n:(rank + 1) * n]


def balance(rows: torch.Tensor, tokens: torch.Tensor, world: int) -> torch.Tensor:
    """``rows`` reordered so that their ``world`` contiguous slices of equal size hold near-equal token counts: the
    longest row first, each to the slice with the fewest tokens that still has room (longest-processing-time first
    with a cap). A step waits for its slowest process, and a random slice of a batch with a few long responses can
    hold several times another's tokens. Every process computes the same order from the same gathered batch."""
    cap = len(rows) // world
    assert cap and len(rows) % world == 0, "check_layout admits only minibatches that split evenly"
    slices: list[list[int]] = [[] for _ in range(world)]
    count = tokens.tolist()  # Python ints: indexing a tensor element by element costs microseconds each
    open_slices = [(0, i) for i in range(world)]  # a heap of (load, slice) over the slices with room left
    for r in sorted(rows.tolist(), key=lambda r: (-count[r], r)):
        load, s = heapq.heappop(open_slices)  # the fewest tokens, then the lowest index
        slices[s].append(r)
        if len(slices[s]) < cap:
            heapq.heappush(open_slices, (load + count[r], s))
    return torch.tensor([r for s in slices for r in s], dtype=rows.dtype)


def micro_batches(rows: torch.Tensor, rank: int, world: int, micro: int) -> list[torch.Tensor]:
    """Process ``rank``'s slice of a minibatch's ``rows``, in chunks of ``micro`` rows."""
    own = slice_of(rows, rank, world)
    return [own[j:j + micro] for j in range(0, len(own), micro)]


def largest_micro_batches(minibatches: list[torch.Tensor], tokens: torch.Tensor, world: int,
                          micro: int) -> list[list[int]]:
    """``[k][j]``: the most tokens (``tokens[row]`` summed) that any process's ``j``-th micro-batch of minibatch ``k``
    holds. The CUDA-graphed passes pad each micro-batch to this length's bucket, so that every process captures a
    graph shape in the same step as the others, which wait for it at their next collective anyway."""
    count = tokens.tolist()
    out = []
    for rows in minibatches:
        per_rank = [[sum(count[i] for i in chunk.tolist()) for chunk in micro_batches(rows, r, world, micro)]
                    for r in range(world)]
        out.append([max(column) for column in zip(*per_rank)])
    return out


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no model.layers to shard across processes; gspo shards decoder "
                        "models of the Llama / Qwen / Mixtral layout.")
    return list(layers)


def shard(model: torch.nn.Module, autocast: torch.dtype | None) -> None:
    """FSDP2 in place: one unit per decoder layer, and the root unit holding the embeddings, final norm and LM head
    (tied weights stay one parameter). Master weights stay fp32; with bf16 compute the layers gather bf16 weights and
    reduce fp32 gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=torch.float32) if autocast is not None else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    from gspo.logprobs import as_fsdp_forward

    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    as_fsdp_forward(model)


# Training state a parameter costs: fp32 weight, gradient and two AdamW moments (16 bytes) and the rollout engine's
# bf16 copy (2); a reference model (KL) adds its fp32 copy (4).
STATE_BYTES, REF_BYTES = 18, 4


def choose_strategy(setting: str, model: torch.nn.Module, device: torch.device, *, reference: bool,
                    lora: bool = False) -> str:
    """``fsdp`` or ``ddp`` for ``dist.strategy = setting``: ``auto`` replicates a model whose training state takes at
    most half of one device's memory (the rest is for activations, the KV cache and CUDA graphs), and shards a
    larger one. LoRA always replicates (``check_layout`` refuses it with ``fsdp``): its frozen base has no gradients
    or optimizer state to shard."""
    if lora:
        return "ddp"
    if setting != "auto":
        return setting
    params = sum(p.numel() for p in model.parameters())
    need = params * (STATE_BYTES + (REF_BYTES if reference else 0))
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:  # the host's memory, shared by the processes on it
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "ddp" if need <= have // 2 else "fsdp"


def replicate(params: Iterable[torch.nn.Parameter]) -> None:
    """DDP's starting point: every process holds rank 0's values of ``params`` (they load the same files, but a model
    initialised at random -- LoRA's adapters are --, or a file read differently, must not split the processes' copies
    silently)."""
    with torch.no_grad():
        for p in params:
            torch.distributed.broadcast(p.data, src=0)


def flat_gradients(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Give every parameter a zero ``.grad`` that is a view into one flat buffer per dtype and device, and return the
    buffers: :func:`sum_gradients` all-reduces them in place, with no copy into a bucket and back (torch's DDP does the
    same with ``gradient_as_bucket_view``). The views must stay the parameters' gradients: backward passes accumulate
    into them in place, and the optimizer's ``zero_grad`` must not set them to None (zero the buffers instead)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    buffers = []
    for (dtype, device), group in by_kind.items():
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
        offset = 0
        for p in group:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        buffers.append(flat)
    return buffers


def sum_gradients(buffers: list[torch.Tensor]) -> list:
    """Start summing the gradients over the processes in place: one asynchronous all-reduce per flat buffer of
    :func:`flat_gradients` (a parameter no process reached has zeros). Returns the pending works: ``wait()`` each
    before the gradients are read (on a GPU that orders the reading stream after the all-reduce; the host does not
    block). Started as soon as the step's backward is queued, the sum runs while the step's diagnostics are computed.

    Written here rather than with torch's DistributedDataParallel: DDP's reducer is armed by the wrapped module's
    forward, which gspo's log-prob pass does not call (it runs the decoder and a chunked LM head directly, also inside
    captured CUDA graphs), and one all-reduce after the whole backward is all a full-batch optimizer step needs."""
    return [torch.distributed.all_reduce(flat, async_op=True) for flat in buffers]


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter, tied ones under each of their names, gathered one at a time (a
    collective: every rank iterates all of them in the same order). The weight seam of a sharded policy."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters(remove_duplicate=False):
        p = param.detach()
        yield name, p.full_tensor() if isinstance(p, DTensor) else p


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a plain tensor is returned as it is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
