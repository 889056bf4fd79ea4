"""The task instance, in a module that imports nothing heavy: reward workers unpickle examples, and a worker that had
to import torch for it would take seconds to start instead of milliseconds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    """One task instance: what the model is asked and what a verifier needs to score the answer."""

    prompt: str | list[dict[str, str]]
    """A user message (wrapped in the chat template) or a full list of chat messages."""
    answer: str | None = None
    """The reference answer a verifier compares against (``None`` for reward functions that need none)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Any other fields of the source row; passed through to reward functions."""
