"""Small typed containers passed between the data, rollout, reward and training stages.

Shape legend: ``N`` completions in a rollout batch (prompts x group size), ``T`` padded completion positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Example:
    """One task instance: what the model is asked and what a verifier needs to score the answer."""

    prompt: str | list[dict[str, str]]
    """A user message (wrapped in the chat template) or a full list of chat messages."""
    answer: str | None = None
    """The reference answer a verifier compares against (``None`` for reward functions that need none)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Any other fields of the source row; passed through to reward functions."""


@dataclass
class SamplingParams:
    """How the rollout engine samples. Log-probabilities are always those of ``softmax(logits / temperature)``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False


FINISH_STOP = "stop"  # ended on EOS or the chat template's end-of-turn token (the token is part of the completion)
FINISH_LENGTH = "length"  # reached max_new_tokens without a stop token


@dataclass
class Rollout:
    """Completions of a batch of prompts. Row ``i`` belongs to prompt ``i // n`` when ``n`` samples are drawn each."""

    prompt_ids: list[list[int]]  # N lists of prompt token ids (no padding)
    completion_ids: torch.Tensor  # (N, T) int64, right-padded with pad_id
    completion_mask: torch.Tensor  # (N, T) bool, True on generated tokens (the stop token included)
    logprobs: torch.Tensor  # (N, T) float32, log pi(sampled token) under softmax(logits / temperature); 0 on padding
    finish_reasons: list[str]  # N of FINISH_STOP | FINISH_LENGTH
    texts: list[str]  # N decoded completions, special tokens removed
    pad_id: int = 0

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # (N,)

    def select(self, rows: list[int]) -> "Rollout":
        """The rollout restricted to ``rows`` (in that order)."""
        idx = torch.tensor(rows, dtype=torch.long)
        return Rollout(
            prompt_ids=[self.prompt_ids[i] for i in rows],
            completion_ids=self.completion_ids[idx],
            completion_mask=self.completion_mask[idx],
            logprobs=self.logprobs[idx],
            finish_reasons=[self.finish_reasons[i] for i in rows],
            texts=[self.texts[i] for i in rows],
            pad_id=self.pad_id,
        )

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        """Rows of several rollouts, in order, padded to the longest completion."""
        if len(parts) == 1:
            return parts[0]
        T = max(p.completion_ids.shape[1] for p in parts)

        def pad(x: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

        pad_id = parts[0].pad_id
        return Rollout(prompt_ids=[ids for p in parts for ids in p.prompt_ids],
                       completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
                       completion_mask=torch.cat([pad(p.completion_mask, False) for p in parts]),
                       logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
                       finish_reasons=[f for p in parts for f in p.finish_reasons],
                       texts=[t for p in parts for t in p.texts], pad_id=pad_id)
