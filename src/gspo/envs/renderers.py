"""Chat formats that are not a Jinja template, for ``env.renderer``: the families whose reference format is a Python
encoder shipped in a PyPI package. Each factory takes the policy's tokenizer and returns a
:class:`gspo.envs.turns.Renderer`; at start-up :func:`gspo.envs.turns.check_vocabulary` checks that the renderer's
ids are the tokenizer's (the engine samples in the tokenizer's vocabulary), and ``check_template`` that the format
keeps earlier turns (tests/test_template_families.py measures both formats below exact over 10,000 conversations).

Why by hand: these formats exist as encoders (Meta's ``ChatFormat``, mistral-common's request encoder), not as the
templates the trainer renders with, so a thin adapter to the renderer protocol is all there is to write.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from gspo.errors import UserError


def _package_dir(name: str, pip: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"env.renderer needs the {pip!r} package, which is not installed; pip install {pip}.")
    return Path(next(iter(spec.submodule_search_locations)))


class Llama3:
    """Meta's Llama 3 chat format (``llama-models``: its ``ChatFormat`` and tiktoken vocabulary, the reference the
    Hugging Face template reproduces); a ``tool`` message is Llama 3.1's ``ipython`` turn. Tools are described in
    the system message; calls are bare JSON objects."""

    tool_format = "llama3"

    def __init__(self, tokenizer=None):
        _package_dir("llama_models", "llama-models")
        from llama_models.datatypes import RawMessage
        from llama_models.llama3.chat_format import ChatFormat
        from llama_models.llama3.tokenizer import Tokenizer

        self.message = RawMessage
        self.tok = Tokenizer.get_instance()
        self.format = ChatFormat(self.tok)
        # the assistant header it ends every prompt with: what an empty dialog holds past <|begin_of_text|>
        self.opening = len(self.format.encode_dialog_prompt([]).tokens) - 1
        self.end_ids = list(self.tok.stop_tokens)

    def render(self, messages, tools, generation_prompt):
        ids = self.format.encode_dialog_prompt([self.message(role=m["role"], content=m["content"])
                                                for m in messages]).tokens
        return ids if generation_prompt else ids[: -self.opening]

    def tokenize(self, text):
        return self.tok.encode(text, bos=False, eos=False)

    def decode(self, ids):
        return self.tok.decode(ids)


class Mistral:
    """mistral-common's request encoder over one of the tokenizer files its wheel ships: ``tekken_240911.json`` (the
    v3 Tekken of Mistral NeMo / Pixtral; exact without a system prompt, which v3 moves into the last user message) or
    ``mistral_instruct_tokenizer_241114.model.v7`` (the v7 SentencePiece of Mistral Large 2411, with a system block of
    its own; needs ``sentencepiece``). User and environment replies only: the encoder takes a tool message only as
    the answer to structured ``tool_calls``, which a sampled turn's ids are not (docs/envs.md)."""

    tool_format = "mistral"
    roles = ("user",)  # the replies it renders after an assistant turn

    def __init__(self, tokenizer=None, name: str = "tekken_240911.json"):
        data = _package_dir("mistral_common", "mistral-common") / "data"
        from mistral_common.protocol.instruct import messages as m
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.types = {"system": m.SystemMessage, "user": m.UserMessage, "assistant": m.AssistantMessage}
        self.request = ChatCompletionRequest
        self.mistral = MistralTokenizer.from_file(str(data / name), mode=ValidationMode.agnostic)
        self.tok = self.mistral.instruct_tokenizer.tokenizer
        self.keep = SpecialTokenPolicy.KEEP
        self.end_ids = [self.tok.eos_id]

    def render(self, messages, tools, generation_prompt):  # the format has no assistant opening to add
        for msg in messages:
            if msg["role"] not in self.types:
                raise UserError(f"the Mistral renderer takes system, user and assistant messages, not {msg['role']!r} "
                                "(its encoder reads tool results only as answers to structured calls); reply as the "
                                "user, or use a model whose chat template renders tool messages.")
        msgs = [self.types[m["role"]](content=m["content"]) for m in messages]
        return self.mistral.encode_chat_completion(self.request(messages=msgs)).tokens

    def tokenize(self, text):
        return self.tok.encode(text, bos=False, eos=False)

    def decode(self, ids):
        return self.tok.decode(ids, special_token_policy=self.keep)


def llama3(tokenizer) -> Llama3:
    """``env.renderer = "gspo.envs.renderers:llama3"``."""
    return Llama3(tokenizer)


def mistral_tekken(tokenizer) -> Mistral:
    """``env.renderer = "gspo.envs.renderers:mistral_tekken"`` (v3 Tekken)."""
    return Mistral(tokenizer, "tekken_240911.json")


def mistral_v7(tokenizer) -> Mistral:
    """``env.renderer = "gspo.envs.renderers:mistral_v7"`` (v7 SentencePiece)."""
    return Mistral(tokenizer, "mistral_instruct_tokenizer_241114.model.v7")
