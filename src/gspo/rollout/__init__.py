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


__all__ = ["HFEngine", "RolloutEngine", "pad_prompts", "positions_from_mask", "sample_next"]
