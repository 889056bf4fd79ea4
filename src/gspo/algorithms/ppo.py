"""PPO's critic side: token rewards, generalised advantage estimation, the clipped value loss and explained variance,
each a pure function (Schulman et al. 2016, 2017; as verl's ``compute_gae_advantage_return`` and
``compute_value_loss`` define them for language models: the response tokens are the time steps, the reward arrives
at the last one).

Shape legend: ``B`` sequences, ``T`` padded completion positions, ``mask[b, t]`` True on the tokens the policy sampled
(the steps of the episode). Positions off the mask -- padding, and in multi-turn rows the tokens an environment
appended -- are not steps: the recursions pass over them (the value and the running advantage of the next step
carry across), so a tool result between two turns does not cut the return. All math in float64 or the inputs' dtype
if wider; nothing here touches a model.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def outcome_token_rewards(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None = None) -> Tensor:
    """The reward of each time step: each sequence's outcome reward at its last step, plus ``token_rewards`` (B, T)
    where given (process credit), 0 off the mask.  (B, T)

    ``rewards`` (B,); a row without steps gets nothing."""
    m = mask.bool()
    T = m.shape[1]
    last = torch.where(m, torch.arange(T, device=m.device), -1).amax(-1)  # (B,) index of the last step, -1 if none
    out = torch.zeros(m.shape, dtype=torch.float64, device=m.device)
    has = last >= 0
    out[has.nonzero().flatten(), last[has]] = rewards.double()[has]
    if token_rewards is not None:
        out = out + torch.where(m, token_rewards.double(), 0.0)
    return out


def step_token_rewards(step_ends: list[list[int]], step_credit: list[list[float]], width: int,
                       weight: float = 1.0) -> Tensor:
    """Process rewards as token rewards for GAE (``loss.step_credit`` with PPO): step k of row b, ending just past token
    ``step_ends[b][k] - 1``, pays ``weight * step_credit[b][k]`` at that token, its last.  (B, width) float64

    Unlike the group-relative step credit of the GRPO family (:func:`gspo.algorithms.advantages.step_advantages`,
    credits centred within their group), the critic learns what each step is worth: the credits are raw rewards, as a
    process reward model's scores are in PPO. A step that ends at token 0 (an empty step) pays nothing."""
    out = torch.zeros(len(step_ends), width, dtype=torch.float64)
    for b, (ends, credits) in enumerate(zip(step_ends, step_credit)):
        for end, credit in zip(ends, credits):
            if 0 < end <= width:
                out[b, end - 1] += weight * float(credit)
    return out


def process_token_rewards(rewards: Tensor, mask: Tensor, step_ends: list[list[int]], step_credit: list[list[float]],
                          weight: float = 1.0, paid_in_outcome: bool = False) -> Tensor:
    """The token rewards GAE takes with process credit (``loss.step_credit`` with PPO): each step's ``weight`` x
    credit at its last token (:func:`step_token_rewards`) and the outcome at the row's last step.  (B, T) float64

    ``paid_in_outcome``: the credits are already part of ``rewards`` (an environment's step rewards, whose sum is the
    trajectory's reward: ``loss.step_credit = "env"``), so the last step gets only the rest, and with weight 1 a
    row's rewards sum to its outcome rather than counting each step twice:

        r_end(k) = w c_k,    r_last += R - sum_k c_k"""
    if paid_in_outcome:
        rewards = rewards.double() - torch.tensor([float(sum(c)) for c in step_credit], dtype=torch.float64,
                                                  device=rewards.device)
    return outcome_token_rewards(rewards, mask, step_token_rewards(step_ends, step_credit, mask.shape[1], weight))


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each row's steps, backwards from its last.

        delta_t = r_t + gamma V(s_{t'}) - V(s_t)                 (t' the next step after t; V = 0 after the last)
        A_t     = delta_t + gamma lam A_{t'}                      (A = 0 after the last step)
        R_t     = A_t + V(s_t)                                    (the value target)

    With gamma = lam = 1 (verl's defaults for outcome rewards) A_t = R - V(s_t): the outcome reward less the critic's
    estimate at each token. Returns ``(advantages, returns)``, each (B, T), float64, 0 off the mask (not whitened:
    :func:`gspo.algorithms.advantages.whiten_tokens` does that, as verl whitens GAE's advantages over the batch's
    response tokens)."""
    m = mask.bool()
    r, v = token_rewards.double(), values.double()
    B, T = m.shape
    adv = torch.zeros(B, T, dtype=torch.float64, device=m.device)
    next_value = torch.zeros(B, dtype=torch.float64, device=m.device)
    running = torch.zeros(B, dtype=torch.float64, device=m.device)
    for t in range(T - 1, -1, -1):
        step = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = delta + gamma * lam * running
        running = torch.where(step, here, running)  # off the mask: carry the next step's across
        next_value = torch.where(step, v[:, t], next_value)
        adv[:, t] = torch.where(step, here, 0.0)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
               num_tokens: float | Tensor | None = None, with_metrics: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, the token mean over the mask:

        L_V = 1/2 mean_t max( (V_t - R_t)^2, (clip(V_t, V_old_t - clip, V_old_t + clip) - R_t)^2 )

    ``values`` (B, T) differentiable; ``old_values`` the critic's before this rollout batch's updates; ``returns``
    the targets (constants). ``clip <= 0`` turns the clipping off. ``num_tokens`` replaces the mask's count (so
    micro-batches sum to the minibatch's loss). Returns ``(loss, metrics)``: ``critic/value_clip_frac`` (tokens where
    the clipped term was the larger), ``critic/value_mean``, ``critic/return_mean`` (empty unless ``with_metrics``)."""
    m = mask.bool()
    v = values if values.dtype in (torch.float32, torch.float64) else values.float()
    old, ret = old_values.detach().to(v.dtype), returns.detach().to(v.dtype)
    unclipped = (v - ret) ** 2
    if clip > 0:
        clipped = (torch.clamp(v, old - clip, old + clip) - ret) ** 2  # equal to v inside the band, bit for bit
        per_token = torch.maximum(unclipped, clipped)
    else:
        clipped, per_token = unclipped, unclipped
    per_token = torch.where(m, per_token, torch.zeros((), dtype=v.dtype, device=v.device))
    count = m.sum() if num_tokens is None else num_tokens
    loss = 0.5 * per_token.sum() / torch.as_tensor(count, dtype=v.dtype, device=v.device).clamp(min=1)
    if not with_metrics:
        return loss, {}
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {"critic/value_clip_frac": ((clipped > unclipped) & m).sum() / n,
                   "critic/value_mean": torch.where(m, v, 0.0).sum() / n,
                   "critic/return_mean": torch.where(m, ret, 0.0).sum() / n}
    return loss, metrics


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over the masked tokens (1: the critic predicts the returns; 0: no better than their
    mean; negative: worse). NaN when the returns do not vary or fewer than two tokens are selected."""
    m = mask.bool()
    if m.sum() < 2:
        return torch.full((), float("nan"), dtype=torch.float64)
    ret, v = returns.double()[m], values.double()[m]
    var_r = ret.var()
    if var_r <= 0:
        return torch.full((), float("nan"), dtype=torch.float64)
    return 1.0 - (ret - v).var() / var_r
