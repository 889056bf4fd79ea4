"""Pure tensor math of the objectives: no model, no I/O, no globals."""
from gspo.algorithms.advantages import group_advantages, group_stats, overlong_penalty, zero_variance_groups
from gspo.algorithms.losses import aggregate, clipped_surrogate, importance_ratio, k3_kl, policy_loss, ratio_metrics

__all__ = [
    "aggregate", "clipped_surrogate", "group_advantages", "group_stats", "importance_ratio", "k3_kl",
    "overlong_penalty", "policy_loss", "ratio_metrics", "zero_variance_groups",
]
