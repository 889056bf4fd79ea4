"""Small typed containers passed between the data, rollout, reward and training stages, and the names of the rollout
engines and decode steps a config may pick.

Shape legend: ``N`` completions in a rollout batch (prompts x group size), ``T`` padded completion positions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gspo.example import Example  # noqa: F401  (re-exported: gspo.types.Example)


@dataclass
class SamplingParams:
    """How the rollout engine samples. Log-probabilities are always those of ``softmax(logits / temperature)``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False
    max_turn_tokens: int = 0  # multi-turn: tokens one assistant turn may sample (0: max_new_tokens, the whole row's)


class TurnEnds(Protocol):
    """The multi-turn seam between an engine and :mod:`gspo.envs`: called with the rows whose turn just ended on a stop
    token and the ids each sampled in that turn (the stop token last); returns, per row, the ids to append before its
    next turn (tool results, observations, the template's opening of the next assistant turn), or ``None`` when the
    row is finished."""

    def __call__(self, rows: list[int], turns: list[list[int]]) -> list[list[int] | None]: ...


# The values of rollout.engine and rollout.fused_step (gspo.rollout re-exports them). They live here, not in
# gspo.rollout, so that the config's checks read them without importing the engines (and transformers with them).
ENGINES = ("auto", "graph", "hf", "vllm")
FUSED_STEPS = ("auto", "off")

FINISH_STOP = "stop"  # ended on EOS or the chat template's end-of-turn token (the token is part of the completion)
FINISH_LENGTH = "length"  # reached max_new_tokens without a stop token


def _select(value: Any, rows: list[int], idx: torch.Tensor) -> Any:
    """Rows ``rows`` of one field: a list, a tensor indexed on its first dimension, a dict of such, a row container;
    anything else (a pad id, None) is not per row and is kept."""
    if isinstance(value, list):
        return [value[i] for i in rows]
    if isinstance(value, torch.Tensor):
        return value[idx.to(value.device)]
    if isinstance(value, dict):
        return {k: _select(v, rows, idx) for k, v in value.items()}
    if isinstance(value, RowFields):
        return value.select(rows)
    return value


def _concat(values: list[Any], pad: Any) -> Any:
    """One field of several containers, rows in order; per-token (N, T) tensors are right-padded with ``pad``."""
    first = values[0]
    if isinstance(first, list):
        return [x for v in values for x in v]
    if isinstance(first, torch.Tensor):
        if pad is None:
            return torch.cat(values)
        T = max(v.shape[1] for v in values)  # pad dimension 1 (positions), whatever the rank

        def widen(v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, T - v.shape[1]), value=pad)

        return torch.cat([widen(v) for v in values])
    if isinstance(first, dict):
        return {k: _concat([v[k] for v in values], pad) for k in first}
    if isinstance(first, RowFields):
        return type(first).concat(values)
    return first


class RowFields:
    """Row-wise ``select`` and ``concat`` that follow the dataclass's fields, so a new per-row field (expert routes, a
    trainable mask, values) is one line in the class. A field's ``metadata["pad"]`` marks a per-token ``(N, T)``
    tensor and gives the value that pads it on concatenation (``"pad_id"``: the container's ``pad_id``)."""

    def select(self, rows: list[int]):
        """The rows ``rows`` (in that order)."""
        idx = torch.tensor(rows, dtype=torch.long)
        return type(self)(**{f.name: _select(getattr(self, f.name), rows, idx) for f in dataclasses.fields(self)})

    @classmethod
    def concat(cls, parts: list):
        """Rows of several containers, in order, per-token fields padded to the longest."""
        if len(parts) == 1:
            return parts[0]
        out = {}
        for f in dataclasses.fields(cls):
            pad = f.metadata.get("pad")
            if pad == "pad_id":
                pad = parts[0].pad_id
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = None if values[0] is None else _concat(values, pad)
        return cls(**out)


