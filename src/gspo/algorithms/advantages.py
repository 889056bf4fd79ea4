"""Advantages (group-relative, with step credit, from a critic's GAE; whitened or not: :func:`estimate_advantages`
chooses as the config does), DAPO's reward shaping and its dynamic-sampling filter: pure tensor functions.

Shape legend: ``N`` completions = ``P`` prompts x ``G`` completions per prompt, rows of one group contiguous
(row ``i`` belongs to group ``i // G``).

GRPO (Shao et al. 2024):    A_i = (r_i - mean_g r) / (std_g r + eps)
Dr. GRPO (Liu et al. 2025): A_i = r_i - mean_g r                      (no std: ``scale="none"``)
"batch" scale (Lite PPO, Liu et al. 2025; TRL's ``scale_rewards="batch"``):
                            A_i = (r_i - mean_g r) / (std_batch r + eps)   (group mean, std of the batch's raw rewards)
RLOO (Ahmadian et al. 2024, leave-one-out baseline):
                            A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_g r)
REINFORCE++ (Hu 2025), outcome reward, gamma = 1: every token of completion i has the return b_i (r_i, or r_i - mean_g r
for REINFORCE++-baseline), whitened over every loss token of the batch (:func:`whiten_tokens`):
                            A_{i,t} = (b_i - mu) / (sigma + eps),   mu, sigma over {b_i repeated |y_i| times}

Group statistics are computed in float64: in float32 a group whose rewards are all equal but not dyadic (eight 0.7s)
gets a mean that differs from 0.7 in the last bit, a "spread" of ~1e-8 and a uniform non-zero advantage, and the
dynamic-sampling filter keeps it. A group whose std is at most ``ZERO_STD`` has zero variance: advantage 0.

Differences from the papers, on purpose: rewards that are NaN (the reward function raised or timed out) are left
out of the group's mean and std and get advantage 0, rather than being scored 0, which would bias the baseline;
a group with fewer than two valid rewards or zero variance gets advantage 0, never NaN (TRL #3857).
"""
from __future__ import annotations

import torch

from gspo.algorithms.ppo import gae, outcome_token_rewards
from gspo.errors import UserError

Tensor = torch.Tensor

SCALES = ("group", "batch", "tokens", "none")
BASELINES = ("group_mean", "leave_one_out", "none", "critic")  # critic: PPO's GAE (:func:`estimate_advantages`)
ZERO_STD = 1e-8
"""A group std at or below this is zero variance: float64 rounding of equal rewards stays far below it."""


