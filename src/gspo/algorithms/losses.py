"""Policy-gradient surrogate losses: importance ratio -> clip -> aggregate, each a pure function.

Shape legend: ``B`` sequences (completions), ``T`` padded completion positions, ``mask[b, t]`` is True on
completion tokens. All math runs in float32 or wider; nothing here touches a model, a file or a global.

The three ratio levels, in the notation of the GSPO paper (Zheng et al. 2025, arXiv:2507.18071):

- ``token`` (GRPO / PPO):       w_{i,t} = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
- ``sequence`` (GSPO):          s_i = (pi(y_i | x) / pi_old(y_i | x)) ** (1 / |y_i|)
                                    = exp( (1/|y_i|) * sum_t log w_{i,t} )      (gradient flows through the mean)
- ``sequence_token`` (GSPO-token): s_{i,t} = sg[s_i] * pi(y_t | .) / sg[pi(y_t | .)]
                                    (equal to s_i in value; the gradient reaches each token on its own, so the
                                    advantage may vary per token)

Differences from the papers, on purpose: log-ratios are clamped to +-LOG_RATIO_CLAMP before ``exp`` so an
outlier token cannot overflow (OpenRLHF PR #1293); padded positions are zeroed with ``torch.where`` before any
arithmetic so that +-inf or NaN in padding can never reach the loss or its gradient.
"""
from __future__ import annotations

import torch

from gspo.errors import UserError

Tensor = torch.Tensor

LOG_RATIO_CLAMP = 20.0

LEVELS = ("token", "sequence", "sequence_token")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def _check_choice(value: str, valid: tuple[str, ...], what: str) -> None:
    if value not in valid:
        raise UserError(f"Unknown {what} {value!r}; use one of {', '.join(valid)}.")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the True entries of ``mask`` (0 where nothing is selected)."""
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    count = mask.sum() if dim is None else mask.sum(dim)
    total = x.sum() if dim is None else x.sum(dim)
    return total / count.clamp(min=1)


def _at_least_fp32(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# --------------------------------------------------------------------------------------------- ratios


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log w_{i,t} = log pi - log pi_old, clamped, 0 on padding.  (B, T)"""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lr = torch.where(mask, logp, zero) - torch.where(mask, old_logp, zero)  # (B, T)
    return lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(token_lr: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/|y_i|) sum_t log w_{i,t}: the log of the geometric mean of the token ratios.  (B,)"""
    return masked_mean(token_lr, mask, dim=-1)  # (B,)


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """The importance ratio of each token position at the given level, broadcast to (B, T).

    For ``sequence`` every position of row i holds s_i (differentiable through the mean); for
    ``sequence_token`` it holds sg[s_i] * exp(log pi - sg[log pi]), equal in value with a per-token gradient.
    """
    _check_choice(level, LEVELS, "ratio level")
    token_lr = token_log_ratio(logp, old_logp, mask)  # (B, T)
    if level == "token":
        return torch.exp(token_lr)
    seq_lr = sequence_log_ratio(token_lr, mask)  # (B,)
    if level == "sequence":
        return torch.exp(seq_lr).unsqueeze(-1).expand_as(logp)  # (B, T)
    safe_logp = torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    per_token = torch.exp(safe_logp - safe_logp.detach())  # (B, T), value exactly 1
    return torch.exp(seq_lr).detach().unsqueeze(-1) * per_token  # (B, T)


# --------------------------------------------------------------------------------------------- clip


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-position PPO loss  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  and where the clip is active.

    The clip is active (the position gets no gradient) when r < 1 - eps_low with A < 0, or r > 1 + eps_high with
    A > 0. Returns ``(loss (B, T), clipped_low (B, T) bool, clipped_high (B, T) bool)``.
    """
    unclipped = ratio * advantages  # (B, T)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages  # (B, T)
    loss = -torch.minimum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return loss, clipped_low, clipped_high


# --------------------------------------------------------------------------------------------- other objectives

OBJECTIVES = ("clip", "cispo", "gmpo", "sapo")
# The ratio levels each objective is defined at (``clip``: all three).
OBJECTIVE_LEVELS = {"clip": LEVELS, "cispo": ("token",), "gmpo": ("sequence",), "sapo": LEVELS}
SAPO_TAU = (1.0, 1.05)  # (tau_pos, tau_neg), the SAPO paper's


