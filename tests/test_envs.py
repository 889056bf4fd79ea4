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
