"""Multi-turn rows, token-exact: the appended ids of each turn (a fixed-base suffix diff of the real SmolLM2 chat
template), the separator after the end-of-turn token kept, and the start-up check that refuses a template which
re-renders earlier turns."""
import copy
import random

import pytest

from gspo.envs.turns import Turns, build_row, check_template, random_conversation
from gspo.errors import UserError
from gspo.models.load import stop_token_ids


@pytest.fixture
def turns(tokenizer):
    return Turns(tokenizer, stop_token_ids(tokenizer))


def test_appended_ids_keep_the_separator_after_the_end_of_turn_token(turns, tokenizer):
    """After a sampled turn ends with <|im_end|>, the appended ids start with the template's "\\n" (verl PR #6921 lost
    that token at every tool boundary) and end with the opening of the next assistant turn."""
    ids = turns.after([{"role": "tool", "content": "12"}])
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_ids_to_tokens(turns.end_id) == "<|im_end|>"


def test_rows_built_turn_by_turn_are_the_templates_rendering(turns, tokenizer):
    """Over random conversations (unicode, markup, JSON, braces, tool and user replies, 1-4 turns), the row built turn
    by turn is, id for id, what the template renders for the whole conversation when each assistant content is
    tokenized alone; the start-up check passes."""
    rng = random.Random(1)
    for _ in range(200):
        conversation = random_conversation(rng)
        whole = turns.encode(conversation, generation_prompt=True)
        assert tokenizer.decode(build_row(turns, conversation)) == tokenizer.decode(whole)
    check_template(turns, samples=300)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    """A template that drops <think> blocks of earlier assistant turns (as Qwen3's does) would make the rows other than
    the conversation the model is shown at inference: refused in one line, quoting where they part."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "message['content']",
        "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' and not loop.last "
        "else message['content'])")
    turns = Turns(tok, stop_token_ids(tok))
    with pytest.raises(UserError, match="does not keep earlier turns"):
        check_template(turns, samples=300)


def test_a_tokenizer_without_template_or_end_of_turn_is_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(UserError, match="chat template"):
        Turns(tok, stop_token_ids(tokenizer))
    with pytest.raises(UserError, match="none of the stop tokens"):
        Turns(tokenizer, [tokenizer.convert_tokens_to_ids("a")])


# --- the engine's side: rows that go on in their own KV cache ---------------------------------------------------------

import torch  # noqa: E402

from gspo.rollout import HFEngine  # noqa: E402
from gspo.train.passes import sequence_logprobs  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402


class Answers:
    """A TurnEnds that answers each row's turn with fixed appended ids, ``turns_per_row[r]`` times, and records every
    call (rows, their turn ids)."""

    def __init__(self, turns_per_row, appended):
        self.left = list(turns_per_row)
        self.appended = appended
        self.calls = []

    def __call__(self, rows, turn_ids):
        self.calls.append((list(rows), [list(t) for t in turn_ids]))
        out = []
        for r in rows:
            self.left[r] -= 1
            out.append(self.appended(r) if self.left[r] > 0 else None)
        return out


def _prompts(tokenizer):
    return [tokenizer.encode(t) for t in ["Hello there, how are you?", "Hi", "What is 2 + 3? Answer please."]]


def _biased(model, tokenizer, stop, bias):
    """The tiny model with its LM head biased towards the stop token, so turns end after a few tokens."""
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape[0]))
    with torch.no_grad():
        model.lm_head.bias[stop] = bias
    return model


def test_rows_that_end_after_one_turn_are_the_single_turn_rollout_bit_for_bit(tiny_model, tokenizer):
    """With a TurnEnds that finishes every row at its first turn, the multi-turn path draws, feeds and records exactly
    what the single-turn loop does (same seed): tokens, log-probs, masks, finish reasons."""
    stop = stop_token_ids(tokenizer)
    engine = HFEngine(_biased(tiny_model, tokenizer, stop[-1], 11.0), tokenizer, stop_ids=stop)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    single = engine.generate(_prompts(tokenizer), 3, params, torch.Generator().manual_seed(5))
    multi = engine.generate(_prompts(tokenizer), 3, params, torch.Generator().manual_seed(5),
                            turns=Answers([1] * 9, lambda r: [1, 2]))
    assert torch.equal(single.completion_ids, multi.completion_ids[:, :single.completion_ids.shape[1]])
    assert torch.equal(single.logprobs, multi.logprobs[:, :single.logprobs.shape[1]])
    assert torch.equal(single.completion_mask, multi.completion_mask[:, :single.completion_mask.shape[1]])
    assert torch.equal(multi.sampled, multi.completion_mask)
    assert single.finish_reasons == multi.finish_reasons and single.texts == multi.texts
    assert "stop" in single.finish_reasons and "length" in single.finish_reasons


def test_later_turns_continue_the_rows_kv_cache_exactly(tiny_model, tokenizer):
    """Rows of 2-3 turns with appended ids of different lengths per row: each row is its prompt, its sampled ids and
    the appended ids, in order (token-in, token-out); the appended ids are out of the sampled mask; and the log-probs
    the engine recorded for every sampled token of every turn equal the trainer's recomputation over the whole row
    (the continued KV cache, its masked padding and its positions are right)."""
    stop = stop_token_ids(tokenizer)
    model = _biased(tiny_model, tokenizer, stop[-1], 10.0)
    engine = HFEngine(model, tokenizer, stop_ids=stop)
    appended = {r: list(range(100 + r, 100 + r + 1 + r % 4)) for r in range(6)}  # 1-4 ids, different per row
    answers = Answers([3, 2, 3, 1, 2, 3], lambda r: appended[r])
    params = SamplingParams(max_new_tokens=60, temperature=1.0, max_turn_tokens=10)
    rollout = engine.generate(_prompts(tokenizer)[:2], 3, params, torch.Generator().manual_seed(0), turns=answers)
    sampled_turns = {r: [] for r in range(6)}
    for rows, turn_ids in answers.calls:
        for r, ids in zip(rows, turn_ids):
            sampled_turns[r].append(ids)
    assert len(answers.calls) >= 2
    for r in range(6):
        row = rollout.completion_ids[r][rollout.completion_mask[r]].tolist()
        expected, flags = [], []
        for k, ids in enumerate(sampled_turns[r]):
            expected += ids
            flags += [True] * len(ids)
            if k + 1 < len(sampled_turns[r]) or answers.left[r] > 0:
                expected += appended[r]
                flags += [False] * len(appended[r])
        n = len(expected)
        assert row[:n] == expected, r  # a row cut short by its turn limit has sampled ids after the last turn end
        assert rollout.sampled[r][:n].tolist() == flags, r
    logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                pad_id=engine.pad_id)
    mask = rollout.sampled
    assert (~rollout.sampled & rollout.completion_mask).any()
    torch.testing.assert_close(rollout.logprobs[mask], logp.detach()[mask], atol=2e-5, rtol=0)
