"""How this process holds the policy, as one value: a :class:`Holding` owns the trainable parameters, the optimizer
and its state, the weights handed to the engine's ``sync_weights``, the loss scale, the gradient sum over processes,
the gradient norm, and what a checkpoint of the policy saves and loads.

Three ways to hold it:

    Holding      one process, the whole policy (the base class, which the other two specialise)
    Replicated   a whole copy in each of several processes, gradients summed (DDP; ``dist.strategy = "ddp"``)
    Sharded      the policy sharded over the processes (FSDP2; ``"fsdp"``)

LoRA adapters (``lora.rank > 0``) are an option of the first two: the frozen base has no gradients or optimizer state
to shard, so every process holds it whole. A holding is built after the rollout engine took its own copy of the
plain weights (it shards or adapts the policy in place) and is final once built: the actor asks it, never branches on
which one it is. PPO's value model is held the same way (:func:`hold` with ``value_model=True``), beside the
policy.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gspo.checkpoint import DCP_DIR, by_index, by_name, load_model_weights, load_sharded, read_full_weights
from gspo.errors import UserError
from gspo.models import named_weights
from gspo.parallel import ddp, fsdp

log = logging.getLogger("gspo")


class Holding:
    """One process's whole policy (the base of the other holdings; see the module docstring)."""

    name = "single"
    loss_scale = 1.0  # backward's multiplier of this process's share of the loss (FSDP averages over processes)
    collective_checkpoint = False  # every process writes its shards of the policy and optimizer (DCP)
    update_graphs_off: str | None = None  # why the update's CUDA graphs cannot run under this holding (None: they can)

    def __init__(self, model: torch.nn.Module, runtime, train_cfg, *, lora_cfg=None, model_name: str = ""):
        self.model = model
        self.runtime = runtime
        self.peft = None  # the PeftModel around the policy with LoRA adapters
        if lora_cfg is not None and lora_cfg.rank:
            self.peft = self._adapt(lora_cfg, model_name)
        self.parameters = [p for p in model.parameters() if p.requires_grad]  # the adapters alone with LoRA
        self.optimizer = self._optimizer(train_cfg)
        # Counts the changes of the policy's weights (optimizer steps and loads, the only two): a copy of them tagged
        # with it is current while it is unchanged (rollout.exact's pass). Version counters cannot tell: fused AdamW
        # updates parameters in place without bumping them.
        self.weights_version = 0

    def _adapt(self, lora_cfg, model_name: str):
        """Inject the LoRA adapters (the engine already copied the plain model)."""
        from gspo.models import lora

        peft = lora.apply(self.model, lora_cfg, model_name)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        log.info("LoRA: rank %d, alpha %g on %s: %d trainable parameters of %d (%.2f%%); the engine samples from the "
                 "merged weights", lora_cfg.rank, lora_cfg.alpha, ", ".join(lora_cfg.target_modules), trainable, total,
                 100 * trainable / total)
        return peft

    def _fused(self) -> bool:
        """One fused kernel for the whole AdamW update on CUDA (the per-tensor loop is ~6 ms per step at 135M); it also
        skips a non-finite step on the device (found_inf), so the step needs no host sync to decide."""
        return self.runtime.device.type == "cuda" and all(p.dtype == torch.float32 for p in self.model.parameters())

    def _optimizer(self, t) -> torch.optim.Optimizer:
        self.fused_optimizer = self._fused()
        return torch.optim.AdamW(self.parameters, lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                 fused=self.fused_optimizer or None)

    # ------------------------------------------------------------------------------------------ what others read

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's ``(name, tensor)`` pairs for an engine's ``sync_weights`` (with LoRA: merged)."""
        if self.peft is not None:
            from gspo.models.lora import merged_weights

            return merged_weights(self.model)
        return named_weights(self.model)

    def adapters_off(self):
        """A context in which the policy is its base (LoRA's reference policy); only with LoRA."""
        return self.peft.disable_adapter()

    # ------------------------------------------------------------------------------------------ the update

    def zero_grad(self, keep_allocated: bool) -> None:
        """Zero the gradients before a step (``keep_allocated``: captured backward graphs write into them)."""
        self.optimizer.zero_grad(set_to_none=not keep_allocated)

    def start_gradient_sum(self) -> list:
        """Start combining this process's gradients with the others'; returns the pending works (none here)."""
        return []

    def clip(self, max_norm: float, pending: list) -> torch.Tensor:
        """Wait for ``pending`` (the gradient sum), clip the gradient to ``max_norm`` (<= 0: no clip) and return its
        norm before clipping."""
        for work in pending:
            work.wait()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        return fsdp.full_value(norm)

    def apply(self, bad: torch.Tensor) -> None:
        """The optimizer step, unless ``bad`` (a 0-dim bool tensor: loss or gradient not finite): on the device with
        the fused optimizer, after a host read otherwise."""
        self.weights_version += 1
        if self.fused_optimizer:
            self.optimizer.found_inf = bad.float().to(self.runtime.device)  # read by fused AdamW: skips on the device
            self.optimizer.step()
        elif not bool(bad):
            self.optimizer.step()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------------------------------ checkpoints

    def optimizer_state(self) -> dict | None:
        """The optimizer's state for ``trainer_state.pt`` (None where the checkpoint's DCP files hold it)."""
        return None if self.collective_checkpoint else self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def whole_state(self) -> tuple[dict, dict]:
        """The model's weights and its optimizer's state, whole (under FSDP gathered to rank 0's CPU: a collective
        every process calls), the optimizer's keyed by parameter name so that any process count and holding loads
        it: how ``trainer_state.pt`` holds PPO's value model."""
        return self.model.state_dict(), by_name(self.model, self.optimizer.state_dict())

    def load_whole_state(self, weights: dict, optimizer: dict) -> None:
        """:meth:`whole_state`'s inverse (``optimizer`` keyed by name, or by index as older checkpoints wrote it)."""
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(by_index(self.model, optimizer) if _by_name(optimizer) else optimizer)

    def load_weights(self, ckpt: Path) -> None:
        """The policy's weights from checkpoint ``ckpt`` (and the optimizer too, from a sharded checkpoint's DCP
        files), whichever number of processes wrote it."""
        self.weights_version += 1
        if self.peft is not None:  # the base weights are model.name's; the checkpoint holds the adapter
            from gspo.models import lora

            if not lora.is_adapter(ckpt):
                raise UserError(f"Checkpoint {ckpt} holds full weights, not a LoRA adapter; resume it with lora.rank = "
                                "0, or start a new run.")
            lora.load_adapter(self.peft, ckpt)
        elif (ckpt / DCP_DIR).is_dir():
            load_sharded(ckpt, self.model, self.optimizer)
        else:
            self._load_full_weights(ckpt)

    def _load_full_weights(self, ckpt: Path) -> None:
        load_model_weights(self.model, ckpt)

    def save(self, writer, state, parts: dict[str, Any], tokenizer, keep: int, t_start: float) -> None:
        """Start writing checkpoint ``step-<state.step>`` through ``writer`` (a ``CheckpointWriter``): in the
        background, from this process alone."""
        writer.submit(state, parts, self.peft or self.model, tokenizer, keep, t_start)


class Replicated(Holding):
    """A whole copy of the policy in each of several processes, starting from rank 0's values; gradients are views of
    flat buffers, summed with one asynchronous all-reduce each before the optimizer step (see :mod:`.ddp`)."""

    name = "ddp"

    def __init__(self, model, runtime, train_cfg, *, ref_model=None, lora_cfg=None, model_name: str = ""):
        ddp.replicate(model.parameters())
        if ref_model is not None:
            ddp.replicate(ref_model.parameters())
        log.info("DDP: every one of the %d processes holds the whole policy; gradients, views of one flat buffer, "
                 "are summed with one all-reduce before each optimizer step", runtime.world_size)
        super().__init__(model, runtime, train_cfg, lora_cfg=lora_cfg, model_name=model_name)
        if self.peft is not None:  # every process starts from rank 0's random adapters
            ddp.replicate(self.parameters)
        # With LoRA the adapter and its optimizer are the same in every process: rank 0 writes them as one process does
        self.collective_checkpoint = self.peft is None
        self.grad_buffers = ddp.flat_gradients(self.parameters)

    def zero_grad(self, keep_allocated: bool) -> None:
        torch._foreach_zero_(self.grad_buffers)  # the gradients must stay views of the buffers

    def start_gradient_sum(self) -> list:
        return ddp.sum_gradients(self.grad_buffers)

    def save(self, writer, state, parts, tokenizer, keep, t_start) -> None:
        """Every process takes part: its shards of policy and optimizer (DCP), or with LoRA rank 0 the adapter and
        every process its RNGs."""
        if self.collective_checkpoint:
            writer.write_sharded(state, parts, self.model, self.optimizer, tokenizer, keep, t_start)
        else:
            writer.write_replicated(state, parts, self.peft, tokenizer, keep, t_start)


class Sharded(Holding):
    """The policy (and a reference model) sharded over the processes with FSDP2 (see :mod:`.fsdp`): each process's
    share of the loss is scaled by the number of processes, whose gradients FSDP averages; the engine's weights are
    gathered tensor by tensor; every process writes its shards of a checkpoint."""

    name = "fsdp"
    collective_checkpoint = True
    update_graphs_off = "under FSDP (its collectives run between the layers)"

    def __init__(self, model, runtime, train_cfg, *, ref_model=None,
                 prepare_forward: Callable[[torch.nn.Module], None] | None = None, what: str = "the policy",
                 fp32_units: tuple[torch.nn.Module, ...] = ()):
        fsdp.shard(model, runtime.autocast, prepare_forward, fp32_units)
        if ref_model is not None:
            fsdp.shard(ref_model, runtime.autocast, prepare_forward)
        log.info("FSDP2: %s is sharded over %d processes (one unit per decoder layer; embeddings, final norm and %s "
                 "in the root unit)", what, runtime.world_size, "LM head" if what == "the policy" else "head")
        self.loss_scale = float(runtime.world_size)
        super().__init__(model, runtime, train_cfg)
        if runtime.device.type == "cuda":
            log.info("AdamW: the multi-tensor (foreach) implementation on the sharded parameters")

    def _fused(self) -> bool:
        return False

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each full tensor gathered as it is read: every process must read them all."""
        return fsdp.full_weights(self.model)

    def load_optimizer_state(self, state: dict) -> None:
        """A one-process checkpoint's optimizer state, resumed under torchrun: sharded as the parameters are."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, by_name(self.model, state),
                                 options=StateDictOptions(full_state_dict=True))

    def _load_full_weights(self, ckpt: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, read_full_weights(self.model, ckpt),
                             options=StateDictOptions(full_state_dict=True))

    def whole_state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(self.model, options=whole),
                get_optimizer_state_dict(self.model, self.optimizer, options=whole))

    def load_whole_state(self, weights: dict, optimizer: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        whole = StateDictOptions(full_state_dict=True)  # every process read the whole file
        set_model_state_dict(self.model, weights, options=whole)
        set_optimizer_state_dict(self.model, self.optimizer,
                                 optimizer if _by_name(optimizer) else by_name(self.model, optimizer), options=whole)

    def save(self, writer, state, parts, tokenizer, keep, t_start) -> None:
        writer.write_sharded(state, parts, self.model, self.optimizer, tokenizer, keep, t_start)


def _by_name(optimizer_state: dict) -> bool:
    """Whether an optimizer's state is keyed by parameter name (else by index); its groups say which, even where no
    state was written yet."""
    return any(isinstance(k, str) for g in optimizer_state["param_groups"] for k in g["params"])


def hold(strategy: str, model: torch.nn.Module, runtime, cfg, *, ref_model=None,
         prepare_forward: Callable[[torch.nn.Module], None] | None = None, value_model: bool = False) -> Holding:
    """The holding ``strategy`` names (``single``, ``ddp`` or ``fsdp``; see :func:`.strategy.choose`) for a run of
    ``cfg``, built around ``model`` (and ``ref_model``) in place. ``prepare_forward``: the forward pass's hook for a
    sharded model. ``value_model``: ``model`` is PPO's value model (:class:`gspo.models.value.ValueModel`), with an
    AdamW of its own at ``ppo.critic_lr``, no LoRA adapters, and under FSDP its scalar head a unit of its own gathered
    in fp32 (the head computes in fp32 outside autocast, as unsharded)."""
    train, lora, what, fp32_units = cfg.train, cfg.lora if cfg.lora.rank else None, "the policy", ()
    if value_model:
        train, lora = dataclasses.replace(cfg.train, lr=cfg.ppo.critic_lr), None
        what, fp32_units = "the value model", (model.head,)
    if strategy == "fsdp":
        return Sharded(model, runtime, train, ref_model=ref_model, prepare_forward=prepare_forward, what=what,
                       fp32_units=fp32_units)
    if strategy == "ddp":
        return Replicated(model, runtime, train, ref_model=ref_model, lora_cfg=lora, model_name=cfg.model.name)
    return Holding(model, runtime, train, lora_cfg=lora, model_name=cfg.model.name)
