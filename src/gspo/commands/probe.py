"""``gspo probe noise``: how the importance-weight noise of GRPO's and GSPO's gradients grows with response length, on
one rollout batch of the user's own model and task.

The seeds argue that GRPO's per-token importance weights add noise that accumulates with response length, while
GSPO's single sequence weight does not. On one rollout batch the probe moves the policy off-policy exactly as training
does for the batch's last minibatch (``train.minibatches - 1`` optimizer steps on it), then, for a sample of responses ``i`` with non-zero advantage
``A_i`` and length ``|y_i|``, compares the two objectives' gradients of that one response (before clipping):

    on-policy:  g_i   = (A_i / |y_i|) sum_t        grad log pi(y_t)          (what both reduce to at ratio 1)
    GRPO:       g_i^T = (A_i / |y_i|) sum_t r_t  * grad log pi(y_t),   r_t = pi(y_t) / pi_old(y_t)
    GSPO:       g_i^S = (A_i / |y_i|) sum_t s_i  * grad log pi(y_t),   s_i = (prod_t r_t)^(1 / |y_i|)

and reports, per length bin:

- ``weight_var``: variance of the per-token gradient weights (r_t for GRPO; s_i, one per response, for GSPO) over the
  bin's tokens;
- ``grad_norm``: mean ||g_i^T|| or ||g_i^S||;
- ``is_noise``: mean ||g_i^X - g_i|| / ||g_i||, the part of the gradient that the importance weights add.

The result goes to ``probe_noise.json`` (in a run directory, ``gspo report`` draws it).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def _grad_norm(model, logp: torch.Tensor, weights: torch.Tensor) -> float:
    """|| grad_theta sum_t weights_t * logp_t ||  for one response (weights are constants; the graph is kept for the
    next weighting of the same forward pass)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((weights.detach() * logp).sum(), params, retain_graph=True, allow_unused=True)
    return math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))


