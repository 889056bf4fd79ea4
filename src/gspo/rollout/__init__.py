"""Rollout engines: anything with ``generate(...)`` and ``sync_weights(...)`` can feed the trainer.

The weight seam: before every rollout batch the training loop calls ``engine.sync_weights(actor.weights())`` with the
policy's ``(name, tensor)`` pairs. What an engine does with them is its own business: the simple engine samples from
the trainer's model object and ignores them; the graph engine copies them into its own low-precision buffers (which
its captured CUDA graphs read in place); an engine in another process or library loads them. No engine may rely on
reading the trainer's parameters between two calls of ``sync_weights``.

The routing seam (Routing Replay R3, ``moe.routing_replay = "rollout"``): an engine declares ``records_routing``; one
that does is given the MoE policy's :class:`gspo.models.moe.Routing` as it is built (``make_engine(..., routing=)``)
and records every fed token's experts into ``Rollout.routes``; one that does not is refused before it is built.

The in-flight seam (``rollout.in_flight``): an engine declares ``takes_weights_in_flight``; one that does has a
``swaps`` attribute (:class:`gspo.rollout.graph.InFlight` or None) that it polls for newer weights between decode
steps; one that does not is refused by ``make_engine(..., in_flight=True)`` before it is built.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from gspo.errors import UserError
from gspo.models.moe import Routing
from gspo.rollout.hf import HFEngine, sample_next
from gspo.types import ENGINES, FUSED_STEPS, Rollout, SamplingParams, TurnEnds

log = logging.getLogger("gspo")


class RolloutEngine(Protocol):
    """What the trainer needs from an engine: ``n`` completions per token-id prompt, row ``i`` for prompt ``i // n``,
    sampled from the weights last given to ``sync_weights``."""

    records_routing: bool  # whether it can record an MoE policy's routes (R3): make_engine refuses routing otherwise
    # whether it loads newer weights between decode steps (rollout.in_flight): make_engine refuses in_flight otherwise
    takes_weights_in_flight: bool

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        turns: TurnEnds | None = None,  # multi-turn rows (gspo.envs): see gspo.rollout.hf.HFEngine.generate
    ) -> Rollout: ...

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def rounded_weights(weights: Iterable[tuple[str, torch.Tensor]], bits: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``rollout.engine_weight_bits``: the ``(name, tensor)`` pairs with every matrix rounded to ``bits``-bit signed
    integers and scaled back, one scale per output row (symmetric absmax, as weight-only int8 inference quantises):

        s_r = max_j |W_rj| / (2^(bits-1) - 1),   W'_rj = s_r * round(W_rj / s_r)

    Vectors (norms, biases) pass unchanged; every tensor is a new one (the trainer's weights are never written). An
    engine copy in bf16 keeps 8 significant bits, so past ~9 bits the rounding is lost in it."""
    qmax = 2 ** (bits - 1) - 1
    for name, w in weights:
        if w.dim() < 2 or not w.is_floating_point():
            yield name, w
            continue
        x = w.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float32).tiny)  # 0 rows stay 0
        yield name, ((x / scale).round().clamp(-qmax, qmax) * scale).to(w.dtype)


def make_engine(kind: str, model, tokenizer, *, stop_ids: list[int], device: torch.device,
                autocast_dtype: torch.dtype | None = None, fused_step: str = "auto", compact_rows: str = "auto",
                replica: bool = False, vllm_gpu_memory: float = 0.3,
                routing: Routing | None = None, in_flight: bool = False, exact: bool = False) -> RolloutEngine:
    """The engine ``rollout.engine`` names: ``graph``, ``hf``, ``vllm`` (:mod:`gspo.rollout.vllm_engine`, imported only
    then), or ``auto`` (graph on CUDA when the model is supported); ``fused_step = "off"`` keeps the graph engine on the
    HF modules' decode step, ``compact_rows = "off"`` runs its steps on the whole batch. ``model`` gives the
    architecture and the first weights; ``replica``: the hf engine keeps its own copy of them instead of sampling from
    ``model`` (the graph and vLLM engines always do), for a policy that will be sharded across processes.
    ``routing``: an MoE policy's :class:`gspo.models.moe.Routing` for the engine to record routes into (R3); an
    engine that cannot record them is refused, in one line, before it is built. ``in_flight``: the engine is to take
    newer weights between decode steps (``rollout.in_flight``; the caller sets its ``swaps``); an engine that cannot
    is refused the same way. ``exact``: the graph engine with
    ``rollout.exact``'s batch-invariant forward (on the CPU only under Triton's interpreter, as the tests run it)."""
    from gspo.rollout import graph

    if exact:
        import os

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("rollout.exact runs Triton kernels, which need a CUDA GPU; run on one, or set "
                            "rollout.exact = false.")
        kind = "graph"
    if kind == "auto":
        why_not = graph.unsupported(model, autocast_dtype)
        kind = "graph" if device.type == "cuda" and why_not is None else "hf"
        if device.type == "cuda" and kind == "hf":
            log.info("rollout engine: hf (the simple engine); the graph engine cannot run this model: %s", why_not)
    if kind == "vllm":
        from gspo.rollout.vllm_engine import VLLMEngine

        _refuse_what_it_cannot(VLLMEngine, routing, in_flight)
        return VLLMEngine(model, tokenizer, stop_ids=stop_ids, device=device, autocast_dtype=autocast_dtype,
                          gpu_memory=vllm_gpu_memory)
    if kind == "graph":
        _refuse_what_it_cannot(graph.GraphEngine, routing, in_flight)
        return graph.GraphEngine(model, tokenizer, stop_ids=stop_ids, device=device, autocast_dtype=autocast_dtype,
                                 fused=False if fused_step == "off" else None,
                                 compact=False if compact_rows == "off" else None, routing=routing, exact=exact)
    _refuse_what_it_cannot(HFEngine, routing, in_flight, hookless_copy=replica)
    return HFEngine(model, tokenizer, stop_ids=stop_ids, device=device, autocast_dtype=autocast_dtype, replica=replica,
                    routing=routing)


def _refuse_what_it_cannot(engine: type, routing: Routing | None, in_flight: bool, hookless_copy: bool = False) -> None:
    """R3 with an engine that would sample without recording the routes, or in-flight updates with one that cannot
    take them: refused before the engine is built (vLLM would take its share of the GPU first). ``hookless_copy``: the
    hf engine is to sample from a copy of its own, which the routing hooks on the trainer's model do not reach."""
    if in_flight and not engine.takes_weights_in_flight:
        raise UserError(f"rollout.in_flight needs an engine that takes new weights between decode steps, and the "
                        f"{engine.__name__} does not; set rollout.engine = 'graph' (or leave it 'auto' on a model it "
                        "supports), or rollout.in_flight = 'off'.")
    if routing is None:
        return
    if not engine.records_routing:
        raise UserError(f"moe.routing_replay = 'rollout' needs an MoE model and an engine that records routing "
                        f"({engine.__name__} does not); set rollout.engine = 'hf' or 'graph'.")
    if hookless_copy:
        raise UserError("moe.routing_replay = 'rollout' with LoRA, rollout.engine_weight_bits or FSDP needs the graph "
                        "engine (the hf engine's own copy of the model has no routing hooks); set rollout.engine = "
                        "'graph' on GPUs, dist.strategy = 'ddp' under FSDP, or moe.routing_replay = 'old'.")


__all__ = ["ENGINES", "FUSED_STEPS", "HFEngine", "RolloutEngine", "make_engine", "sample_next"]
