"""The bookkeeping every engine's multi-turn loop shares: each row's pieces (its sampled turns and the ids appended
after them), how many completion tokens it has, how it finished, and which rows go on after a turn with what ids.

An engine owns how a turn is sampled and how the appended ids reach a row's KV cache; this owns what is recorded, so
the rows the engines return are built one way (:func:`assemble_turns`)."""
from __future__ import annotations

import torch

from gspo.types import FINISH_LENGTH, FINISH_STOP, Rollout, SamplingParams, TurnEnds

Piece = tuple[list[int], list[float], bool]  # ids, their log-probs (0 where appended), whether sampled


class TurnRows:
    """The multi-turn state of ``rows`` rows under ``params`` (``max_new_tokens`` for the whole completion,
    ``max_turn_tokens`` a turn); ``turns`` answers the rows whose turn ended (see :data:`gspo.types.TurnEnds`)."""

    def __init__(self, rows: int, params: SamplingParams, turns: TurnEnds, stop_ids: list[int]):
        self.total = params.max_new_tokens
        self.per_turn = min(params.max_turn_tokens or self.total, self.total)
        self.turns, self.stop = turns, set(stop_ids)
        self.pieces: list[list[Piece]] = [[] for _ in range(rows)]
        self.length = [0] * rows  # completion tokens so far (sampled and appended)
        self.finish = [FINISH_LENGTH] * rows

    def room(self, r: int) -> int:
        """Tokens row ``r`` may sample in its next turn."""
        return min(self.per_turn, self.total - self.length[r])

    def sampled(self, r: int, ids: list[int], logprobs: list[float]) -> bool:
        """Row ``r`` sampled ``ids`` this turn; whether the turn ended on a stop token (else it ran out of tokens,
        for the turn or the completion, and the row is cut off)."""
        self.pieces[r].append((ids, logprobs, True))
        self.length[r] += len(ids)
        if ids and ids[-1] in self.stop:
            self.finish[r] = FINISH_STOP
            return True
        self.finish[r] = FINISH_LENGTH  # cut mid-turn, whatever its earlier turns ended on
        return False

    def answer(self, ended: list[int]) -> dict[int, list[int]]:
        """Ask ``turns`` for the ids after each ended turn; the rows that go on (an answer, and room for it and a
        token), each with the ids it is fed, recorded as appended."""
        answers = self.turns(ended, [self.pieces[r][-1][0] for r in ended]) if ended else []
        going = {}
        for r, ids in zip(ended, answers):
            if ids and self.length[r] + len(ids) < self.total:
                going[r] = list(ids)
                self.pieces[r].append((going[r], [0.0] * len(ids), False))
                self.length[r] += len(ids)
        return going

    def stop_token(self, r: int) -> int:
        """The stop token that ended row ``r``'s last sampled turn (engines that have not fed it yet feed it first)."""
        return next(ids for ids, _, sampled in reversed(self.pieces[r]) if sampled)[-1]

    def rollout(self, tokenizer, pad_id: int, prompts: list[list[int]], n: int) -> Rollout:
        return assemble_turns(tokenizer, pad_id, prompts, n, self.pieces, self.finish)


def assemble_turns(tokenizer, pad_id: int, prompts: list[list[int]], n: int,
                   pieces: list[list[tuple[list[int], list[float], bool]]], finish: list[str]) -> Rollout:
    """Multi-turn rows from their pieces ``(ids, log-probs, sampled)``, in order, as right-padded tensors: every token,
    which of them were sampled, their log-probs; a row's text is its last sampled turn's."""
    seqs = [[t for ids, _, _ in row for t in ids] for row in pieces]
    width = max(1, max(len(s) for s in seqs))
    rows = len(seqs)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    sampled = torch.zeros((rows, width), dtype=torch.bool)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for r, row in enumerate(pieces):
        at = 0
        for ids, lps, was_sampled in row:
            tokens[r, at:at + len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[r, at:at + len(ids)] = torch.tensor(lps, dtype=torch.float32)
            sampled[r, at:at + len(ids)] = was_sampled
            at += len(ids)
        mask[r, :at] = True
    last = [next((ids for ids, _, s in reversed(row) if s), []) for row in pieces]
    return Rollout(prompt_ids=Rollout.repeat_prompts(prompts, n), completion_ids=tokens, completion_mask=mask,
                   logprobs=logprobs, finish_reasons=finish,
                   texts=tokenizer.batch_decode(last, skip_special_tokens=True), pad_id=pad_id, sampled_mask=sampled)
