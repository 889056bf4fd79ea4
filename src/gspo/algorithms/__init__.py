"""Pure tensor math of the objectives: no model, no I/O, no globals."""
from gspo.algorithms.advantages import (
    estimate_advantages, group_advantages, group_stats, overlong_penalty, whiten_tokens, zero_variance_groups,
)
from gspo.algorithms.losses import (
    aggregate, cispo_surrogate, clipped_surrogate, gmpo_surrogate, importance_ratio, k3_kl, logprob_gap, policy_loss,
    ratio_metrics, sapo_surrogate, sequence_log_ratio, token_log_ratio,
)

__all__ = [
    "aggregate", "cispo_surrogate", "clipped_surrogate", "estimate_advantages", "gmpo_surrogate", "group_advantages", "group_stats", "importance_ratio", "k3_kl", "logprob_gap",
    "overlong_penalty", "policy_loss", "ratio_metrics", "sapo_surrogate", "sequence_log_ratio", "token_log_ratio", "whiten_tokens", "zero_variance_groups",
]