def length_bins(lengths: list[int], n_bins: int) -> list[tuple[int, int]]:
    """Up to ``n_bins`` contiguous [lo, hi] ranges holding about equal numbers of the sorted lengths."""
    xs = sorted(lengths)
    if not xs:
        return []
    cuts = sorted({xs[min(len(xs) - 1, (k * len(xs)) // n_bins)] for k in range(n_bins)})
    bounds = []
    for j, lo in enumerate(cuts):
        hi = cuts[j + 1] - 1 if j + 1 < len(cuts) else xs[-1]
        bounds.append((lo, hi))
    return bounds


def summarize_bins(records: list[dict[str, Any]], n_bins: int) -> dict[str, list[dict[str, Any]]]:
    """Per objective and length bin: sequences, mean length, token-weight variance, mean gradient norm, IS noise."""
    out: dict[str, list[dict[str, Any]]] = {}
    bins = length_bins([r["length"] for r in records], n_bins)
    for algo in ("grpo", "gspo"):
        rows = []
        for lo, hi in bins:
            mine = [r for r in records if lo <= r["length"] <= hi]
            if not mine:
                continue
            weights = [w for r in mine for w in r[f"{algo}_weights"]]
            mean_w = sum(weights) / len(weights)
            rows.append({"length_lo": lo, "length_hi": hi, "length_mid": sum(r["length"] for r in mine) / len(mine),
                         "n": len(mine), "weight_var": sum((w - mean_w) ** 2 for w in weights) / len(weights),
                         "grad_norm": sum(r[f"{algo}_grad_norm"] for r in mine) / len(mine),
                         "is_noise": sum(r[f"{algo}_is_noise"] for r in mine) / len(mine)})
        out[algo] = rows
    return out


def probe_noise(cfg, out_path: str | Path, rows: int = 48, n_bins: int = 5) -> dict[str, Any]:
    """Run the probe for ``cfg`` (its model, data, rollout and train settings) and write ``out_path``."""
    from gspo.algorithms import token_log_ratio
    from gspo.runtime import Runtime
    from gspo.errors import UserError
    from gspo.train import build

    if cfg.loss.step_credit:
        raise UserError("gspo probe measures the gradient of one advantage per response; remove loss.step_credit "
                        "(per-token advantages) from the config to probe it.")
    if cfg.loss.advantage_baseline == "critic":
        raise UserError("gspo probe measures the gradient of one advantage per response, and PPO's value model gives "
                        "one per token; probe the config with another algorithm (e.g. algorithm = 'grpo').")

    parts = build(cfg, Runtime.from_config(cfg.model))
    actor = parts.actor
    try:
        batch = parts.collector.collect()
        rollout = batch.rollout
        N = rollout.completion_ids.shape[0]
        # Micro-batches of the update's size: the whole batch in one pass could hold far more memory (GSM8K at 512 new
        # tokens: 256 rows of ~700 tokens).
        size = cfg.train.micro_batch_size or max(1, N // cfg.train.minibatches)
        micro = [torch.arange(i, min(N, i + size)) for i in range(0, N, size)]
        old = actor.frozen_logprobs(rollout, micro).cpu()  # (N, T) before the updates
        # The last minibatch of a batch trains after minibatches - 1 optimizer steps: move the policy that far.
        plan = actor.plan(N)
        actor.prepare(batch, plan)
        for k in range(cfg.train.minibatches - 1):
            actor.step(batch, plan, k, k)
        mask = rollout.completion_mask  # (N, T)
        adv = batch.advantages.cpu()
        candidates = [i for i in range(N) if adv[i] != 0 and mask[i].any()]
        g = torch.Generator().manual_seed(cfg.seed)
        pick = [candidates[j] for j in torch.randperm(len(candidates), generator=g)[:rows].tolist()]
        records = []
        actor.model.train()
        for i in pick:
            # One response at a time: not worth a CUDA graph per shape.
            logp, _ = actor.logprobs(rollout, torch.tensor([i]), graphs=False)  # (1, T), differentiable
            m = mask[i].to(logp.device)
            lp = logp[0][m]  # (n,)
            lr = token_log_ratio(logp[0].detach().cpu(), old[i], mask[i])[mask[i]]  # (n,) token log-ratios
            n = lr.numel()
            r = lr.exp().to(lp.device)
            s = float(lr.mean().exp())
            base = float(adv[i]) / n
            model = actor.model
            on = _grad_norm(model, lp, torch.full_like(lp, base))
            records.append({"row": i, "length": n, "advantage": float(adv[i]),
                            "grpo_weights": r.tolist(), "gspo_weights": [s] * n,
                            "grpo_grad_norm": _grad_norm(model, lp, base * r),
                            "gspo_grad_norm": _grad_norm(model, lp, torch.full_like(lp, base * s)),
                            "grpo_is_noise": _grad_norm(model, lp, base * (r - 1)) / max(on, 1e-12),
                            "gspo_is_noise": _grad_norm(model, lp, torch.full_like(lp, base * (s - 1))) / max(on, 1e-12)})
        actor.model.eval()
    finally:
        parts.rewards.close()
    result = {"model": cfg.model.name, "algorithm_of_the_updates": cfg.algorithm, "minibatches": cfg.train.minibatches,
              "responses": len(records), "by_algorithm": summarize_bins(records, n_bins),
              "per_response": [{k: v for k, v in r.items() if not k.endswith("_weights")} for r in records]}
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def noise_table(result: dict[str, Any]) -> str:
    lines = ["| objective | length | responses | token-weight variance | gradient norm | IS noise (relative) |",
             "|---|---|---|---|---|---|"]
    for algo, rows in result["by_algorithm"].items():
        for b in rows:
            lines.append(f"| {algo} | {b['length_lo']}-{b['length_hi']} | {b['n']} | {b['weight_var']:.3g} | "
                         f"{b['grad_norm']:.3g} | {b['is_noise']:.3g} |")
    return "\n".join(lines)
