"""Cheap per-step diagnostics behind the GSPO-vs-GRPO figures: binned ratio histograms and per-token traces.

Both are pure functions of one minibatch's log-probs; the trainer writes them to ``histograms.jsonl`` and
``traces.jsonl`` beside ``metrics.jsonl``.

Shapes: ``B`` sequences, ``T`` completion positions.

Log-ratios, whatever level is trained:
    token:     log r_{i,t} = log pi(y_t | x, y_<t) - log pi_old(y_t | x, y_<t)
    sequence:  log s_i = (1 / |y_i|) sum_t log r_{i,t}                 (GSPO's length-normalised sequence ratio)
"""
from __future__ import annotations

import math

import torch

from gspo.algorithms.losses import sequence_log_ratio, token_log_ratio

# Fixed bin edges on the log-ratio, symmetric around 0 and log-spaced in |log r| from 1e-5 to 3: the GSPO clip band
# (|log r| < ~4e-4) and GRPO's (|log r| < ~0.2) each span a few bins. Bins are [e_k, e_{k+1}); the outer ones are open.
_MAGNITUDES = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0]
LOG_RATIO_EDGES: list[float] = [-m for m in reversed(_MAGNITUDES)] + _MAGNITUDES  # 24 edges -> 25 bins


def bin_counts(values: torch.Tensor, edges: list[float] = LOG_RATIO_EDGES) -> list[int]:
    """Counts of ``values`` in ``len(edges) + 1`` bins: (-inf, e_0), [e_0, e_1), ..., [e_last, inf)."""
    boundaries = torch.tensor(edges, dtype=torch.float64, device=values.device)
    idx = torch.bucketize(values.double(), boundaries, right=True)  # (n,) in 0..len(edges)
    return torch.bincount(idx, minlength=len(edges) + 1).tolist()


@torch.no_grad()
def ratio_histograms(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, list[int]]:
    """Counts of token log-ratios (one per completion token) and sequence log-ratios (one per sequence with at least
    one token) in the bins of ``LOG_RATIO_EDGES``; non-finite ones (a skipped non-finite step) are counted apart."""
    mask = mask.bool()
    full = token_log_ratio(logp.float(), old_logp.float(), mask)  # (B, T)
    token_lr = full[mask]  # (M,)
    seq_lr = sequence_log_ratio(full, mask)[mask.any(-1)]  # (B',)
    tok_ok, seq_ok = torch.isfinite(token_lr), torch.isfinite(seq_lr)
    return {"token": bin_counts(token_lr[tok_ok]), "seq": bin_counts(seq_lr[seq_ok]),
            "token_nonfinite": int((~tok_ok).sum()), "seq_nonfinite": int((~seq_ok).sum())}


@torch.no_grad()
def token_trace(tokenizer, completion_ids: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                mask: torch.Tensor, advantage: float) -> dict:
    """One response token by token: its text pieces, token log-ratios, and the sequence log-ratio (their mean).

    ``completion_ids``, ``logp``, ``old_logp``, ``mask``: (T,) for one row.
    """
    mask = mask.bool()
    ids = completion_ids[mask].tolist()
    lr = token_log_ratio(logp.float(), old_logp.float(), mask)[mask]  # (n,)
    return {"tokens": [tokenizer.decode([t]) for t in ids], "token_log_ratio": lr.tolist(),
            "seq_log_ratio": float(lr.mean()) if lr.numel() else 0.0, "advantage": float(advantage)}


def pick_trace_rows(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, k: int) -> list[int]:
    """Rows worth tracing: the one with the most extreme token log-ratio first, then evenly spread others."""
    mask = mask.bool()
    valid = mask.any(-1).nonzero().squeeze(-1).tolist()
    if not valid or k <= 0:
        return []
    lr = token_log_ratio(logp.float(), old_logp.float(), mask).abs()  # (B, T), 0 on padding
    extreme = int(lr.amax(-1).argmax())
    rest = [r for r in valid if r != extreme]
    step = max(1, math.ceil(len(rest) / max(k - 1, 1)))
    return ([extreme] + rest[::step])[:k]
