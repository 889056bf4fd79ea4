"""PPO's value model in the update (``algorithm = "ppo"``; ``loss.advantage_baseline = "critic"``): held the way a
policy is (one process; under torchrun replicated with its gradients summed, or sharded with FSDP2), its estimates
before a rollout batch's updates, GAE's advantages and returns from them, and one update of its own per optimizer step
of the policy, on the same minibatch.

Per rollout batch (:meth:`Critic.prepare`, before any weight changes):

    V_old = critic(every row)                              (N, T), each process its rows, then shared
    r_t   = the outcome reward at each row's last step     (gspo.algorithms.ppo.outcome_token_rewards), plus with
            loss.step_credit each step's credit at its last token (gspo.algorithms.ppo.process_token_rewards)
    A, R  = gae(r, V_old, gamma, lam)                      advantages and value targets, whitened over the batch's
                                                           loss tokens with loss.advantage_scale = "tokens"
                                                           (gspo.algorithms.estimate_advantages)

Per minibatch (:meth:`Critic.step`, after the policy's step): the clipped value loss of its rows against R, with
V_old as the clip's centre, one AdamW step at ``ppo.critic_lr`` (the policy's betas, weight decay and gradient clip).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from gspo.algorithms import estimate_advantages
from gspo.algorithms.ppo import explained_variance, value_loss
from gspo.models import enable_activation_checkpointing
from gspo.models.value import ValueModel
from gspo.parallel import comm
from gspo.parallel.holding import Holding, hold
from gspo.parallel.plan import Plan
from gspo.runtime import to_device
from gspo.train.passes import PackedGraphs, as_fsdp_value_forward, packing_unsupported, sequence_values
from gspo.types import Batch


def hold_value_model(cfg, runtime, model: ValueModel, strategy: str) -> Holding:
    """``model`` ready for the update (activation checkpointing as the policy's) and held as ``strategy`` names, as
    the policy is (:func:`gspo.parallel.holding.hold`), with its own AdamW at ``ppo.critic_lr``: what the actor is
    built with."""
    if cfg.model.gradient_checkpointing:  # as the policy's
        enable_activation_checkpointing(model.backbone)
    return hold(strategy, model, runtime, cfg, prepare_forward=as_fsdp_value_forward, value_model=True)


class Critic:
    """The value model as ``holding`` holds it (see the module docstring). ``packed``: whether the policy's passes are
    packed (the critic's are too, where its architecture allows); ``graphs``: whether the policy's packed passes run
    as CUDA graphs (the critic's backbone's then do too: :class:`gspo.train.passes.PackedGraphs`)."""

    def __init__(self, cfg, runtime, holding: Holding, packed: bool, graphs: bool):
        self.cfg, self.runtime, self.holding = cfg, runtime, holding
        self.model = holding.model
        self.packed = packed and packing_unsupported(self.model.config) is None
        self.graphs = PackedGraphs(self.model, runtime.autocast) if self.packed and graphs else None
        self.old_values: torch.Tensor | None = None  # (N, T) on the device: V_old of the batch being trained
        self.returns: torch.Tensor | None = None  # (N, T) on the device: the value targets
        self.mask: torch.Tensor | None = None  # (N, T) on the device: the steps GAE ran over (the collect's loss mask)

    def values(self, batch: Batch, rows: torch.Tensor, pack_tokens: int = 0) -> torch.Tensor:
        """V(s_t) ``(n, T)`` of ``rows`` of the batch, differentiable when grad is enabled (``pack_tokens``: the packed
        length a CUDA graph pads to at least, :meth:`gspo.parallel.plan.Plan.pack_hint`)."""
        r = batch.rollout.select(rows.tolist())
        return sequence_values(self.model, r.prompt_ids, r.completion_ids, r.completion_mask, pad_id=r.pad_id,
                               autocast_dtype=self.runtime.autocast, packed=self.packed, graphs=self.graphs,
                               pack_tokens=pack_tokens)

    @torch.no_grad()
    def prepare(self, batch: Batch, plan: Plan, loss_mask: torch.Tensor,
                share: Callable[[torch.Tensor, Plan, range], None]) -> torch.Tensor:
        """V_old over every row (``share`` fills the other processes' rows), then GAE: returns the advantages
        ``(N, T)`` on the device (whitened as ``loss.advantage_scale`` says) and keeps the returns for the updates;
        the batch's metrics get the critic's explained variance of the returns and their means."""
        dev, p, lc = self.runtime.device, self.cfg.ppo, self.cfg.loss
        n_rows, width = batch.rollout.completion_ids.shape
        old = torch.zeros(n_rows, width, dtype=torch.float32, device=dev)
        was = self.model.training
        self.model.train(False)
        try:
            for k in range(len(plan.minibatches)):
                for j, sub in enumerate(plan.micro[k]):
                    old[to_device(sub, dev)] = self.values(batch, sub, plan.pack_hint(k, j))
        finally:
            self.model.train(was)
        share(old, plan, range(len(plan.minibatches)))
        mask = loss_mask.to(dev)
        # collect left the rewards there: (N,) outcomes, or (N, T) token rewards (the steps' credit already in)
        adv, returns = estimate_advantages(batch.advantages.to(dev), mask, baseline=lc.advantage_baseline,
                                           scale=lc.advantage_scale, group_size=self.cfg.rollout.group_size,
                                           values=old, gamma=p.gamma, lam=p.lam)  # (N, T) float64
        self.old_values, self.returns, self.mask = old, returns.float(), mask
        batch.metrics["critic/explained_variance"] = explained_variance(old, returns, mask)
        n = mask.sum().clamp(min=1)
        batch.metrics["critic/value_mean"] = torch.where(mask, old, 0.0).sum() / n
        batch.metrics["critic/return_mean"] = torch.where(mask, returns, 0.0).sum() / n
        return adv.float()

    def step(self, batch: Batch, plan: Plan, k: int) -> dict[str, torch.Tensor]:
        """One optimizer step of the value model on minibatch ``k``, over the tokens GAE ran over; its metrics over
        the whole minibatch (``critic/skipped``: 1 where a non-finite loss or gradient skipped the step)."""
        dev, rows, mask = self.runtime.device, plan.minibatches[k], self.mask
        rows_dev = to_device(rows, dev)
        mb_mask = mask[rows_dev]  # (mb, T)
        num_tokens = mb_mask.sum()
        clip = self.cfg.ppo.value_clip
        self.model.train(True)
        self.holding.zero_grad(keep_allocated=self.graphs is not None)  # graphed backwards keep .grad allocated
        mb_values = torch.zeros(mb_mask.shape, dtype=torch.float32, device=dev)
        own = len(rows) // plan.world
        start = plan.rank * own
        loss_total = torch.zeros((), dtype=torch.float64, device=dev)
        for j, sub in enumerate(plan.micro[k]):
            sub_dev = to_device(sub, dev)
            v = self.values(batch, sub, plan.pack_hint(k, j))
            loss, _ = value_loss(v, self.old_values[sub_dev], self.returns[sub_dev], mask[sub_dev], clip,
                                 num_tokens=num_tokens, with_metrics=False)
            (loss * self.holding.loss_scale if self.holding.loss_scale != 1 else loss).backward()
            loss_total += loss.detach().double()
            mb_values[start:start + len(sub)] = v.detach()
            start += len(sub)
        if plan.world > 1:
            share = slice(plan.rank * own, (plan.rank + 1) * own)
            mb_values = comm.gather_rows(mb_values[share])
            loss_total = comm.all_sum(loss_total)
        pending = self.holding.start_gradient_sum()
        grad_norm = self.holding.clip(self.cfg.train.max_grad_norm, pending)
        bad = ~(torch.isfinite(loss_total) & torch.isfinite(grad_norm))
        self.holding.apply(bad)
        self.model.train(False)
        with torch.no_grad():
            _, metrics = value_loss(mb_values, self.old_values[rows_dev], self.returns[rows_dev], mb_mask, clip)
        return {"critic/value_loss": loss_total, "critic/grad_norm": grad_norm,
                "critic/value_clip_frac": metrics["critic/value_clip_frac"], "critic/skipped": bad.float()}

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The value model's weights and optimizer for ``trainer_state.pt``, whole (:meth:`Holding.whole_state`: under
        FSDP a collective every process calls)."""
        weights, optimizer = self.holding.whole_state()
        return {"critic": weights, "critic_optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        self.holding.load_whole_state(state["critic"], state["critic_optimizer"])
        self.holding.set_lr(self.cfg.ppo.critic_lr)
