"""The actor: the policy being trained (and its frozen reference), its optimizer and learning-rate schedule, and the
log-prob passes of the update (padded, packed, or packed and CUDA-graphed).

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
from pathlib import Path

import torch

from gspo import dist
from gspo.algorithms import logprob_gap, policy_loss
from gspo.checkpoint import DCP_DIR, by_name, load_model_weights, load_sharded, read_full_weights
from gspo.config import Config
from gspo.dist import slice_of
from gspo.errors import UserError
from gspo.logprobs import PackedGraphs, packing_available, packing_unsupported, sequence_logprobs
from gspo.models import attention_context, disable_dropout, named_weights
from gspo.models.moe import Routing, disable_router_noise, is_moe
from gspo.runlog.profiler import stage
from gspo.runtime import Runtime, to_device
from gspo.train.schedule import lr_factor
from gspo.types import Batch, Rollout

log = logging.getLogger("gspo")


@dataclass
class Plan:
    """How one rollout batch is cut for the update: ``minibatches[k]`` are the rows of optimizer step ``k``,
    ``micro[k]`` the same rows in forward/backward chunks of ``train.micro_batch_size``."""

    minibatches: list[torch.Tensor]  # k -> (mb,) int64 rows
    micro: list[list[torch.Tensor]]  # k -> chunks of this process's rows of minibatches[k]
    world: int = 1  # processes of the job; rank r trains the r-th contiguous slice of every minibatch
    rank: int = 0
    # Under torchrun: k -> for each micro-batch, the largest packed length (prompt + completion tokens) that any
    # process has at it; the CUDA-graphed passes pad to its bucket, so that the processes share graph shapes
    pack_tokens: list[list[int]] | None = None

    def pack_hint(self, k: int, j: int) -> int:
        """The packed length micro-batch ``j`` of minibatch ``k`` pads to at least (0: its own)."""
        return self.pack_tokens[k][j] if self.pack_tokens is not None else 0

    def micro_of(self, ks) -> tuple[list[torch.Tensor], list[int]]:
        """This process's micro-batches of minibatches ``ks``, in order, and the packed length each pads to at least."""
        pairs = [(rows, self.pack_hint(k, j)) for k in ks for j, rows in enumerate(self.micro[k])]
        return [rows for rows, _ in pairs], [hint for _, hint in pairs]

    def rows_of(self, rank: int, ks) -> torch.Tensor:
        """The rows rank ``rank`` trains in minibatches ``ks``."""
        return torch.cat([slice_of(self.minibatches[k], rank, self.world) for k in ks])


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


