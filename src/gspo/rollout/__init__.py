"""Rollout engines: anything with ``generate(prompts, n, params, generator) -> Rollout`` can feed the trainer."""
from __future__ import annotations

from typing import Protocol

import torch

from gspo.rollout.hf import HFEngine, pad_prompts, positions_from_mask, sample_next
from gspo.types import Rollout, SamplingParams


class RolloutEngine(Protocol):
    """What the trainer needs from an engine: ``n`` completions per token-id prompt, row ``i`` for prompt ``i // n``."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Rollout: ...


def make_engine(kind: str, model, tokenizer, *, stop_ids: list[int], device: torch.device,
                autocast_dtype: torch.dtype | None = None, fused_step: str = "auto") -> RolloutEngine:
    """The engine ``rollout.engine`` names: ``graph``, ``hf``, or ``auto`` (graph on CUDA when the model is supported);
    ``fused_step = "off"`` keeps the graph engine on the HF modules' decode step."""
    from gspo.rollout import graph

    if kind == "auto":
        kind = "graph" if device.type == "cuda" and graph.supports(model) else "hf"
    if kind == "graph":
        return graph.GraphEngine(model, tokenizer, stop_ids=stop_ids, device=device, autocast_dtype=autocast_dtype,
                                 fused=False if fused_step == "off" else None)
    return HFEngine(model, tokenizer, stop_ids=stop_ids, device=device, autocast_dtype=autocast_dtype)


__all__ = ["HFEngine", "RolloutEngine", "make_engine", "pad_prompts", "positions_from_mask", "sample_next"]
