"""Behaviour-policy corrections: the update's ratio is taken against pi_prox, the policy recomputed by the trainer
before the update (``train.old_logprobs = "recompute"``), but the tokens were sampled by pi_behave: the engine, whose
numbers differ from the trainer's (vLLM, int8-rounded weights, batch-variant kernels) or, asynchronously, an older
policy version. The decoupled objective (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL)
weights each term by how much more likely pi_prox made the sample than pi_behave did:

    J(theta) = E_{y ~ pi_behave}[ w(y) * min(r A, clip(r) A) ],   r = pi_theta / pi_prox,   w = pi_prox / pi_behave

and each correction below is a way to keep ``w`` from exploding where the two disagree. Shape legend as in
:mod:`gspo.algorithms.losses`; ``prox_logp`` and ``behave_logp`` are (B, T) log-probs of the sampled tokens, ``mask``
(B, T) the loss mask. The weights are constants (no gradient flows through them), and the token log-weights are clamped
as the ratios' are (``LOG_RATIO_CLAMP``), in float64.

- ``tis`` (truncated importance sampling; Yao et al. 2025, verl's ``token_is``/``seq_is``): w truncated above at
  ``high``. At the ratio's level: per token for GRPO (``token``), and for GSPO per sequence, where w_i is the geometric
  mean of the token weights, as GSPO's own ratio s_i is (one weight a sequence, the same length normalisation).
- ``sequence_mask`` (SkyRL's geometric mask, verl's ``seq_mask`` in geometric mode): a sequence whose geometric-mean
  weight leaves [low, high] is left out of the loss; the others keep weight 1.
- ``icepop`` (Ring-1T's IcePop): a token whose weight leaves [low, high] is left out of the loss; the others keep their
  weight w_t. Per token at every level: under GSPO a token left out also leaves the sequence ratio's mean (s_i over
  the kept tokens), and the kept tokens' weights average arithmetically, not geometrically as TIS's do.

Deliberate differences from the peers that define these (verl ``rollout_corr_helper.py``, SkyRL
``off_policy_correction_utils.py``, slime, AReaL, OpenRLHF):
- A left-out token or sequence leaves the loss mask, so it leaves every denominator too, as in verl's token-mean.
  SkyRL, AReaL and slime today keep it in the count with a zero weight, which shrinks every kept token's gradient by
  the share left out (slime#657 fixed that once; a later change brought it back).
- Sequence-level TIS weighs a sequence by the geometric mean of its token weights, at GSPO's level; verl's and
  SkyRL's ``sequence`` TIS use the product, which for a 500-token response is the 500th power of the same number.

Cost: with a correction on, minibatch 0's old log-probs come from the frozen pass like the other minibatches' (one
more forward of 1/M of the batch), since the masks must be known before the first update's denominators.
"""
from __future__ import annotations

import torch

from gspo.algorithms.losses import masked_mean, token_log_ratio

Tensor = torch.Tensor

CORRECTIONS = ("off", "tis", "sequence_mask", "icepop")
# [low, high] of each correction when loss.mismatch_bounds is unset (tis uses only high)
DEFAULT_BOUNDS = {"tis": (0.0, 2.0), "sequence_mask": (0.99, 1.01), "icepop": (0.5, 5.0)}


def mismatch_weights(prox_logp: Tensor, behave_logp: Tensor, mask: Tensor, kind: str, level: str, low: float,
                     high: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The correction ``kind`` at ratio ``level``: ``(weights (B, T), kept mask (B, T), metrics)``.

    weights are 1 where nothing is corrected and 0 off the kept mask; metrics (0-dim, detached):
    ``mismatch/weight_mean`` and ``mismatch/weight_max`` of the kept tokens' weights, ``mismatch/truncated`` (tokens or,
    at sequence level, sequences whose weight ``tis`` truncated), ``mismatch/masked_tokens`` and
    ``mismatch/masked_seqs`` (shares of the tokens and sequences the correction left out)."""
    mask = mask.bool()
    with torch.no_grad():
        log_w = token_log_ratio(prox_logp.double(), behave_logp.double(), mask)  # (B, T), 0 off the mask
        seq_log_w = masked_mean(log_w, mask, dim=-1)  # (B,) log of the geometric mean
        one = torch.ones_like(log_w)
        has = mask.any(-1)  # (B,)
        truncated = None
        if kind == "off":
            weights, kept = one, mask
        elif kind == "tis":
            if level == "token":
                w = torch.exp(log_w)
                truncated = (w > high) & mask
            else:
                w = torch.exp(seq_log_w)[:, None].expand_as(log_w)
                truncated = ((torch.exp(seq_log_w) > high) & has)[:, None] & mask
            weights, kept = w.clamp(max=high), mask
        elif kind == "sequence_mask":
            g = torch.exp(seq_log_w)  # (B,)
            kept = mask & ((g >= low) & (g <= high))[:, None]
            weights = one
        elif kind == "icepop":
            w = torch.exp(log_w)
            kept = mask & (w >= low) & (w <= high)
            weights = w
        else:
            raise ValueError(f"unknown mismatch correction {kind!r}; one of {CORRECTIONS}")
        weights = torch.where(kept, weights, torch.zeros_like(weights))
        tokens = mask.sum().clamp(min=1)
        seqs = has.sum().clamp(min=1)
        kept_w = weights[kept]
        metrics = {
            "mismatch/weight_mean": kept_w.mean() if kept_w.numel() else torch.zeros((), dtype=weights.dtype),
            "mismatch/weight_max": kept_w.max() if kept_w.numel() else torch.zeros((), dtype=weights.dtype),
            "mismatch/masked_tokens": (mask & ~kept).sum() / tokens,
            "mismatch/masked_seqs": (has & ~kept.any(-1)).sum() / seqs,
        }
        if truncated is not None:
            per = truncated.sum() / tokens if level == "token" else (truncated.any(-1) & has).sum() / seqs
            metrics["mismatch/truncated"] = per
    return weights.to(prox_logp.dtype), kept, {k: v.float() for k, v in metrics.items()}

