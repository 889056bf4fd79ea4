"""Which rows process ``r`` trains: the rollout batch's seeded shuffle cut into minibatches, each process's contiguous
slice of every minibatch (balanced by tokens under torchrun), and its micro-batches. One home for the cutting.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


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


@dataclass
class Plan:
    """How one rollout batch is cut for the update: ``minibatches[k]`` are the rows of optimizer step ``k``,
    ``micro[k]`` the same rows in forward/backward chunks of ``train.micro_batch_size``."""

    minibatches: list[torch.Tensor]  # k -> (mb,) int64 rows
    micro: list[list[torch.Tensor]]  # k -> chunks of this process's rows of minibatches[k]
    world: int = 1  # processes of the job; rank r trains the r-th contiguous slice of every minibatch
    rank: int = 0
    # Under torchrun: k -> for each micro-batch, the largest packed length (prompt + completion tokens) that any
    # process has at it; the CUDA-graphed passes pad to its bucket, so that the processes share graph shapes
    pack_tokens: list[list[int]] | None = None

    def pack_hint(self, k: int, j: int) -> int:
        """The packed length micro-batch ``j`` of minibatch ``k`` pads to at least (0: its own)."""
        return self.pack_tokens[k][j] if self.pack_tokens is not None else 0

    def micro_of(self, ks) -> tuple[list[torch.Tensor], list[int]]:
        """This process's micro-batches of minibatches ``ks``, in order, and the packed length each pads to at least."""
        pairs = [(rows, self.pack_hint(k, j)) for k in ks for j, rows in enumerate(self.micro[k])]
        return [rows for rows, _ in pairs], [hint for _, hint in pairs]

    def rows_of(self, rank: int, ks) -> torch.Tensor:
        """The rows rank ``rank`` trains in minibatches ``ks``."""
        return torch.cat([slice_of(self.minibatches[k], rank, self.world) for k in ks])


def make_plan(n_rows: int, minibatches: int, micro_batch_size: int, shuffle: torch.Generator, *, rank: int = 0,
              world: int = 1, tokens: torch.Tensor | None = None) -> Plan:
    """A seeded shuffle of ``n_rows`` rows cut into ``minibatches`` minibatches of micro-batches of
    ``micro_batch_size`` rows (0: a process's whole slice). Under torchrun, with each row's ``tokens`` (prompt +
    completion), every minibatch's rows are ordered so that the processes' slices hold near-equal token counts
    (:func:`balance`)."""
    order = torch.randperm(n_rows, generator=shuffle)
    mb = n_rows // minibatches
    cuts = [order[k * mb:(k + 1) * mb] for k in range(minibatches)]
    if world > 1 and tokens is not None:
        cuts = [balance(rows, tokens, world) for rows in cuts]
    micro = micro_batch_size or mb // world
    pack = largest_micro_batches(cuts, tokens, world, micro) if world > 1 and tokens is not None else None
    return Plan(cuts, [micro_batches(rows, rank, world, micro) for rows in cuts], world, rank, pack)
