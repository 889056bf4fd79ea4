"""The task instance, in a module that imports nothing heavy: reward workers unpickle examples, and a worker that had
to import torch for it would take seconds to start instead of milliseconds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    """One task instance: what the model is asked and what a verifier needs to score the answer. A reward function
    gets it as its second argument, ``fn(completion, example)``, with ``completion`` the decoded response."""

    prompt: str | list[dict[str, str]]
    """What the model is asked. From a data file: the prompt field (``data.prompt_field``) put through
    ``data.template`` (``{question}`` by default, so the field as is); a field that holds chat messages is used as is.
    A string is sent as the user message of the model's chat template."""
    answer: str | None = None
    """The reference answer as a string (a number in the row becomes ``"42"``): the answer field
    (``data.answer_field``) as ``data.answer_format`` reads it (``raw``: the field as written, stripped; ``gsm8k``: the
    number after ``####``; ``boxed``: the last ``\\boxed{}``); generated tasks give the result. ``None`` where the
    row's answer is null (``raw`` only) or a task has no reference answer."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Every other field of the source row, the answer field as written included (``example.meta["id"]``); for
    generated tasks what the prompt was made from (``a``, ``b``, ``op`` for arithmetic)."""