def cispo_surrogate(ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025, arXiv:2506.13585): every token keeps its gradient; the importance weight
    is truncated and held constant instead.

        J(theta) = E[ sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) * A_{i,t} * log pi_theta(y_t | .) ]

    Its gradient is  sg(r^) A grad log pi. The per-position loss here is  -sg(r^) A exp(log pi - sg(log pi)):
    the same gradient, and the value -r^ A (the truncated-IS surrogate) rather than -r^ A log pi, whose value means
    nothing and grows with the tokens' surprisal. Returns ``(loss (B, T), truncated_low (B, T), truncated_high (B, T))``:
    where the weight was truncated (those tokens still get a gradient, scaled by the bound)."""
    safe_logp = torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    loss = -weight * advantages * torch.exp(safe_logp - safe_logp.detach())  # (B, T)
    with torch.no_grad():
        return loss, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high


def gmpo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                   eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the token ratios, each clipped on its own, in
    log space, on the pessimistic side of the advantage's sign.

        J(theta) = E[ sgn(A_i) * prod_t min(r_{i,t} |A_i|, clip(r_{i,t}, e^-eps_low, e^eps_high) |A_i|) ^ (1/|y_i|) ]
                 = E[ A_i * exp( (1/|y_i|) sum_t sgn(A_i) min(sgn(A_i) log r_{i,t}, sgn(A_i) clip(log r_{i,t},
                                                                                      -eps_low, eps_high)) ) ]

    Unclipped it is GSPO's s_i A_i; GSPO clips the sequence ratio s_i, GMPO each token's ratio inside it (so one
    token far from 1 stops only its own gradient). ``advantages``: (B, 1) or (B, T) constant along a row. Each row's
    loss -A_i g_i sits on every one of its positions, so ``seq-mean-token-mean`` averages it over sequences. Returns
    ``(loss (B, T), clipped_low (B, T), clipped_high (B, T))``: tokens whose log-ratio the clip held."""
    token_lr = token_log_ratio(logp, old_logp, mask)  # (B, T)
    sign = torch.sign(advantages)  # (B, T) or (B, 1)
    held = sign * torch.minimum(sign * token_lr, sign * token_lr.clamp(-eps_low, eps_high))  # (B, T)
    seq = torch.exp(masked_mean(held, mask, dim=-1)).unsqueeze(-1)  # (B, 1)
    loss = (-advantages * seq).expand_as(logp)  # (B, T)
    with torch.no_grad():
        return loss, (token_lr < -eps_low) & (advantages < 0), (token_lr > eps_high) & (advantages > 0)


def sapo_surrogate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft gate in place of the hard clip.

        J(theta) = E[ f_{i,t}(r_{i,t}) A_{i,t} ],   f(r) = sigmoid(tau (r - 1)) * 4 / tau,
        tau = tau_pos where A > 0, tau_neg where A <= 0

    f(1) = 2 / tau and f'(1) = 1, so on policy the gradient is the plain policy gradient; away from 1 the gradient
    weight f'(r) = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1))) decays smoothly instead of dropping to 0 at a
    clip edge. A larger tau_neg damps negative-advantage tokens faster (their off-policy gradients are the unstable
    ones). Nothing is clipped. Returns the loss (B, T)."""
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
                      torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device))  # (B, T)
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages


def _surrogate(objective: str, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, level: str, eps_low: float,
               eps_high: float, sapo_tau: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
    """The objective's per-position loss (B, T) and where its clip acted, low and high (B, T) bool."""
    if objective == "gmpo":
        return gmpo_surrogate(logp, old_logp, adv, mask, eps_low, eps_high)
    ratio = importance_ratio(logp, old_logp, mask, level)  # (B, T)
    if objective == "clip":
        return clipped_surrogate(ratio, adv, eps_low, eps_high)
    if objective == "cispo":
        return cispo_surrogate(ratio, logp, adv, mask, eps_low, eps_high)
    with torch.no_grad():  # SAPO cuts nothing: the clip metrics count the ratios outside the eps band (as verl)
        outside = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high
    return sapo_surrogate(ratio, adv, *sapo_tau), *outside


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref):  exp(ref - logp) - (ref - logp) - 1, 0 on padding.  (B, T)"""
    d = token_log_ratio(ref_logp, logp, mask)  # (B, T) = ref - logp
    return torch.where(mask, torch.exp(d) - d - 1.0, torch.zeros((), dtype=d.dtype, device=d.device))


# --------------------------------------------------------------------------------------------- aggregation


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    max_length: int | None = None,
    num_seqs: float | Tensor | None = None,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-position loss (B, T) to a scalar.

    - ``seq-mean-token-mean``:     (1/B) sum_i (1/|y_i|) sum_t l_{i,t}          (GRPO and GSPO papers)
    - ``token-mean``:              sum_{i,t} l_{i,t} / sum_i |y_i|              (DAPO)
    - ``seq-mean-token-sum-norm``: sum_{i,t} l_{i,t} / (B * max_length)         (Dr. GRPO)

    ``num_seqs`` / ``num_tokens`` replace B / sum |y_i| so that micro-batches of one optimizer step can be summed
    into exactly the full-batch value (by default B counts only rows with at least one loss token); they may be
    floats or 0-dim tensors (a count left on the device needs no host sync). ``max_length`` defaults to T.
    """
    _check_choice(mode, AGGREGATIONS, "loss aggregation")
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    loss_mat = torch.where(mask, loss_mat, zero)  # (B, T)
    T = loss_mat.shape[1]
    # A row with no loss token (e.g. a truncated completion under overlong filtering) is not a sequence of the mean.
    n_seq = _count(mask.any(-1).sum() if num_seqs is None else num_seqs, loss_mat)
    if mode == "seq-mean-token-mean":
        per_seq = loss_mat.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        return per_seq.sum() / n_seq
    if mode == "token-mean":
        return loss_mat.sum() / _count(mask.sum() if num_tokens is None else num_tokens, loss_mat)
    return loss_mat.sum() / (n_seq * float(max_length if max_length is not None else T))