@dataclass
class Rollout(RowFields):
    """Completions of a batch of prompts. Row ``i`` belongs to prompt ``i // n`` when ``n`` samples are drawn each."""

    # N lists of prompt token ids (no padding); the rows of one prompt share one list (read-only; see repeat_prompts)
    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor = field(metadata={"pad": "pad_id"})  # (N, T) int64, right-padded with pad_id
    completion_mask: torch.Tensor = field(metadata={"pad": False})  # (N, T) bool, True on generated tokens (stop included)
    logprobs: torch.Tensor = field(metadata={"pad": 0.0})  # (N, T) float32, log pi(token) under softmax(logits / temp)
    finish_reasons: list[str]  # N of FINISH_STOP | FINISH_LENGTH
    texts: list[str]  # N decoded completions, special tokens removed
    pad_id: int = 0
    # MoE with moe.routing_replay = "rollout": the experts the engine routed each token to, by sequence position
    # (prompt and completion; the last sampled token was never fed back, so it has none)
    routes: torch.Tensor | None = field(default=None, metadata={"pad": 0})  # (N, S, L, k) uint8
    routes_mask: torch.Tensor | None = field(default=None, metadata={"pad": False})  # (N, S) bool: position recorded
    # Multi-turn rows (gspo.envs): True on the tokens the engine sampled, False on the appended ones (tool results,
    # observations, template tokens), which are fed to the model but never trained on; None: every completion token
    sampled_mask: torch.Tensor | None = field(default=None, metadata={"pad": False})  # (N, T) bool
    # Multi-turn rows: per row, the environment's step reward of each turn that ended on a stop token (0 where the
    # turn got tool results rather than a step), in order: the turns' credit for ``loss.step_credit = "env"``
    turn_rewards: list[list[float]] | None = None
    # In-flight weight updates (rollout.in_flight): the policy version whose weights sampled each token, -1 on padding;
    # None: one version sampled every row (the batch's)
    versions: torch.Tensor | None = field(default=None, metadata={"pad": -1})  # (N, T) int64

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # (N,)

    @property
    def sampled(self) -> torch.Tensor:
        """(N, T) bool: the tokens the policy chose, the only ones in the loss, its denominators, the ratios, the
        engine-gap and entropy diagnostics (one mask for all of them)."""
        return self.completion_mask if self.sampled_mask is None else self.sampled_mask

    @staticmethod
    def repeat_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
        """``prompt_ids`` of ``n`` rows per prompt: one copy of each prompt's ids, shared by its rows. Under torchrun a
        rollout batch is pickled to every process, and pickle writes a shared list once (its rows refer back to it):
        a process's share of the reference run (32 prompts of ~150 tokens x 8) pickles ~3x and unpickles ~4x faster
        than with a list per row (``benchmarks/gather_pickle.py``)."""
        copies = [list(p) for p in prompts]
        return [copies[i // n] for i in range(len(prompts) * n)]


@dataclass
class Groups(RowFields):
    """Scored groups of the collect stage: ``G`` completions per prompt, rows of a group contiguous.  N rows."""

    rollout: Rollout
    examples: list[Example]  # N, the example of each row
    rewards: torch.Tensor  # (N,) float32 weighted total, NaN where a reward function failed
    per_function: dict[str, torch.Tensor]  # name -> (N,) each function's raw reward

    def groups(self, picked: list[int], group_size: int) -> "Groups":
        """The groups ``picked`` (indices of groups, not rows), in that order."""
        return self.select([g * group_size + j for g in picked for j in range(group_size)])


@dataclass
class Batch:
    """One rollout batch ready for the update.  N = P x G rows, groups contiguous.

    ``old_logprobs`` and ``ref_logprobs`` are filled by the actor before the first optimizer step (minibatch 0's old
    log-probs during it, from its own forward)."""

    rollout: Rollout
    examples: list[Example]  # N, the example of each row
    rewards: torch.Tensor  # (N,) total reward, NaN where a reward function failed
    advantages: torch.Tensor  # (N,), or (N, T) per token with loss.step_credit
    loss_mask: torch.Tensor  # (N, T) bool: completion tokens that enter the loss
    metrics: dict[str, Any]  # the rollout batch's metrics (floats or 0-dim tensors)
    old_logprobs: torch.Tensor | None = None  # (N, T) on the training device
    ref_logprobs: torch.Tensor | None = None  # (N, T) on the training device, with loss.beta > 0
