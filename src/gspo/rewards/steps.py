"""Process credit for per-token advantages (``loss.step_credit``): a function that splits a completion into steps and
scores each, and the token index where each step ends (the steps :func:`gspo.algorithms.estimate_advantages` takes).

A step-credit function is ``(completion: str, example) -> list[(end, credit)]``: for each step, in order, the character
index just past it and its credit (e.g. 1 for a right intermediate line, 0 for a wrong one). The built-in tasks have
one each: ``gspo.rewards.builtin:running_sum_step_spans`` and ``gspo.rewards.builtin:numbered_words_line_spans``. Like
the rewards they run in the reward workers, under ``rewards.timeout_s`` (a module that blocks at import, or a call that
never returns, ends the run in one line instead of hanging it), after the rewards.
"""
from __future__ import annotations

import bisect

import torch


def token_starts(tokenizer, ids: list[int], text: str) -> list[int]:
    """The character index in ``text`` (the completion as the engine decoded it, special tokens skipped) where each
    token of ``ids`` starts. Token by token when the pieces add up to the text (byte-level BPE, the usual case); else
    from the offsets of the text's own encoding when it gives back ``ids``; else from the decoded prefixes (a
    character split across tokens)."""
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
    if "".join(pieces) == text:
        starts, at = [], 0
        for piece in pieces:
            starts.append(at)
            at += len(piece)
        return starts
    if getattr(tokenizer, "is_fast", False):  # SentencePiece-style pieces lose their leading space alone: re-encode
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"] == ids:
            return [start for start, _ in enc["offset_mapping"]]
    # The sampled ids are not the text's own encoding: the decoded prefixes (quadratic, rare). A prefix that ends inside
    # a character decodes it as U+FFFD; the token then starts where that character does, as the offsets say.
    return [len(tokenizer.decode(ids[:t], skip_special_tokens=True).rstrip("\ufffd")) for t in range(len(ids))]


def turn_steps(rollout, rewards: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Each multi-turn row's steps: the token ends (just past each turn's last sampled token) and credits (the
    environment's reward for the turn) of its turns that have one; none for a row whose environment failed."""
    step_ends, step_credit = [], []
    for i, credits in enumerate(rollout.turn_rewards):
        sampled = rollout.sampled[i].tolist()
        ends = [t + 1 for t in range(len(sampled)) if sampled[t] and (t + 1 == len(sampled) or not sampled[t + 1])]
        k = 0 if rewards[i] != rewards[i] else min(len(ends), len(credits))
        step_ends.append(ends[:k])
        step_credit.append(list(credits[:k]))
    return step_ends, step_credit


def task_steps(spans: list[tuple[list[int], list[float]]], tokenizer, rollout) -> tuple[list[list[int]], list[list[float]]]:
    """Each completion's steps (``spans``: character ends and credits) as token ends and credits."""
    step_ends, step_credit = [], []
    for i, (text, (ends, credits)) in enumerate(zip(rollout.texts, spans)):
        ids = rollout.completion_ids[i][rollout.completion_mask[i]].tolist()
        starts = token_starts(tokenizer, ids, text)
        # the tokens of a step ending at character e: those starting before e
        step_ends.append([bisect.bisect_left(starts, e) for e in ends])
        step_credit.append(credits)
    return step_ends, step_credit