def _count(n: float | Tensor, like: Tensor) -> Tensor:
    """A denominator: at least 1, in the loss's dtype (counts are exact there), on its device."""
    return torch.as_tensor(n, dtype=like.dtype, device=like.device).clamp(min=1.0)


# --------------------------------------------------------------------------------------------- the loss


def _masked_stats(values: Tensor, mask: Tensor, prefix: str) -> dict[str, Tensor]:
    """Mean, population std, min and max of ``values`` where ``mask`` is True, as 0-dim tensors (NaN when nothing is
    selected), two-pass in the values' dtype (as ``Tensor.std`` computes them) without boolean indexing, which would
    wait for the device."""
    x = values
    count = mask.sum()
    n = count.clamp(min=1)
    mean = torch.where(mask, x, 0.0).sum() / n
    std = (torch.where(mask, (x - mean) ** 2, 0.0).sum() / n).sqrt()
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    empty = count == 0
    return {f"{prefix}_mean": torch.where(empty, nan, mean), f"{prefix}_std": torch.where(empty, nan, std),
            f"{prefix}_min": torch.where(empty, nan, torch.where(mask, x, float("inf")).amin()),
            f"{prefix}_max": torch.where(empty, nan, torch.where(mask, x, float("-inf")).amax())}


@torch.no_grad()
def ratio_metrics(logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Token- and sequence-level ratio statistics and an approximate KL(old || new), whatever the level trained, as
    0-dim tensors (NaN where no token or sequence is selected).

    ``kl/old_new`` is the k3 estimator  E_old[(w - 1) - log w]  averaged over tokens.
    """
    token_lr = token_log_ratio(_at_least_fp32(logp), _at_least_fp32(old_logp), mask)  # (B, T)
    seq_lr = sequence_log_ratio(token_lr, mask)  # (B,)
    has_tokens = mask.any(-1)  # (B,)
    out = {**_masked_stats(torch.exp(token_lr), mask, "ratio/token"), **_masked_stats(torch.exp(seq_lr), has_tokens, "ratio/seq")}
    # Unclipped product of token ratios per sequence: token-level clipping does not bound it (the seeds' point).
    prod_lr = torch.where(mask, token_lr, torch.zeros_like(token_lr)).sum(-1)  # (B,)
    stats = _masked_stats(prod_lr, has_tokens, "ratio/seq_product_log")
    out["ratio/seq_product_log_min"], out["ratio/seq_product_log_max"] = stats["ratio/seq_product_log_min"], stats["ratio/seq_product_log_max"]
    kl = torch.exp(token_lr) - 1.0 - token_lr
    out["kl/old_new"] = masked_mean(kl, mask)
    return out


# Response-length bins of the by-length diagnostics (``bylen/<lo>-<hi>/*``): [0, 64), [64, 128), [128, 256),
# [256, 512), [512, inf) tokens. The seeds' claim is that token-level noise grows with length; these show it per step.
LENGTH_EDGES = (64, 128, 256, 512)


def response_length_bins(max_length: int) -> list[tuple[int, int | None, str]]:
    """``(lo, hi or None, name)`` of the bins a run with completions of at most ``max_length`` tokens can fill (a
    completion cut at exactly ``max_length`` included)."""
    edges = [0, *LENGTH_EDGES]
    bins = [(lo, hi, f"{lo}-{hi - 1}") for lo, hi in zip(edges, edges[1:])] + [(edges[-1], None, f"{edges[-1]}+")]
    return [b for b in bins if b[0] <= max_length]


@torch.no_grad()
def length_bin_metrics(token_lr: Tensor, mask: Tensor, clipped: Tensor, max_length: int) -> dict[str, Tensor]:
    """Clipping and ratio spread by response length, as 0-dim tensors (NaN in a bin without responses):
    ``bylen/<bin>/seqs`` (responses whose length, their tokens in ``mask``, falls in the bin), ``.../clip_token``
    (clipped tokens / tokens), ``.../ratio_token_std`` (std of r_{i,t}) and ``.../ratio_seq_std`` (std of the
    length-normalised sequence ratio s_i) -- for every level trained. ``token_lr``: (B, T) log r_{i,t}; ``clipped``:
    (B, T) True on tokens the objective clipped."""
    lengths = mask.sum(-1)  # (B,)
    seq_ratio = torch.exp(sequence_log_ratio(token_lr, mask))  # (B,)
    nan = torch.full((), float("nan"), dtype=token_lr.dtype, device=token_lr.device)
    out = {}
    for lo, hi, name in response_length_bins(max_length):
        rows = (lengths >= max(lo, 1)) & (lengths < hi if hi is not None else True)  # (B,)
        tmask = mask & rows[:, None]  # (B, T)
        n_rows, n_tok = rows.sum(), tmask.sum()
        empty = n_rows == 0
        out[f"bylen/{name}/seqs"] = n_rows.to(token_lr.dtype)
        out[f"bylen/{name}/clip_token"] = torch.where(empty, nan, (clipped & tmask).sum() / n_tok.clamp(min=1))
        out[f"bylen/{name}/ratio_token_std"] = _masked_stats(torch.exp(token_lr), tmask, "r")["r_std"]
        out[f"bylen/{name}/ratio_seq_std"] = _masked_stats(seq_ratio, rows, "r")["r_std"]
    return out


@torch.no_grad()
def logprob_gap(engine_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far an inference engine's log-probs are from the trainer's for the same tokens, as 0-dim tensors: the
    absolute token log-ratio |log pi_engine - log pi_trainer| (mean and max over tokens) and the absolute GSPO sequence
    log-ratio |(1/|y|) sum_t ...| (mean and max over sequences); 0 when nothing is selected."""
    token_lr = token_log_ratio(_at_least_fp32(engine_logp), _at_least_fp32(trainer_logp), mask)  # (B, T)
    seq = sequence_log_ratio(token_lr, mask).abs()  # (B,)
    has_tokens = mask.any(-1)  # (B,)
    tok = token_lr.abs()
    return {"logprob/engine_diff_mean": masked_mean(tok, mask),
            "logprob/engine_diff_max": torch.where(mask, tok, 0.0).amax() if mask.numel() else tok.new_zeros(()),
            "logprob/engine_seq_diff_mean": torch.where(has_tokens, seq, 0.0).sum() / has_tokens.sum().clamp(min=1),
            "logprob/engine_seq_diff_max": torch.where(has_tokens, seq, 0.0).amax() if seq.numel() else seq.new_zeros(())}


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    level: str,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    max_length: int | None = None,
    num_seqs: float | Tensor | None = None,
    num_tokens: float | Tensor | None = None,
    weights: Tensor | None = None,
    objective: str = "clip",
    sapo_tau: tuple[float, float] = SAPO_TAU,
    with_metrics: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GSPO / GSPO-token / GRPO objective (to minimise) and its diagnostics.

    J(theta) = E[ agg_{i,t} w_{i,t} min(r_{i,t} A_{i,t}, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t}) ] - beta KL

    with w = 1 unless ``weights`` are given: the behaviour-policy correction of :mod:`gspo.algorithms.corrections`
    ((B, T) constants; a position they leave out must be off ``mask`` too, so that it leaves the denominators).
    ``objective`` replaces the clipped term: ``cispo`` (:func:`cispo_surrogate`, ``eps_*`` bound the truncated
    weight), ``gmpo`` (:func:`gmpo_surrogate`, ``eps_*`` bound each token's log-ratio), ``sapo``
    (:func:`sapo_surrogate` with ``sapo_tau = (tau_pos, tau_neg)``; ``eps_*`` only set the band whose exits the
    clip metrics count).

    Args:
        logp: (B, T) log pi_theta of the sampled tokens (differentiable).
        old_logp: (B, T) log pi_theta_old of the same tokens (treated as constants).
        advantages: (B,) one per sequence, or (B, T) one per token (``sequence`` level needs a per-sequence one).
        mask: (B, T) True on completion tokens.
        level: ``token`` | ``sequence`` | ``sequence_token``.
        aggregation: see :func:`aggregate`.
        ref_logp, beta: optional k3 KL penalty to a frozen reference policy, added per token.
        max_length, num_seqs, num_tokens: see :func:`aggregate`.

    Returns ``(loss, metrics)``; metrics (empty unless ``with_metrics``) are detached 0-dim tensors: clip fractions low/high/total counted per token
    (``clip/token_*``: clipped tokens / tokens) and per sequence (``clip/seq_*``: mean over sequences of the
    fraction of the sequence's tokens clipped, which for ``sequence`` level is the fraction of sequences clipped),
    ratio statistics at both levels, ``kl/old_new``, and the same by response length (``bylen/<bin>/*``, see
    :func:`length_bin_metrics`; ``max_length``, or T, also decides which bins are reported).
    """
    _check_choice(level, LEVELS, "ratio level")
    _check_choice(objective, OBJECTIVES, "objective")
    if level not in OBJECTIVE_LEVELS[objective]:
        raise UserError(f"The {objective} objective is defined at the ratio level(s) "
                        f"{', '.join(OBJECTIVE_LEVELS[objective])}, not {level!r}.")
    mask = mask.bool()
    logp = _at_least_fp32(logp)
    old_logp = old_logp.detach().to(logp.dtype)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (B, 1), broadcasts over T
    elif level == "sequence":
        seq_mean = masked_mean(adv, mask, dim=-1)  # (B,)
        if not torch.allclose(torch.where(mask, adv, seq_mean[:, None]), seq_mean[:, None].expand_as(adv)):
            raise UserError(
                "level='sequence' takes one advantage per sequence but the (B, T) advantages vary within a "
                "sequence; use level='sequence_token' (GSPO-token) for per-token advantages."
            )
    adv = torch.where(mask, adv.expand_as(logp), torch.zeros((), device=logp.device))  # (B, T)

    per_token, clipped_low, clipped_high = _surrogate(objective, logp, old_logp, adv, mask, level, eps_low, eps_high,
                                                      sapo_tau)  # (B, T) each
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    kl_term = None
    if ref_logp is not None and beta != 0.0:
        kl_term = k3_kl(logp, ref_logp.detach().to(logp.dtype), mask)  # (B, T)
        per_token = per_token + beta * kl_term
    agg = dict(max_length=max_length, num_seqs=num_seqs, num_tokens=num_tokens)
    loss = aggregate(per_token, mask, aggregation, **agg)
    if not with_metrics:
        return loss, {}

    with torch.no_grad():
        metrics = ratio_metrics(logp, old_logp, mask)
        has_tokens = mask.any(-1)  # (B,)
        for name, hit in (("low", clipped_low & mask), ("high", clipped_high & mask), ("total", (clipped_low | clipped_high) & mask)):
            metrics[f"clip/token_{name}"] = hit.sum() / mask.sum().clamp(min=1)
            per_seq = masked_mean(hit.float(), mask, dim=-1)  # (B,)
            metrics[f"clip/seq_{name}"] = torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum().clamp(min=1)
        if kl_term is not None:
            metrics["kl/ref"] = masked_mean(kl_term, mask)
        token_lr = token_log_ratio(_at_least_fp32(logp), _at_least_fp32(old_logp), mask)
        metrics.update(length_bin_metrics(token_lr, mask, (clipped_low | clipped_high) & mask,
                                          max_length if max_length is not None else mask.shape[-1]))
    return loss, metrics