def _grouped(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise UserError(
            f"{rewards.numel()} rewards cannot be split into groups of {group_size}; "
            "the number of completions must be a multiple of the group size."
        )
    r = rewards.double().view(-1, group_size)  # (P, G) float64
    valid = torch.isfinite(r)  # (P, G)
    return r, valid


def group_stats(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, unbiased std (float64) and count of the valid (finite) rewards.  Each (P,)."""
    r, valid = _grouped(rewards, group_size)
    n = valid.sum(-1)  # (P,)
    r0 = torch.where(valid, r, torch.zeros_like(r))  # (P, G)
    mean = r0.sum(-1) / n.clamp(min=1)  # (P,)
    dev = torch.where(valid, r - mean[:, None], torch.zeros_like(r))  # (P, G)
    std = (dev.pow(2).sum(-1) / (n - 1).clamp(min=1)).sqrt()  # (P,)
    return mean, std, n


def _safe_div(centred: Tensor, std: Tensor, eps: float) -> Tensor:
    # A zero spread means every centred reward is 0: the advantage is 0, not 0/0.
    return torch.where(std > ZERO_STD, centred / (std + eps), torch.zeros_like(centred))


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", baseline: str = "group_mean",
                     eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per completion.  (N,)

    Args:
        rewards: (N,) rewards; NaN marks a completion whose reward failed (it gets advantage 0 and is left out of
            its group's baseline).
        group_size: G, completions per prompt; rows of one group are contiguous.
        scale: ``group`` divides by the group's std (GRPO, GSPO), ``batch`` by the (unbiased) std of the valid raw
            rewards of the whole batch (Lite PPO; TRL's ``scale_rewards="batch"``), ``none`` only subtracts the group
            mean (Dr. GRPO); ``tokens`` leaves the centred rewards as they are here, for :func:`whiten_tokens` once
            the loss tokens are known (REINFORCE++).
        baseline: ``group_mean`` subtracts the group's mean, ``leave_one_out`` the mean of the group's other rewards
            (RLOO), ``none`` nothing (REINFORCE++ without a baseline: then a group whose rewards are all equal still
            carries its reward).

    Returns float32 advantages (float64 when the rewards are float64).
    """
    if scale not in SCALES:
        raise UserError(f"Unknown advantage scale {scale!r}; use one of {', '.join(SCALES)}.")
    if baseline not in BASELINES or baseline == "critic":
        raise UserError(f"Unknown group advantage baseline {baseline!r}; use one of "
                        f"{', '.join(b for b in BASELINES if b != 'critic')} (a critic's: estimate_advantages).")
    r, valid = _grouped(rewards, group_size)
    mean, std, n = group_stats(rewards, group_size)
    centred = torch.where(valid, r - mean[:, None], torch.zeros_like(r))  # (P, G)
    usable = valid & (n[:, None] >= 2) & (std[:, None] > ZERO_STD)  # (P, G) rows of groups that carry a signal
    if baseline == "leave_one_out":  # r_i - (sum - r_i) / (n - 1) = n / (n - 1) (r_i - mean)
        centred = centred * (n.double() / (n - 1).clamp(min=1))[:, None]
    elif baseline == "none":
        centred = torch.where(valid, r, torch.zeros_like(r))
        usable = valid
    if scale == "group":
        adv = _safe_div(centred, std[:, None].expand_as(centred), eps)
    elif scale == "batch":
        pool = r[valid]
        batch_std = pool.std() if pool.numel() >= 2 else torch.zeros((), dtype=r.dtype)
        adv = _safe_div(centred, batch_std.expand_as(centred), eps)
    else:
        adv = centred
    out = torch.where(usable, adv, torch.zeros_like(adv)).view(-1)  # (N,)
    return out if rewards.dtype == torch.float64 else out.float()


def whiten_tokens(advantages: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """REINFORCE++'s global normalisation: each completion's advantage given to its loss tokens, centred and scaled by
    the mean and std over every loss token of the batch (a long completion counts once per token).  (N, T)

    ``advantages`` (N,) or (N, T); ``mask`` (N, T) True on the loss tokens. The std is the unbiased one (Bessel's
    correction over the tokens, as torch's ``var``); fewer than two tokens or a zero spread leave the advantages
    centred only. Computed in float64, returned in the advantages' dtype; 0 off the mask."""
    a = advantages.double()
    a = a[:, None].expand(mask.shape) if a.dim() == 1 else a  # (N, T)
    m = mask.bool()
    count = m.sum()
    if count == 0:
        return torch.zeros(mask.shape, dtype=advantages.dtype, device=advantages.device)
    mu = a[m].mean()
    sd = a[m].std() if count >= 2 else torch.zeros((), dtype=torch.float64)
    out = (a - mu) / (sd + eps) if sd > ZERO_STD else a - mu
    return torch.where(m, out, torch.zeros_like(out)).to(advantages.dtype)


def estimate_advantages(rewards: Tensor, mask: Tensor, *, baseline: str, scale: str, group_size: int,
                        steps: tuple[list[list[int]], list[list[float]]] | None = None, step_weight: float = 1.0,
                        values: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0
                        ) -> tuple[Tensor, Tensor | None]:
    """A rollout batch's advantages as ``loss.advantage_baseline`` (``baseline``), ``loss.advantage_scale``
    (``scale``) and ``loss.step_credit`` (``steps``, weighted by ``step_weight``) choose them, and with a critic the
    value targets: every advantage estimator of the package, in one call.  ``(A, R)``

    The GRPO family (``baseline`` group_mean, leave_one_out or none), from the rewards r (N,), NaN where one failed:

        A_i     = (r_i - b_g) / s                                     :func:`group_advantages` (b, s as chosen)
        A_{i,t} = A_i + w sum_{k : end_{i,k} > t} r~_{i,k}             with ``steps``: :func:`step_advantages`

    PPO (``baseline = "critic"``), from the rewards r (N,), each paid at its row's last step, or token rewards
    (N, T) (:func:`gspo.algorithms.ppo.process_token_rewards`: the steps' credit already in), and the critic's values
    V (N, T) before the update (``values``):

        A_t, R_t = gae(r, V, gamma, lam)                               :func:`gspo.algorithms.ppo.gae`

    then with ``scale = "tokens"`` (REINFORCE++, PPO) every advantage whitened over the loss tokens of the rows that
    have a reward (``mask`` (N, T), the loss tokens):

        A_{i,t} = (A_{i,t} - mu) / sigma                               :func:`whiten_tokens`

    Returns A, (N,) or (N, T) (the GRPO family in the rewards' dtype; PPO's in float64), and R (N, T) float64 with a
    critic, else None."""
    if baseline == "critic":
        if values is None:
            raise ValueError("baseline = 'critic' needs the critic's values")
        token_rewards = outcome_token_rewards(rewards, mask) if rewards.dim() == 1 else rewards  # (N, T)
        adv, returns = gae(token_rewards, values, mask, gamma, lam)  # (N, T) float64
    else:
        adv, returns = group_advantages(rewards, group_size, scale=scale, baseline=baseline), None  # (N,)
        if steps is not None:  # (N, T): the outcome advantage plus each token's process credit
            adv = step_advantages(adv, *steps, group_size, mask.shape[1], weight=step_weight, scale=scale)
    if scale == "tokens":
        rated = torch.isfinite(rewards if rewards.dim() == 2 else rewards[:, None])  # (N, T) or (N, 1)
        adv = whiten_tokens(adv, mask & rated)  # (N, T)
    return adv, returns


def zero_variance_groups(rewards: Tensor, group_size: int, *, tol: float = ZERO_STD) -> Tensor:
    """True for each group whose valid rewards are all equal (or that has < 2 valid): it carries no signal.  (P,)"""
    _, std, n = group_stats(rewards, group_size)
    return (std <= tol) | (n < 2)


def overlong_penalty(lengths: Tensor, max_length: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward.  (N,)

    R(y) = 0                                  if |y| <= L_max - L_cache
         = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
         = -1                                 if |y| > L_max
    """
    if not 0 < cache <= max_length:
        raise UserError(f"overlong cache {cache} must be in 1..max_new_tokens ({max_length}); lower dapo.overlong_cache.")
    lengths = lengths.float()
    start = max_length - cache
    mid = (start - lengths) / cache
    return torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_length, mid, -torch.ones_like(lengths)))


def step_advantages(outcome: Tensor, step_ends: list[list[int]], step_credit: list[list[float]], group_size: int,
                    width: int, *, weight: float = 1.0, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """Per-token advantages: the outcome advantage plus process credit, as DeepSeekMath's process supervision defines
    it (Shao et al. 2024, sec. 4.1.3) -- each step's credit normalised over every step of the group, and a token
    credited with the normalised credit of its own step and of every later one.  (N, T)

        r~_{i,k} = (c_{i,k} - mean_g c) / (std_g c + eps)          over all steps k of all completions i of group g
        A_{i,t}  = A_i + weight * sum_{k : end_{i,k} > t} r~_{i,k}

    Args:
        outcome: (N,) the sequence-level advantages A_i (from :func:`group_advantages`).
        step_ends: per completion, the token index just past each of its steps, ascending (a step ``k`` holds the
            tokens before ``end_k`` and after the previous step's end).
        step_credit: per completion, each step's credit ``c_{i,k}`` (e.g. 1 right, 0 wrong).
        group_size: G; rows of one group are contiguous.
        width: T, the completion tensor's width.
        weight: the process term's weight against the outcome advantage.
        scale: as the outcome's (``loss.advantage_scale``): ``group`` divides by the group's std of step credits (the
            formula above), ``batch`` by the std of every step credit in the batch, ``none`` only centres them.

    Tokens after a completion's last step carry the outcome advantage alone; a group whose credits are all equal (or
    that has fewer than two steps) adds nothing. GSPO-token and GRPO take these; GSPO's sequence ratio needs one
    advantage per sequence.
    """
    n = outcome.numel()
    if len(step_ends) != n or len(step_credit) != n:
        raise UserError(f"step credit was given for {len(step_ends)} completions, the batch has {n}.")
    if scale not in SCALES:
        raise UserError(f"Unknown advantage scale {scale!r}; use one of {', '.join(SCALES)}.")
    adv = outcome.double()[:, None].repeat(1, width)  # (N, T)
    every = torch.tensor([c for credits in step_credit for c in credits], dtype=torch.float64)
    batch_std = every.std() if every.numel() >= 2 else torch.zeros((), dtype=torch.float64)
    for g in range(0, n, group_size):
        pool = torch.tensor([c for i in range(g, g + group_size) for c in step_credit[i]], dtype=torch.float64)
        if pool.numel() < 2:
            continue
        mean, std = pool.mean(), pool.std()
        if std <= ZERO_STD:
            continue
        div = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        for i in range(g, g + group_size):
            norm = (torch.tensor(step_credit[i], dtype=torch.float64) - mean) / div  # (K,)
            togo = norm.flip(0).cumsum(0).flip(0)  # credit of step k and every later one: (K,)
            start = 0
            for end, value in zip(step_ends[i], togo.tolist()):
                end = min(end, width)
                adv[i, start:end] += weight * value
                start = max(start, end)
    return adv.to(outcome.dtype)
