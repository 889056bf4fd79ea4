"""The trainer's side of ``rollout.exact``: log-probs computed by the very forward the graph engine samples with.

The engine's decode step, its prefill and this pass are one function (:meth:`gspo.rollout.fused.FusedDecoder.
exact_forward`) whose kernels are batch-invariant (:mod:`gspo.rollout.exact_kernels`): for the same weights and tokens
the trainer's log-prob of a token is the engine's, bit for bit, whatever the batch, the lengths or the row compaction.
So ``train.old_logprobs = "rollout"`` is exact (no recompute pass), and the first update's ratio is exactly 1.

The pass keeps its own low-precision copy of the policy's weights (:class:`gspo.rollout.graph.EngineWeights`, the
engine's class: the same rounding of fp32 masters to bf16), refreshed from the policy before each call.

Gradients: the update needs d log pi / d theta. The exact kernels have no backward; the update's log-probs are the
exact values with the gradient of the ordinary (packed, CUDA-graphed) pass at the same weights (:func:`with_gradient_of`):
the two functions differ by rounding only, so this is the gradient any bf16 trainer computes.

Shapes: ``N`` rows, ``T`` completion positions, ``S`` packed tokens, ``M`` completion tokens.
"""
from __future__ import annotations

import torch

from gspo.models import head_dim, kv_heads, named_weights
from gspo.runtime import to_device


class _ExactValue(torch.autograd.Function):
    """Forward: the exact values; backward: the gradient goes to the differentiable tensor, unchanged."""

    @staticmethod
    def forward(ctx, exact: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


def with_gradient_of(exact: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
    """``exact``'s values (bit for bit) with ``differentiable``'s gradient (same shape)."""
    return _ExactValue.apply(exact.detach(), differentiable)


class ExactPass:
    """Log-probs of completions by ``rollout.exact``'s forward over one packed row, on a copy of ``model``'s weights in
    ``dtype`` (the engine's: the autocast dtype, else the weights')."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, chunk_size: int = 1024):
        from gspo.rollout.fused import FusedDecoder
        from gspo.rollout.graph import EngineWeights

        self.source = model
        self.weights = EngineWeights(model, dtype, device)
        self.decoder = FusedDecoder(self.weights.model, dtype, device, exact=True)
        self.weights.give_storage(self.decoder.copies())
        self.weights.index()
        self.device = device
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.groups = kv_heads(model.config)
        self.width = head_dim(model.config)

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                 temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``(N, T)`` float32 under softmax(logits / temperature) of the current weights (0 where the mask
        is False), and the entropies ``(N, T)`` with ``with_entropy``. Completion tokens must be a prefix of each row."""
        from gspo.rollout import exact_kernels as ek

        self.weights.load(named_weights(self.source))
        dev = self.device
        mask = completion_mask.cpu().bool()
        ids_cpu = completion_ids.cpu()
        lengths = mask.sum(-1).tolist()
        seq_lens = [len(p) + n for p, n in zip(prompt_ids, lengths)]
        ids = torch.tensor([t for p, c, n in zip(prompt_ids, ids_cpu.tolist(), lengths) for t in (*p, *c[:n])],
                           dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in seq_lens])
        starts = torch.tensor([0, *seq_lens]).cumsum(0)[:-1]  # (N,) each sequence's first packed token
        first = starts + torch.tensor([len(p) for p in prompt_ids]) - 1  # the position that predicts token 0
        at = (first[:, None] + torch.arange(mask.shape[1])[None, :])[mask]  # (M,) row-major
        S = len(ids)
        k = torch.empty(S, self.groups, self.width, dtype=self.dtype, device=dev)  # every layer's K/V, in turn
        v = torch.empty_like(k)
        layers = len(self.decoder.layers)
        tiles = ek.packed_tiles(seq_lens, starts.tolist(), self.decoder.heads // self.decoder.kv_heads, dev)
        hidden = self.decoder.exact_forward(to_device(ids, dev), to_device(pos, dev), [k] * layers, [v] * layers,
                                            torch.arange(S, device=dev), tiles, at=to_device(at, dev))  # (M, H)
        targets = to_device(ids_cpu[mask], dev)  # (M,)
        logp, entropy = [], []
        for i in range(0, len(at), self.chunk_size):
            logits = self.decoder.exact_logits(hidden[i:i + self.chunk_size])  # (C, V) float32
            logp.append(ek.token_logprobs(logits, targets[i:i + self.chunk_size], temperature))
            if with_entropy:
                lp = torch.log_softmax(logits / temperature, -1)
                entropy.append(-(lp.exp() * lp).sum(-1))
        flat = to_device(mask.reshape(-1).nonzero().squeeze(-1), dev)
        out = torch.zeros(mask.numel(), dtype=torch.float32, device=dev)
        logp_full = out.index_copy(0, flat, torch.cat(logp)).view(mask.shape) if logp else out.view(mask.shape)
        ent_full = None
        if with_entropy:
            ent_full = (out.index_copy(0, flat, torch.cat(entropy)) if entropy else out.clone()).view(mask.shape)
        return logp_full, ent_full
