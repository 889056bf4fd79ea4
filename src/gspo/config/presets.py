"""Algorithm presets: what ``algorithm = "gspo"`` (or ``grpo``, ``dapo``...) sets in every field left at ``None``, the
clip range each ratio level takes, and the step-credit function each long task names for ``loss.step_credit = "task"``.
"""
from __future__ import annotations

from typing import Any

from gspo.config.schema import Config, unknown_key

PRESETS: dict[str, dict[str, Any]] = {
    # GSPO paper: sequence ratio, tiny clip range (3e-4, 4e-4), no KL, per-sequence length normalisation.
    "gspo": {"loss.level": "sequence", "loss.eps_low": 3e-4, "loss.eps_high": 4e-4,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    "gspo_token": {"loss.level": "sequence_token", "loss.eps_low": 3e-4, "loss.eps_high": 4e-4,
                   "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    # GRPO as the GSPO paper ran it for its comparison: token ratio, clip range (0.2, 0.27) (the seed's "Clipping range
    # (left, right) 0.2, 0.27"), per-sequence length normalisation; so `gspo compare` is the paper's comparison.
    "grpo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.27,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    # DAPO (Yu et al. 2025), all four of its techniques on together: clip-higher (0.2, 0.28), token-level loss
    # (token-mean), dynamic sampling, and both halves of its overlong treatment -- filtering truncated completions out
    # of the loss (loss.mask_truncated) and the soft punishment (dapo.overlong_penalty). Each is switchable on its own.
    "dapo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.28, "loss.aggregation": "token-mean",
             "loss.advantage_scale": "group", "loss.mask_truncated": True, "dapo.dynamic_sampling": True,
             "dapo.overlong_penalty": True},
    # Dr. GRPO: no std normalisation, no per-sequence length normalisation.
    "dr_grpo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.2,
                "loss.aggregation": "seq-mean-token-sum-norm", "loss.advantage_scale": "none"},
    # RLOO (Ahmadian et al. 2024) as verl runs it: the leave-one-out baseline, no scaling, PPO's token ratio clipped at
    # 0.2 both ways, the token-mean loss (verl's default aggregation).
    "rloo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.aggregation": "token-mean",
             "loss.advantage_scale": "none", "loss.advantage_baseline": "leave_one_out"},
    # REINFORCE++ (Hu 2025) with an outcome reward: no baseline, each token's return (its completion's reward, gamma =
    # 1) whitened over every loss token of the batch; PPO's token clip at 0.2, token-mean. Its KL-in-reward is gspo's
    # loss.beta (a k3 term in the loss) instead; loss.advantage_baseline = "group_mean" is REINFORCE++-baseline.
    "reinforce_pp": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.aggregation": "token-mean",
                     "loss.advantage_scale": "tokens", "loss.advantage_baseline": "none"},
    # CISPO (MiniMax-M1, Chen et al. 2025): the token ratio truncated to [0, 5] and held constant (ScaleRL's bounds,
    # arXiv:2510.13786; MiniMax sets no lower bound and tunes only the upper), every token keeping its gradient;
    # group advantages, the token-mean loss (the paper's 1 / sum |o_i|).
    "cispo": {"loss.level": "token", "loss.objective": "cispo", "loss.eps_low": 1.0, "loss.eps_high": 4.0,
              "loss.aggregation": "token-mean", "loss.advantage_scale": "group"},
    # GMPO (Zhao et al. 2025): the geometric mean of the token ratios, each clipped to [e^-0.4, e^0.4] (the paper's
    # epsilon = 0.4, in log space), one term per sequence.
    "gmpo": {"loss.level": "sequence", "loss.objective": "gmpo", "loss.eps_low": 0.4, "loss.eps_high": 0.4,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    # SAPO (Gao et al. 2025, Qwen): the token ratio through a sigmoid gate with temperatures 1.0 (A > 0) and 1.05
    # (A < 0) instead of a clip; per-sequence length normalisation as GRPO.
    "sapo": {"loss.level": "token", "loss.objective": "sapo", "loss.eps_low": 0.2, "loss.eps_high": 0.2,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group", "loss.sapo_tau": [1.0, 1.05]},
    # PPO with a value model, as verl runs it for LLMs: GAE over the response tokens (ppo.gamma = ppo.lam = 1), the
    # advantages whitened over the batch's loss tokens, the token ratio clipped at 0.2 both ways, token-mean.
    "ppo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.aggregation": "token-mean",
            "loss.advantage_scale": "tokens", "loss.advantage_baseline": "critic"},
}


# Switches only some presets turn on: off wherever the algorithm's preset leaves them unset.
_PRESET_FALLBACK = {"loss.mask_truncated": False, "dapo.dynamic_sampling": False, "dapo.overlong_penalty": False,
                    "loss.advantage_baseline": "group_mean", "loss.objective": "clip"}

TASK_STEP_CREDIT = {"running_sum": "gspo.rewards.builtin:running_sum_step_spans",  # loss.step_credit = "task"
                    "numbered_words": "gspo.rewards.builtin:numbered_words_line_spans"}


# Clip ranges belong to the ratio's level, not the algorithm: a sequence ratio lives within ~1e-3 of 1, where a
# token-level 0.2 clips nothing (TRL #3834), and a token ratio under 3e-4 would be clipped almost everywhere.
LEVEL_EPS = {"token": (0.2, 0.27), "sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4)}


def apply_preset(cfg: Config) -> None:
    """Fill every ``None`` field from the algorithm's preset; clip ranges follow an explicitly chosen level."""
    if cfg.algorithm not in PRESETS:
        raise unknown_key(cfg.algorithm, list(PRESETS), "algorithm value ")
    lc = cfg.loss
    if lc.level is not None and lc.level != PRESETS[cfg.algorithm]["loss.level"] and lc.level in LEVEL_EPS:
        low, high = LEVEL_EPS[lc.level]
        lc.eps_low = low if lc.eps_low is None else lc.eps_low
        lc.eps_high = high if lc.eps_high is None else lc.eps_high
    for dotted, value in {**_PRESET_FALLBACK, **PRESETS[cfg.algorithm]}.items():
        section, name = dotted.split(".")
        obj = getattr(cfg, section)
        if getattr(obj, name) is None:
            setattr(obj, name, value)
