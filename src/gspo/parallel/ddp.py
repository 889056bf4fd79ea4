"""DDP, written for gspo's passes: every process holds the whole policy, starts from rank 0's values, and the
gradients (views of flat buffers) are summed with one asynchronous all-reduce per buffer before each optimizer step.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from gspo.parallel import comm


def replicate(params: Iterable[torch.nn.Parameter]) -> None:
    """DDP's starting point: every process holds rank 0's values of ``params`` (they load the same files, but a model
    initialised at random -- LoRA's adapters are --, or a file read differently, must not split the processes' copies
    silently)."""
    with torch.no_grad():
        for p in params:
            torch.distributed.broadcast(p.data, group=comm.group(), group_src=0)


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
    return [torch.distributed.all_reduce(flat, async_op=True, group=comm.group()) for flat in buffers]
