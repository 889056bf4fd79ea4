"""Turning examples into prompt token ids with the model's chat template."""
from __future__ import annotations

from gspo.types import Example


def messages_for(example: Example, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of an example: its own list, or one user turn (after an optional system message)."""
    if isinstance(example.prompt, list):
        msgs = list(example.prompt)
    else:
        msgs = [{"role": "user", "content": example.prompt}]
    if system_prompt is not None and not (msgs and msgs[0].get("role") == "system"):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def encode_prompts(tokenizer, examples: list[Example], system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each example's prompt, ending where the assistant's reply starts."""
    if not examples:
        return []
    if getattr(tokenizer, "chat_template", None):
        # Render to text, then tokenize without adding BOS/EOS again: the template already placed them.
        texts = [tokenizer.apply_chat_template(messages_for(ex, system_prompt), add_generation_prompt=True,
                                               tokenize=False) for ex in examples]
    else:
        texts = [ex.prompt if isinstance(ex.prompt, str) else "\n".join(m["content"] for m in ex.prompt)
                 for ex in examples]
    # One call for the batch: the same ids as one call per text, in half the time
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