class Actor:
    """Model, optimizer, schedule and passes of one run (see the module docstring).

    Under ``torchrun`` (several processes) the actor is ready once :meth:`shard` has run: the rollout engine first
    takes its own full copy of the weights, then FSDP2 shards the policy (see :mod:`gspo.dist`)."""

    def __init__(self, cfg: Config, runtime: Runtime, model: torch.nn.Module):
        self.cfg = cfg
        self.runtime = runtime
        self.model = model
        self.sharded = False  # FSDP2 (dist.strategy = fsdp)
        self.replicated = False  # a whole copy in each of several processes (dist.strategy = ddp)
        self.peft = None  # the PeftModel around the policy, once adapt() has injected LoRA adapters
        self._setup_model()
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.lr_scale = 1.0  # lowered by each collapse-sentinel rollback
        self._on_device: dict[str, torch.Tensor] = {}  # the rollout batch's tensors on the device, sent once
        if runtime.world_size == 1 and not cfg.lora.rank:
            self._finish_setup()

    def adapt(self) -> None:
        """With ``lora.rank > 0``: inject the LoRA adapters (after the engine copied the plain model), then set up the
        passes and an optimizer over the adapters alone. Nothing to do otherwise."""
        if not self.cfg.lora.rank or self.peft is not None:
            return
        from gspo.models import lora

        self.peft = lora.apply(self.model, self.cfg.lora, self.cfg.model.name)
        if self.replicated:  # every process starts from rank 0's random adapters
            dist.replicate(trainable_parameters(self.model))
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        log.info("LoRA: rank %d, alpha %g on %s: %d trainable parameters of %d (%.2f%%); the engine samples from the "
                 "merged weights", self.cfg.lora.rank, self.cfg.lora.alpha, ", ".join(self.cfg.lora.target_modules),
                 trainable, total, 100 * trainable / total)
        self._finish_setup()

    @property
    def distributed(self) -> bool:
        return self.sharded or self.replicated

    @property
    def collective_checkpoint(self) -> bool:
        """Whether every process writes its shards of the policy and optimizer (DCP; see
        :func:`gspo.checkpoint.save_sharded`). Not in one process, and not with LoRA under torchrun: the adapter and its
        optimizer are the same in every process, and rank 0 writes them as one process does."""
        return self.distributed and self.peft is None

    def shard(self, strategy: str | None = "fsdp") -> None:
        """Under ``torchrun``: shard the policy (and the reference model) with FSDP2 (``strategy = "fsdp"``), or keep
        it whole in every process with rank 0's weights (``"ddp"``), then set up the passes and the optimizer. Nothing
        to do in one process."""
        if self.runtime.world_size == 1 or self.distributed:
            return
        if strategy == "ddp":
            dist.replicate(self.model.parameters())
            if self.ref_model is not None:
                dist.replicate(self.ref_model.parameters())
            self.replicated = True
            log.info("DDP: every one of the %d processes holds the whole policy; gradients, views of one flat buffer, "
                     "are summed with one all-reduce before each optimizer step", self.runtime.world_size)
            if not self.cfg.lora.rank:  # with LoRA, adapt() sets up once the adapters (the trainable part) exist
                self._finish_setup()
            return
        dist.shard(self.model, self.runtime.autocast)
        if self.ref_model is not None:
            dist.shard(self.ref_model, self.runtime.autocast)
        self.sharded = True
        log.info("FSDP2: the policy is sharded over %d processes (one unit per decoder layer; embeddings, final norm "
                 "and LM head in the root unit)", self.runtime.world_size)
        self._finish_setup()

    def _finish_setup(self) -> None:
        self._setup_passes()
        self._setup_optimizer()
        self._modules = list(self.model.modules())
        # DDP: the gradients live in flat buffers that the all-reduce sums in place (None in one process and under FSDP)
        self._grad_buffers = dist.flat_gradients(trainable_parameters(self.model)) if self.replicated else None

    def set_training(self, training: bool) -> None:
        """Train or eval mode for every module of the policy. ``Module.train()`` walks the module tree and goes through
        ``Module.__setattr__`` for each of a 30-layer model's ~1000 modules; it ran several times per optimizer step."""
        for module in self._modules:
            module.__dict__["training"] = training

    # ------------------------------------------------------------------------------------------ set-up

    def _setup_model(self) -> None:
        cfg = self.cfg
        self.model.to(self.runtime.device)
        if disable_dropout(self.model):
            log.info("dropout disabled: the update must see the same policy as the old log-prob pass")
        if cfg.train.old_logprobs == "rollout" and self.runtime.autocast is not None:
            log.warning("train.old_logprobs = 'rollout' under bf16 autocast: the engine's log-probs differ from the "
                        "trainer's by ~0.02 per token, more than GSPO's clip range; use 'recompute' or model.precision = 'fp32'.")
        if cfg.model.gradient_checkpointing:
            # transformers 5.2x renamed the method; 5.17 (the GPU image) only has the old name.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # With LoRA the reference policy is the policy with its adapters off: no second copy.
        self.ref_model = (copy.deepcopy(self.model).eval().requires_grad_(False) if cfg.loss.beta > 0
                          and not cfg.lora.rank else None)
        self.routing = self._setup_routing()  # after the reference copy: its hooks belong to the policy only

    def _setup_routing(self) -> Routing | None:
        """Hooks on an MoE policy's routers (flip rate always; replay and the auxiliary loss as configured)."""
        moe = self.cfg.moe
        if not is_moe(self.model):
            if moe.routing_replay != "off" or moe.router_aux_loss_coef:
                raise UserError(f"moe.routing_replay / moe.router_aux_loss_coef are set, but {self.cfg.model.name!r} is a "
                                "dense model (no top-k routers); remove the [moe] settings or train an MoE model.")
            return None
        disable_router_noise(self.model)
        routing = Routing(self.model, moe.routing_replay, moe.router_aux_loss_coef)
        log.info("MoE: %d routed layers, %d experts, top-%d; routing replay %s; router auxiliary loss %s",
                 len(routing.routers), routing.num_experts, routing.top_k, moe.routing_replay,
                 f"x {moe.router_aux_loss_coef}" if moe.router_aux_loss_coef else
                 "off for RL (moe.router_aux_loss_coef = 0; set it > 0 to add the load-balancing loss)")
        return routing

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
        if use_graphs and self.sharded:
            log.info("CUDA graphs of the update are off under FSDP (its collectives run between the layers); the "
                     "update runs eager")
            use_graphs = False
        if use_graphs and self.routing is not None:
            log.info("CUDA graphs of the update are off for MoE models (the routing hooks index per batch); the "
                     "update runs eager")
            use_graphs = False
        self.graphs = PackedGraphs(self.model, self.runtime.autocast) if use_graphs else None

    def _setup_optimizer(self) -> None:
        t = self.cfg.train
        # One fused kernel for the whole AdamW update on CUDA (the per-tensor loop is ~6 ms per step at 135M); it also
        # skips a non-finite step on the device (found_inf), so the step needs no host sync to decide.
        self.fused_optimizer = (self.runtime.device.type == "cuda" and not self.sharded
                                and all(p.dtype == torch.float32 for p in self.model.parameters()))
        if self.sharded and self.runtime.device.type == "cuda":
            log.info("AdamW: the multi-tensor (foreach) implementation on the sharded parameters")
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.model), lr=t.lr, betas=tuple(t.adam_betas),
                                           weight_decay=t.weight_decay, fused=self.fused_optimizer or None)

    # ------------------------------------------------------------------------------------------ what others read

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's ``(name, tensor)`` pairs for an engine's ``sync_weights`` (under FSDP each full tensor is
        gathered as it is read: every process must read them all)."""
        if self.peft is not None:
            from gspo.models.lora import merged_weights

            return merged_weights(self.model)
        return dist.full_weights(self.model) if self.sharded else named_weights(self.model)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``train.lr`` x rollback scale x schedule."""
        return self.cfg.train.lr * (self.lr_scale * lr_factor(self.cfg.train, step))

    def set_lr(self, step: int) -> None:
        """Put ``lr_at(step)`` in the optimizer (before that step, and on resume)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)

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
            with self.peft.disable_adapter() if adapters_off else contextlib.nullcontext():
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
        """A seeded shuffle of ``n_rows`` rows cut into ``train.minibatches`` minibatches of micro-batches. Under
        torchrun, with each row's ``tokens`` (prompt + completion), every minibatch's rows are ordered so that the
        processes' slices hold near-equal token counts (:func:`gspo.dist.balance`)."""
        t = self.cfg.train
        rank, world = self.runtime.rank, self.runtime.world_size
        order = torch.randperm(n_rows, generator=self.shuffle_gen)
        mb = n_rows // t.minibatches
        minibatches = [order[k * mb:(k + 1) * mb] for k in range(t.minibatches)]
        if world > 1 and tokens is not None:
            minibatches = [dist.balance(rows, tokens, world) for rows in minibatches]
        micro = t.micro_batch_size or mb // world
        pack = dist.largest_micro_batches(minibatches, tokens, world, micro) if world > 1 and tokens is not None else None
        return Plan(minibatches, [dist.micro_batches(rows, rank, world, micro) for rows in minibatches], world, rank,
                    pack)

    def _share(self, values: torch.Tensor, plan: Plan, ks) -> None:
        """Fill ``values`` (N, T) at every process's rows of minibatches ``ks`` with what that process computed (a
        no-op in one process)."""
        if plan.world == 1 or not len(ks):
            return
        dev = values.device
        mine = to_device(plan.rows_of(plan.rank, ks), dev)
        every = to_device(torch.cat([plan.rows_of(r, ks) for r in range(plan.world)]), dev)
        values[every] = dist.gather_rows(values[mine])

    def prepare(self, batch: Batch, plan: Plan) -> None:
        """Fill ``batch.old_logprobs`` (and ``ref_logprobs`` with a reference model) before any weight changes, and send
        the batch's per-row tensors to the device once."""
        rollout, dev = batch.rollout, self.runtime.device
        self._on_device = {"loss_mask": to_device(batch.loss_mask, dev), "advantages": to_device(batch.advantages, dev),
                           "completion_mask": to_device(rollout.completion_mask, dev)}
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
        if self.cfg.train.old_logprobs == "recompute":
            # Minibatch 0 fills its own rows from its update forward (see step); the others need the frozen pass now.
            later, hints = plan.micro_of(range(1, len(plan.micro)))
            with routing_pass:
                batch.old_logprobs = self.frozen_logprobs(rollout, later, pack_tokens=hints)  # (N, T)
            self._share(batch.old_logprobs, plan, range(1, len(plan.minibatches)))
            if replay == "rollout" and later:  # the trainer re-routing what the engine routed, same weights
                self.routing.sum_counts(dist.all_sum)
                batch.metrics["moe/engine_flip_rate"] = self.routing.flip_metrics()["moe/flip_rate"]
        else:
            batch.old_logprobs = to_device(rollout.logprobs, dev)
        if self.ref_model is not None or (self.peft is not None and self.cfg.loss.beta > 0):
            every, hints = plan.micro_of(range(len(plan.micro)))
            batch.ref_logprobs = self.frozen_logprobs(rollout, every, model=self.ref_model,
                                                      adapters_off=self.ref_model is None, pack_tokens=hints)
            self._share(batch.ref_logprobs, plan, range(len(plan.minibatches)))

    def step(self, batch: Batch, plan: Plan, k: int, step: int) -> StepOutput:
        """Optimizer step ``step`` (0-based, run-wide) on minibatch ``k`` of ``batch``: forward/backward per
        micro-batch, gradient clipping, AdamW. A non-finite loss or gradient norm skips the update (on the device with
        the fused optimizer); the caller counts it from the reduced ``loss`` and ``grad_norm``."""
        cfg, dev = self.cfg, self.runtime.device
        t_start = time.perf_counter()
        events = None
        if plan.world > 1 and dev.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        rows = plan.minibatches[k]
        mask, adv = self._on_device["loss_mask"], self._on_device["advantages"]  # (N, T), (N,) or (N, T)
        old, ref = batch.old_logprobs, batch.ref_logprobs
        on_policy_fill = cfg.train.old_logprobs == "recompute" and k == 0
        # Denominators of the whole minibatch, so micro-batches sum to its exact loss; rows left entirely out of the loss
        # (DAPO overlong filtering) do not count as sequences (the sequence-level TRL #6369).
        rows_dev = to_device(rows, dev)
        mb_mask = mask[rows_dev]  # (mb, T)
        loss_kw = dict(level=cfg.loss.level, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
                       aggregation=cfg.loss.aggregation, beta=cfg.loss.beta, max_length=cfg.rollout.max_new_tokens)
        counts = dict(num_seqs=mb_mask.any(-1).sum(), num_tokens=mb_mask.sum())
        mb_logp = torch.zeros(mb_mask.shape, dtype=torch.float32, device=dev)  # (mb, T) detached
        mb_ent = torch.zeros_like(mb_logp)
        loss_total = torch.zeros((), dtype=torch.float64, device=dev)
        self.set_training(True)
        if self._grad_buffers is not None:  # the gradients must stay views of the buffers
            torch._foreach_zero_(self._grad_buffers)
        else:
            self.optimizer.zero_grad(set_to_none=self.graphs is None)  # graphed backwards keep .grad allocated
        own = len(rows) // plan.world  # this process's slice of the minibatch, at rank x own
        start = plan.rank * own
        # FSDP averages gradients over the processes; each one's share of the (global-denominator) loss is scaled
        # back up so their average is the single-process gradient (DDP sums them: no scale).
        scale = float(plan.world) if self.sharded else 1.0
        aux_total = torch.zeros((), dtype=torch.float64, device=dev)
        replay = self.routing.updating() if self.routing is not None else contextlib.nullcontext()
        with replay, stage("forward_backward"):
            for j, sub in enumerate(plan.micro[k]):
                logp, ent = self.logprobs(batch.rollout, sub, with_entropy=True, pack_tokens=plan.pack_hint(k, j))
                sub_dev = to_device(sub, dev)
                if on_policy_fill:
                    old[sub_dev] = logp.detach()
                loss, _ = policy_loss(logp, old[sub_dev], adv[sub_dev], mask[sub_dev],
                                      ref_logp=None if ref is None else ref[sub_dev], with_metrics=False, **counts,
                                      **loss_kw)
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
                mb_logp, mb_ent = dist.gather_rows(torch.stack([mb_logp[share], mb_ent[share]], 1)).unbind(1)
                if on_policy_fill:
                    old[rows_dev] = mb_logp
                loss_total, aux_total = dist.all_sum(torch.stack([loss_total, aux_total])).unbind()
        moe_metrics = {}
        if self.routing is not None:
            self.routing.sum_counts(dist.all_sum)  # before the gradient sum starts: it would queue behind it
            # Minibatch 0 under recompute is trained by the old policy itself: no flip to count there (R3 compares
            # with the engine's routing, so it has one).
            moe_metrics = {} if on_policy_fill and self.cfg.moe.routing_replay != "rollout" else self.routing.flip_metrics()
            moe_metrics["moe/record_mb"] = self.routing.record_bytes() / 2**20
            if self.cfg.moe.router_aux_loss_coef:
                moe_metrics["moe/aux_loss"] = aux_total
        pending = []  # DDP: the gradient sum, started now so that it runs under the diagnostics below (see _apply)
        if self.replicated:
            with stage("sum_gradients"):
                pending = dist.sum_gradients(self._grad_buffers)
        if on_policy_fill:  # every row's old log-probs exist from here on
            batch.metrics.update(logprob_gap(to_device(batch.rollout.logprobs, dev), old,
                                             self._on_device["completion_mask"]))
        # diagnostics over the whole minibatch at once (exact whatever the micro-batching)
        with torch.no_grad(), stage("step_metrics"):
            _, metrics = policy_loss(mb_logp, old[rows_dev], adv[rows_dev], mb_mask,
                                     ref_logp=None if ref is None else ref[rows_dev], **loss_kw)
        completion = self._on_device["completion_mask"][rows_dev]  # (mb, T)
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
        metrics["trained_tokens"] = tokens
        metrics.update(moe_metrics)
        self.set_training(False)
        return StepOutput(metrics, rows, mb_logp, events)

    def _apply(self, loss: torch.Tensor, step: int, pending: list) -> torch.Tensor:
        """Clip and apply the accumulated gradient at ``lr_at(step)``, unless the loss or the gradient is not finite
        (``pending``: the gradient sum's works under DDP, waited for here)."""
        t = self.cfg.train
        for work in pending:
            work.wait()
        with stage("clip"):
            grad_norm = dist.full_value(torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), t.max_grad_norm if t.max_grad_norm > 0 else float("inf")))
        self.set_lr(step)
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.fused_optimizer:
            self.optimizer.found_inf = bad.float().to(grad_norm.device)  # read by fused AdamW: skips on the device
            self.optimizer.step()
        elif not bool(bad):
            self.optimizer.step()
        return grad_norm

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What a checkpoint's ``trainer_state.pt`` holds of the actor (under torchrun the optimizer goes to DCP; see
        :func:`gspo.checkpoint.save_sharded`)."""
        out = {"shuffle_gen": self.shuffle_gen.get_state(), "lr_scale": self.lr_scale}
        if not self.collective_checkpoint:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def load_weights(self, ckpt: Path) -> None:
        """The policy's weights from checkpoint ``ckpt`` (and the optimizer too, from a sharded checkpoint's DCP
        files), whichever number of processes wrote it."""
        if self.peft is not None:  # the base weights are model.name's; the checkpoint holds the adapter
            from gspo.models import lora

            if not lora.is_adapter(ckpt):
                raise UserError(f"Checkpoint {ckpt} holds full weights, not a LoRA adapter; resume it with lora.rank = "
                                "0, or start a new run.")
            lora.load_adapter(self.peft, ckpt)
        elif (ckpt / DCP_DIR).is_dir():
            load_sharded(ckpt, self.model, self.optimizer)
        elif self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, read_full_weights(self.model, ckpt),
                                 options=StateDictOptions(full_state_dict=True))
        else:
            load_model_weights(self.model, ckpt)

    def load_state_dict(self, state: dict) -> None:
        """Restore the optimizer and shuffle; the config's ``train.lr`` wins over the checkpoint's (resuming with a
        lower one is how a user reacts to instability), and a rollback's lower scale is kept."""
        if "optimizer" in state and self.sharded:  # a one-process checkpoint resumed under torchrun
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, by_name(self.model, state["optimizer"]),
                                     options=StateDictOptions(full_state_dict=True))
        elif "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        self.lr_scale = min(self.lr_scale, state.get("lr_scale", 1.0))


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them, or the adapters alone with LoRA (peft freezes the rest)."""
    return [p for p in model.parameters() if p.requires_grad]
