"""Token-in, token-out conversations: what a row of the rollout holds after each turn.

A multi-turn row is the prompt's ids, then for each turn the ids the engine sampled for the assistant (ending with
the template's end-of-turn token) followed by the ids of the messages that answer it (tool results, the
environment's observation) and the template's opening of the next assistant turn. The sampled ids are never decoded
and encoded again: text does not round-trip through a tokenizer (verl#3720, #3960: training then sees other tokens
than the rollout sampled).

The appended ids come from a fixed-base suffix diff of the chat template (the recipe of SkyRL, ROLL and verl's
ContinuousTokenBuilder): render a fixed conversation ``B`` = (user, assistant), and ``B`` + the new messages with the
generation prompt; the new ids are the second rendering past the end-of-turn token of ``B``'s assistant message. Cutting
right after that token, not at the end of ``B``'s rendering, keeps the template's separator after it (``"\\n"`` after
``<|im_end|>``) in the appended ids: verl PR #6921 lost exactly that token at every tool boundary.

Why not the template over the whole conversation each turn: the history would be re-rendered from text, and a
template may change it (Qwen3 drops past ``<think>`` blocks, Llama 3 trims contents), so the row would no longer be
what was sampled. :func:`check_template` verifies at start-up, on randomised conversations, that the rows built turn by
turn are what the template renders for the same conversation, so the model reads its turns in the format it was
tuned on; a template that fails is refused in one line.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from gspo.errors import UserError

Message = dict[str, str]
BASE: list[Message] = [{"role": "user", "content": "gspo"}, {"role": "assistant", "content": "gspo"}]


class Turns:
    """The token ids of a conversation's turns under one tokenizer's chat template.

    ``end_ids``: the ids that end an assistant turn (the template's end-of-turn token among the engine's stop ids);
    ``system``: a system message the template renders the same in every conversation (or ``None``); ``tools``: JSON
    schemas passed to the template as ``tools=`` (for templates that render them)."""

    def __init__(self, tokenizer, end_ids: Sequence[int], system: str | None = None, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("multi-turn environments need a tokenizer with a chat template (the conversation's turns "
                            "are rendered by it); use a chat model or set model.tokenizer to one that has a template.")
        self.tokenizer = tokenizer
        self.system = system
        self.tools = tools or None
        base = self.encode(BASE, generation_prompt=False)
        ends = [i for i, t in enumerate(base) if t in set(end_ids)]
        if not ends:
            raise UserError(f"the chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} ends an "
                            "assistant message with none of the stop tokens, so a sampled turn cannot be continued; "
                            "use a chat model whose template closes turns with its end-of-turn token.")
        self.cut = ends[-1] + 1  # past the base assistant's end-of-turn token
        self.base = base[: self.cut]
        self.end_id = base[ends[-1]]  # the end-of-turn token a turn must stop on to be continued

    def messages(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` after the system message (when one is set and they have none)."""
        msgs = list(messages)
        if self.system is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs

    def encode(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        """The template's ids of ``messages`` (after the system message), rendered to text then tokenized without
        adding special tokens again (the template placed them)."""
        text = self.tokenizer.apply_chat_template(self.messages(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first turn's ids: ``messages`` and the opening of the assistant's reply."""
        return self.encode(messages, generation_prompt=True)

    def after(self, messages: Sequence[Message]) -> list[int]:
        """The ids to append after a sampled assistant turn that ended with :attr:`end_id`: ``messages`` (tool results,
        observations, a user's reply) and the opening of the next assistant turn."""
        if not messages:
            raise ValueError("after() needs at least one message to append")
        ids = self.encode([*BASE, *messages], generation_prompt=True)
        if ids[: self.cut] != self.base:
            raise UserError(f"the chat template renders an assistant turn differently when messages follow it (roles "
                            f"{[m.get('role') for m in messages]}), so appended turns cannot continue a sampled one; "
                            "use a model whose template keeps earlier turns as they are.")
        return ids[self.cut :]


def _text(rng: random.Random, assistant: bool) -> str:
    """Content that stresses a template: spaces and newlines inside, unicode, markup, JSON, braces; an assistant's has
    no outer whitespace (what a model samples before its end-of-turn token, and what templates that trim keep)."""
    pieces = ["42", " the", "\n", "  ", "é", "日本", "🙂", "<think>", "</think>", "{\"a\": [1, 2]}", "{{x}}", "\\boxed{7}",
              "Answer:", "tool", "\t", "<tool_call>", "a" * 20]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
    return (text.strip() or "ok") if assistant else text


def random_conversation(rng: random.Random, roles: Sequence[str] = ("user", "tool")) -> list[Message]:
    """A user message then 1-4 (assistant, reply) turns whose replies take roles from ``roles``, ending with a reply."""
    msgs = [{"role": "user", "content": _text(rng, False)}]
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "assistant", "content": _text(rng, True)})
        for _ in range(rng.randint(1, 2)):
            msgs.append({"role": rng.choice(list(roles)), "content": _text(rng, False)})
    return msgs


def build_row(turns: Turns, conversation: Sequence[Message]) -> list[int]:
    """The row a conversation becomes turn by turn: the prompt, then each assistant message's ids (its content
    tokenized alone, as a sample would be, and the end-of-turn token) and the appended ids of the replies after it."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    row = turns.prompt(conversation[:first])
    i = first
    while i < len(conversation):
        content = conversation[i]["content"]
        row += turns.tokenizer(content, add_special_tokens=False)["input_ids"] + [turns.end_id]
        j = i + 1
        while j < len(conversation) and conversation[j]["role"] != "assistant":
            j += 1
        row += turns.after(conversation[i + 1 : j])
        i = j
    return row


def check_template(turns: Turns, samples: int = 200, seed: int = 0, roles: Sequence[str] = ("user", "tool")) -> None:
    """Refuse, in one line, a template under which rows built turn by turn are not what it renders for the same
    conversation (over ``samples`` random conversations): the model would read its turns in another format than the
    one it was tuned on. Decoded text is compared, so a content that tokenizes differently alone than inside the
    rendering (not the template's doing) does not count."""
    rng = random.Random(seed)
    decode = turns.tokenizer.decode
    for _ in range(samples):
        conversation = random_conversation(rng, roles)
        row = decode(build_row(turns, conversation))
        whole = decode(turns.encode(conversation, generation_prompt=True))
        if row != whole:
            at = next((k for k, (a, b) in enumerate(zip(row, whole)) if a != b), min(len(row), len(whole)))
            raise UserError(f"the chat template does not keep earlier turns as they are: a conversation built turn "
                            f"by turn reads {row[max(0, at - 30):at + 30]!r} where the template renders "
                            f"{whole[max(0, at - 30):at + 30]!r}; use a model whose template keeps them, or a "
                            "corrected template (model.tokenizer).")
