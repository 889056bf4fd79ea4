"""The actor: the policy being trained (and its frozen reference) as its :class:`~gspo.parallel.holding.Holding` holds
it, the learning-rate schedule, and the log-prob passes of the update (padded, packed, or packed and CUDA-graphed).
The holding owns the trainable parameters, the optimizer, the gradient sum and what checkpoints save; the actor never
asks which holding it has.

Shapes: ``N`` rows of the rollout batch, ``T`` completion positions, ``mb`` rows of a minibatch.

One rollout batch goes through it as

    plan = actor.plan(N)                       # a seeded shuffle, cut into minibatches and micro-batches
    actor.prepare(batch, plan)                 # old-policy (and reference) log-probs, before any weight changes
    for k in range(minibatches):
        out = actor.step(batch, plan, k)       # forward/backward per micro-batch, clip, AdamW: metrics as tensors

Old-policy log-probs (``train.old_logprobs = "recompute"``): minibatch 0 is on-policy, so its old log-probs are its own
update forward's, detached (its ratio is exactly 1); the later minibatches get a frozen pass over the same
micro-batches the update will use, so that in bf16 their numbers round as the update's would.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gspo.algorithms import logprob_gap, policy_loss
from gspo.algorithms.losses import SAPO_TAU
from gspo.algorithms.corrections import DEFAULT_BOUNDS, mismatch_weights
from gspo.config import Config
from gspo.errors import UserError
from gspo.train.passes import PackedGraphs, as_fsdp_forward, packing_available, packing_unsupported, sequence_logprobs
from gspo.models import attention_context, disable_dropout, enable_activation_checkpointing
from gspo.models.moe import Routing, disable_router_noise, is_moe
from gspo.models.value import ValueModel
from gspo.parallel import comm
from gspo.parallel.holding import Holding, hold
from gspo.parallel.plan import Plan, make_plan
from gspo.parallel.strategy import choose as choose_strategy
from gspo.runlog.profiler import stage
from gspo.runtime import Runtime, to_device
from gspo.train.critic import Critic, hold_value_model
from gspo.train.exact import with_gradient_of
from gspo.train.schedule import lr_factor
from gspo.types import Batch, Rollout

log = logging.getLogger("gspo")


@dataclass
class StepOutput:
    """What one optimizer step leaves for the run log: metrics (0-dim tensors until the loop's one reduce), the rows
    trained and their new log-probs (detached, for the ratio diagnostics)."""

    metrics: dict[str, torch.Tensor | float]
    rows: torch.Tensor  # (mb,)
    logprobs: torch.Tensor  # (mb, T)
    # Under torchrun on a GPU: CUDA events at the step's start and after its backward, read once the step's metrics
    # reduce has synchronised (a synchronisation of their own would stop the host from queueing the optimizer step)
    compute_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


def prepare_model(cfg: Config, runtime: Runtime, model: torch.nn.Module
                  ) -> tuple[torch.nn.Module | None, Routing | None]:
    """Ready a loaded policy for RL before anything copies it (the engine) or holds it (the holding): on the device,
    dropout off, activation checkpointing as configured, router noise off; returns its frozen reference copy (loss.beta
    > 0 without LoRA) and, for an MoE policy, its routing hooks."""
    model.to(runtime.device)
    if disable_dropout(model):
        log.info("dropout disabled: the update must see the same policy as the old log-prob pass")
    if cfg.train.old_logprobs == "rollout" and runtime.autocast is not None and not cfg.rollout.exact:
        log.warning("train.old_logprobs = 'rollout' under bf16 autocast: the engine's log-probs differ from the "
                    "trainer's by ~0.02 per token, more than GSPO's clip range; use 'recompute' or model.precision = 'fp32'.")
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    # With LoRA the reference policy is the policy with its adapters off: no second copy.
    ref_model = (copy.deepcopy(model).eval().requires_grad_(False) if cfg.loss.beta > 0 and not cfg.lora.rank
                 else None)
    return ref_model, _routing(cfg, model)  # after the reference copy: the hooks belong to the policy only


def _routing(cfg: Config, model: torch.nn.Module) -> Routing | None:
    """Hooks on an MoE policy's routers (flip rate always; replay and the auxiliary loss as configured)."""
    moe = cfg.moe
    if not is_moe(model):
        if moe.routing_replay != "off" or moe.router_aux_loss_coef:
            raise UserError(f"moe.routing_replay / moe.router_aux_loss_coef are set, but {cfg.model.name!r} is a "
                            "dense model (no top-k routers); remove the [moe] settings or train an MoE model.")
        return None
    disable_router_noise(model)
    # rollout.exact: the gradient pass forces the exact pass's routes (gspo.models.moe); replay is refused with it
    routing = Routing(model, "exact" if cfg.rollout.exact else moe.routing_replay, moe.router_aux_loss_coef)
    log.info("MoE: %d routed layers, %d experts, top-%d; routing replay %s; router auxiliary loss %s",
             len(routing.routers), routing.num_experts, routing.top_k, routing.replay,
             f"x {moe.router_aux_loss_coef}" if moe.router_aux_loss_coef else
             "off for RL (moe.router_aux_loss_coef = 0; set it > 0 to add the load-balancing loss)")
    return routing


def build_actor(cfg: Config, runtime: Runtime, model: torch.nn.Module, strategy: str | None = None) -> "Actor":
    """An actor around ``model`` with no engine beside it (a tool or a test that trains without rollouts): prepared,
    held as ``strategy`` names (``single``, ``ddp``, ``fsdp``; default: what a run would choose)."""
    # PPO: the value model is a copy of the policy's starting weights (before any hooks, adapters or shards)
    value_model = (ValueModel(copy.deepcopy(model).to(runtime.device)) if cfg.loss.advantage_baseline == "critic"
                   else None)
    ref_model, routing = prepare_model(cfg, runtime, model)
    strategy = strategy or choose_strategy(cfg, model, runtime.device, runtime.world_size)
    holding = hold(strategy, model, runtime, cfg, ref_model=ref_model, prepare_forward=as_fsdp_forward)
    critic = hold_value_model(cfg, runtime, value_model, strategy) if value_model is not None else None
    return Actor(cfg, runtime, model, holding, ref_model=ref_model, routing=routing, critic=critic)


def _timing_events(plan: Plan, dev: torch.device):
    """Under torchrun on GPUs, two CUDA events around a step's compute (the first recorded now); else None."""
    if plan.world <= 1 or dev.type != "cuda":
        return None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


class Actor:
    """The policy as its holding holds it, its passes, learning-rate schedule and update (see the module docstring).
    Built once the policy is prepared (:func:`prepare_model`), the engine has its copy and the holding is built;
    ``critic``: PPO's value model as its own holding holds it (:func:`gspo.train.critic.hold_value_model`), trained
    beside the policy with the passes the policy's use."""

    def __init__(self, cfg: Config, runtime: Runtime, model: torch.nn.Module, holding: Holding, *,
                 ref_model: torch.nn.Module | None = None, routing: Routing | None = None,
                 critic: Holding | None = None):
        self.cfg = cfg
        self.runtime = runtime
        self.model = model
        self.holding = holding
        self.ref_model = ref_model
        self.routing = routing
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.lr_scale = 1.0  # lowered by each collapse-sentinel rollback
        self._on_device: dict[str, torch.Tensor] = {}  # the rollout batch's tensors on the device, sent once
        self._setup_passes()
        self.critic = None if critic is None else Critic(cfg, runtime, critic, self.packed, self.graphs is not None)
        self._modules = list(self.model.modules())

    def set_training(self, training: bool) -> None:
        """Train or eval mode for every module of the policy. ``Module.train()`` walks the module tree and goes through
        ``Module.__setattr__`` for each of a 30-layer model's ~1000 modules; it ran several times per optimizer step."""
        for module in self._modules:
            module.__dict__["training"] = training

    # ------------------------------------------------------------------------------------------ set-up

    def _setup_passes(self) -> None:
        """Packed sequences where a fast kernel runs them (or asked for), CUDA graphs of the packed passes on a GPU."""
        t, device = self.cfg.train, self.runtime.device
        compute_dtype = self.runtime.autocast or next(self.model.parameters()).dtype
        why_not = packing_unsupported(self.model.config)
        if self.cfg.model.gradient_checkpointing:  # recomputation in the backward runs after the packed attention is unset
            why_not = "model.gradient_checkpointing is on"
        if t.packing == "on" and why_not:
            raise UserError(f"train.packing = 'on' cannot be used here: {why_not}; set train.packing = 'off' or 'auto'.")
        self.packed = t.packing == "on" or (t.packing == "auto" and not why_not and packing_available(device, compute_dtype))
        use_graphs = (self.packed and device.type == "cuda" and t.cuda_graphs == "auto"
                      and not self.cfg.model.gradient_checkpointing)
        if use_graphs and self.holding.update_graphs_off:
            log.info("CUDA graphs of the update are off %s; the update runs eager", self.holding.update_graphs_off)
            use_graphs = False
        if use_graphs and self.routing is not None:
            log.info("CUDA graphs of the update are off for MoE models (the routing hooks index per batch); the "
                     "update runs eager")
            use_graphs = False
        self.graphs = PackedGraphs(self.model, self.runtime.autocast) if use_graphs else None
        self.exact = None  # rollout.exact: the engine's forward over packed rows (gspo.train.exact)
        if self.cfg.rollout.exact:
            from gspo.parallel.holding import Sharded
            from gspo.train.exact import ExactPass

            if isinstance(self.holding, Sharded):  # dist.strategy = "auto" chose FSDP for a large model
                raise UserError("rollout.exact is not built for FSDP, which dist.strategy chose for this model (the "
                                "exact pass needs whole weights); set dist.strategy = 'ddp', or set rollout.exact = "
                                "false.")
            # activation checkpointing: the update keeps the ordinary (checkpointed) pass's gradient
            self.exact = ExactPass(self.model, compute_dtype, device, chunk_size=t.logprob_chunk,
                                   use_graphs=device.type == "cuda" and t.cuda_graphs == "auto",
                                   own_backward=not self.cfg.model.gradient_checkpointing)

    # ------------------------------------------------------------------------------------------ what others read

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's ``(name, tensor)`` pairs for an engine's ``sync_weights`` (see :meth:`Holding.weights`)."""
        return self.holding.weights()

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``train.lr`` x rollback scale x schedule."""
        return self.cfg.train.lr * (self.lr_scale * lr_factor(self.cfg.train, step))

    def set_lr(self, step: int) -> None:
        """Put ``lr_at(step)`` in the optimizer (before that step, and on resume)."""
        self.holding.set_lr(self.lr_at(step))

    # ------------------------------------------------------------------------------------------ passes

    def logprobs(self, rollout: Rollout, rows: torch.Tensor | None = None, *, model: torch.nn.Module | None = None,
                 with_entropy: bool = False, graphs: bool = True,
                 pack_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``(n, T)`` (and entropies) of ``rows`` of ``rollout`` under ``model`` (default: the policy),
        differentiable when grad is enabled; CUDA graphs are used for the policy only, and not with ``graphs=False``
        (``pack_tokens``: the packed length their graph pads to at least, :meth:`Plan.pack_hint`)."""
        model = self.model if model is None else model
        r = rollout if rows is None else rollout.select(rows.tolist())
        routing = self.routing if model is self.model else None
        if self.exact is not None and model is self.model:  # rollout.exact: the engine's own numbers
            # dense: under grad the exact pass differentiates itself (gspo.kernels.exact_grad), entropies included
            own_grad = self.exact.differentiable or not torch.is_grad_enabled()
            exact, entropy = self.exact.logprobs(r.prompt_ids, r.completion_ids, r.completion_mask,
                                                 self.cfg.rollout.temperature, with_entropy and own_grad,
                                                 routing=routing, row_ids=rows, version=self.holding.weights_version,
                                                 pack_tokens=pack_tokens, graphs=graphs)
            if own_grad:
                return exact, entropy
            # MoE's update: those values, with the gradient of the ordinary pass at the same weights
            logp, entropy = self._logprobs(model, r, with_entropy, graphs, pack_tokens, routing, rows)
            return with_gradient_of(exact, logp), entropy
        return self._logprobs(model, r, with_entropy, graphs, pack_tokens, routing, rows)

    def _logprobs(self, model, r: Rollout, with_entropy: bool, graphs: bool, pack_tokens: int, routing,
                  rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask,
                                 temperature=self.cfg.rollout.temperature, pad_id=r.pad_id,
                                 chunk_size=self.cfg.train.logprob_chunk, with_entropy=with_entropy,
                                 autocast_dtype=self.runtime.autocast, packed=self.packed,
                                 graphs=self.graphs if graphs and model is self.model else None,
                                 routing=routing, row_ids=None if routing is None or rows is None else rows,
                                 pack_tokens=pack_tokens)

    @torch.no_grad()
    def frozen_logprobs(self, rollout: Rollout, micro_batches: list[torch.Tensor],
                        model: torch.nn.Module | None = None, *, adapters_off: bool = False,
                        pack_tokens: list[int] | None = None) -> torch.Tensor:
        """Log-probs ``(N, T)`` of a frozen policy (default: the current one; ``adapters_off``: the policy with its LoRA
        adapters disabled, the reference) over ``micro_batches`` (rows not in them stay 0), in eval mode, with the same
        rows and shapes as the update's passes (``pack_tokens``: each micro-batch's :meth:`Plan.pack_hint`)."""
        model = self.model if model is None else model
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=self.runtime.device)  # (N, T)
        was_training = self.model.training
        self.set_training(False)  # the reference model is built in eval mode and never leaves it
        try:
            # The captured graphs hold the adapters' kernels: the adapters-off pass runs eager.
            with self.holding.adapters_off() if adapters_off else contextlib.nullcontext():
                for i, rows in enumerate(micro_batches):
                    hint = pack_tokens[i] if pack_tokens else 0
                    out[to_device(rows, self.runtime.device)] = self.logprobs(rollout, rows, model=model,
                                                                              graphs=not adapters_off,
                                                                              pack_tokens=hint)[0]
        finally:
            self.set_training(was_training)
        return out

    # ------------------------------------------------------------------------------------------ the update

    def plan(self, n_rows: int, tokens: torch.Tensor | None = None) -> Plan:
        """This rollout batch's seeded shuffle, minibatches and micro-batches (:func:`gspo.parallel.plan.make_plan`;
        ``tokens``: each row's prompt + completion tokens, which balance the processes' slices under torchrun)."""
        t = self.cfg.train
        return make_plan(n_rows, t.minibatches, t.micro_batch_size, self.shuffle_gen, rank=self.runtime.rank,
                         world=self.runtime.world_size, tokens=tokens)

    def _share(self, values: torch.Tensor, plan: Plan, ks) -> None:
        """Fill ``values`` (N, T) at every process's rows of minibatches ``ks`` with what that process computed (a
        no-op in one process)."""
        if plan.world == 1 or not len(ks):
            return
        dev = values.device
        mine = to_device(plan.rows_of(plan.rank, ks), dev)
        every = to_device(torch.cat([plan.rows_of(r, ks) for r in range(plan.world)]), dev)
        values[every] = comm.gather_rows(values[mine])

    def prepare(self, batch: Batch, plan: Plan) -> None:
        """Fill ``batch.old_logprobs`` (and ``ref_logprobs`` with a reference model) before any weight changes, and send
        the batch's per-row tensors to the device once."""
        rollout, dev = batch.rollout, self.runtime.device
        self._on_device = {"loss_mask": to_device(batch.loss_mask, dev), "advantages": to_device(batch.advantages, dev),
                           "sampled": to_device(rollout.sampled, dev)}
        if self.critic is not None:  # PPO: the batch's rewards become GAE's advantages (N, T) by the value model's
            with stage("values"):  # (its mask stays the collect's: the mismatch correction's is the policy's)
                self._on_device["advantages"] = self.critic.prepare(batch, plan, self._on_device["loss_mask"],
                                                                    self._share)
            batch.advantages = self._on_device["advantages"].cpu()  # what samples.jsonl reports, per token
        replay = self.cfg.moe.routing_replay
        routing_pass = contextlib.nullcontext()
        if self.routing is not None:
            lengths = [len(p) + int(n) for p, n in zip(rollout.prompt_ids, rollout.completion_mask.sum(-1).tolist())]
            self.routing.begin_batch(len(lengths), max(lengths), dev)
            if replay == "rollout":  # R3: the engine's records, forced from the old-policy pass on
                self.routing.load_rollout_routes(rollout.routes, rollout.routes_mask)
                routing_pass = self.routing.updating()
            else:  # the old-policy pass records (R2 replays it; without replay, the flip rate compares with it)
                routing_pass = self.routing.recording()
        correction = self.cfg.loss.mismatch_correction
        if self.cfg.train.old_logprobs == "recompute":
            # Minibatch 0 fills its own rows from its update forward (see step); the others need the frozen pass now.
            # A mismatch correction needs every row's before the first update (its masks change the denominators).
            first = 1 if correction == "off" else 0
            later, hints = plan.micro_of(range(first, len(plan.micro)))
            with routing_pass:
                batch.old_logprobs = self.frozen_logprobs(rollout, later, pack_tokens=hints)  # (N, T)
            self._share(batch.old_logprobs, plan, range(first, len(plan.minibatches)))
            if replay == "rollout" and later:  # the trainer re-routing what the engine routed, same weights
                self.routing.sum_counts(comm.all_sum)
                batch.metrics["moe/engine_flip_rate"] = self.routing.flip_metrics()["moe/flip_rate"]
        else:
            batch.old_logprobs = to_device(rollout.logprobs, dev)
        self._on_device["weights"] = None
        if correction != "off":  # pi_old / pi_engine, and what it leaves out of the loss (gspo.algorithms.corrections)
            low, high = self.cfg.loss.mismatch_bounds or DEFAULT_BOUNDS[correction]
            engine = to_device(rollout.logprobs, dev)
            weights, kept, metrics = mismatch_weights(batch.old_logprobs, engine, self._on_device["loss_mask"],
                                                      correction, self.cfg.loss.level, low, high)
            self._on_device["loss_mask"], self._on_device["weights"] = kept, weights
            batch.metrics.update(metrics)
            batch.metrics.update(logprob_gap(engine, batch.old_logprobs, self._on_device["sampled"]))
        if self.ref_model is not None or (self.holding.peft is not None and self.cfg.loss.beta > 0):
            every, hints = plan.micro_of(range(len(plan.micro)))
            batch.ref_logprobs = self.frozen_logprobs(rollout, every, model=self.ref_model,
                                                      adapters_off=self.ref_model is None, pack_tokens=hints)
            self._share(batch.ref_logprobs, plan, range(len(plan.minibatches)))

    def step(self, batch: Batch, plan: Plan, k: int, step: int) -> StepOutput:
        """Optimizer step ``step`` (0-based, run-wide) on minibatch ``k`` of ``batch``: forward/backward per
        micro-batch, gradient clipping, AdamW. A non-finite loss or gradient norm skips the update (on the device with
        the fused optimizer); the caller counts it from the reduced ``loss`` and ``grad_norm``."""
        cfg, dev = self.cfg, self.runtime.device
        t_start, events = time.perf_counter(), _timing_events(plan, dev)
        rows = plan.minibatches[k]
        mask, adv = self._on_device["loss_mask"], self._on_device["advantages"]  # (N, T), (N,) or (N, T)
        old, ref = batch.old_logprobs, batch.ref_logprobs
        weights = self._on_device["weights"]  # (N, T) or None: the mismatch correction's
        on_policy_fill = cfg.train.old_logprobs == "recompute" and k == 0 and weights is None
        # Denominators of the whole minibatch, so micro-batches sum to its exact loss; rows left entirely out of the loss
        # (DAPO overlong filtering) do not count as sequences (the sequence-level TRL #6369).
        rows_dev = to_device(rows, dev)
        mb_mask = mask[rows_dev]  # (mb, T)
        loss_kw = dict(level=cfg.loss.level, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
                       aggregation=cfg.loss.aggregation, beta=cfg.loss.beta, max_length=cfg.rollout.max_new_tokens,
                       objective=cfg.loss.objective, sapo_tau=tuple(cfg.loss.sapo_tau or SAPO_TAU))
        counts = dict(num_seqs=mb_mask.any(-1).sum(), num_tokens=mb_mask.sum())
        mb_logp = torch.zeros(mb_mask.shape, dtype=torch.float32, device=dev)  # (mb, T) detached
        mb_ent = torch.zeros_like(mb_logp)
        loss_total = torch.zeros((), dtype=torch.float64, device=dev)
        self.set_training(True)
        graphed = self.graphs is not None or (self.exact is not None and self.exact.differentiable
                                              and self.exact.use_graphs)
        self.holding.zero_grad(keep_allocated=graphed)  # graphed backwards keep .grad allocated
        own = len(rows) // plan.world  # this process's slice of the minibatch, at rank x own
        start = plan.rank * own
        # FSDP averages gradients over the processes; each one's share of the (global-denominator) loss is scaled
        # back up so their average is the single-process gradient (DDP sums them: no scale).
        scale = self.holding.loss_scale
        aux_total = torch.zeros((), dtype=torch.float64, device=dev)
        replay = self.routing.updating() if self.routing is not None else contextlib.nullcontext()
        with replay, stage("forward_backward"):
            for j, sub in enumerate(plan.micro[k]):
                logp, ent = self.logprobs(batch.rollout, sub, with_entropy=True, pack_tokens=plan.pack_hint(k, j))
                sub_dev = to_device(sub, dev)
                if on_policy_fill:
                    old[sub_dev] = logp.detach()
                loss, _ = policy_loss(logp, old[sub_dev], adv[sub_dev], mask[sub_dev],
                                      ref_logp=None if ref is None else ref[sub_dev], with_metrics=False,
                                      weights=None if weights is None else weights[sub_dev], **counts, **loss_kw)
                aux = self.routing.aux_loss() if self.routing is not None else None
                if aux is not None:  # a mean over the micro-batch's tokens: weighted by its share of the minibatch
                    aux = aux * (len(sub) / len(rows))
                    aux_total += aux.detach().double()
                    loss = loss + aux
                with attention_context():
                    (loss * scale if scale != 1 else loss).backward()
                loss_total += loss.detach().double()
                mb_logp[start:start + len(sub)], mb_ent[start:start + len(sub)] = logp.detach(), ent
                start += len(sub)
        if plan.world > 1:  # every process's new log-probs: the diagnostics cover the whole minibatch
            with stage("share_logprobs"):
                share = slice(plan.rank * own, (plan.rank + 1) * own)
                # two collectives, not four: log-probs and entropies in one gather, loss and aux loss in one sum
                mb_logp, mb_ent = comm.gather_rows(torch.stack([mb_logp[share], mb_ent[share]], 1)).unbind(1)
                if on_policy_fill:
                    old[rows_dev] = mb_logp
                loss_total, aux_total = comm.all_sum(torch.stack([loss_total, aux_total])).unbind()
        moe_metrics = {}
        if self.routing is not None:
            self.routing.sum_counts(comm.all_sum)  # before the gradient sum starts: it would queue behind it
            # Minibatch 0 under recompute is trained by the old policy itself: no flip to count there (R3 compares
            # with the engine's routing, so it has one).
            moe_metrics = {} if on_policy_fill and self.cfg.moe.routing_replay != "rollout" else self.routing.flip_metrics()
            moe_metrics["moe/record_mb"] = self.routing.record_bytes() / 2**20
            if self.cfg.moe.router_aux_loss_coef:
                moe_metrics["moe/aux_loss"] = aux_total
        # DDP: the gradient sum, started now so that it runs under the diagnostics below (waited for in _apply)
        with stage("sum_gradients"):
            pending = self.holding.start_gradient_sum()
        self._engine_gap(batch, k, on_policy_fill, old, rows_dev, mb_logp)
        # diagnostics over the whole minibatch at once (exact whatever the micro-batching)
        with torch.no_grad(), stage("step_metrics"):
            _, metrics = policy_loss(mb_logp, old[rows_dev], adv[rows_dev], mb_mask,
                                     ref_logp=None if ref is None else ref[rows_dev],
                                     weights=None if weights is None else weights[rows_dev], **loss_kw)
        completion = self._on_device["sampled"][rows_dev]  # (mb, T)
        tokens = completion.sum()
        metrics["entropy"] = torch.where(completion, mb_ent, 0.0).sum() / tokens.clamp(min=1)
        metrics["loss"] = loss_total
        # How long this process took to its gradient (the job's slowest and fastest are logged): on a GPU the events'
        # interval, which the caller reads once the device reaches the second and sends in its one reduce; on the CPU,
        # where nothing is queued, the clock now
        if events is not None:
            events[1].record()
        elif plan.world > 1:
            metrics["dist/compute_max_s"] = metrics["dist/compute_min_s"] = time.perf_counter() - t_start
        with stage("apply"):
            metrics["grad_norm"] = self._apply(loss_total, step, pending)
        if self.critic is not None:
            with stage("critic"):
                metrics.update(self.critic.step(batch, plan, k))
        metrics["trained_tokens"] = tokens
        metrics.update(moe_metrics)
        self.set_training(False)
        return StepOutput(metrics, rows, mb_logp, events)

    def _engine_gap(self, batch: Batch, k: int, on_policy_fill: bool, old: torch.Tensor, rows_dev: torch.Tensor,
                    mb_logp: torch.Tensor) -> None:
        """``logprob/engine_diff_*`` once the trainer has its own numbers at the weights that sampled the batch: every
        row's recomputed old log-probs (after minibatch 0 under ``recompute``), or under ``rollout.exact`` with the
        engine's log-probs as the old ones, minibatch 0's update forward (0.0 is the proof of exactness)."""
        cfg, dev = self.cfg, self.runtime.device
        if on_policy_fill:  # every row's old log-probs exist from here on
            batch.metrics.update(logprob_gap(to_device(batch.rollout.logprobs, dev), old, self._on_device["sampled"]))
        elif (self.exact is not None and k == 0 and cfg.train.old_logprobs == "rollout"
              and cfg.rollout.max_staleness == 0):
            batch.metrics.update(logprob_gap(to_device(batch.rollout.logprobs, dev)[rows_dev], mb_logp,
                                             self._on_device["sampled"][rows_dev]))

    def _apply(self, loss: torch.Tensor, step: int, pending: list) -> torch.Tensor:
        """Clip and apply the accumulated gradient at ``lr_at(step)``, unless the loss or the gradient is not finite
        (``pending``: the gradient sum's works under DDP, waited for here)."""
        with stage("clip"):
            grad_norm = self.holding.clip(self.cfg.train.max_grad_norm, pending)
        self.set_lr(step)
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.critic is not None and step // self.cfg.train.minibatches < self.cfg.ppo.critic_warmup:
            bad = torch.ones_like(bad)  # ppo.critic_warmup: only the value model trains on this rollout batch
        self.holding.apply(bad)
        return grad_norm

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What a checkpoint's ``trainer_state.pt`` holds of the actor (the optimizer unless the holding writes it to
        DCP; see :func:`gspo.checkpoint.save_sharded`)."""
        out = {"shuffle_gen": self.shuffle_gen.get_state(), "lr_scale": self.lr_scale}
        optimizer = self.holding.optimizer_state()
        if optimizer is not None:
            out["optimizer"] = optimizer
        if self.critic is not None:
            out.update(self.critic.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the optimizer and shuffle; the config's ``train.lr`` wins over the checkpoint's (resuming with a
        lower one is how a user reacts to instability), and a rollback's lower scale is kept."""
        if "optimizer" in state:
            self.holding.load_optimizer_state(state["optimizer"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        self.lr_scale = min(self.lr_scale, state.get("lr_scale", 1.0))
        if self.critic is not None:
            if "critic" not in state:
                raise UserError("The checkpoint has no value model (it was written by a run without a critic); resume "
                                "it with its own algorithm, or start a new PPO run.")
            self.critic.load_state_dict(state)
