"""Models: loading (alias, GGUF, directory, hub id), the forward helpers every pass shares, and what acts on a loaded
Hugging Face model: LoRA adapters (:mod:`gspo.models.lora`), MoE routers and Routing Replay (:mod:`gspo.models.moe`).

Nothing here imports :mod:`gspo.parallel` or :mod:`gspo.rollout` (``tests/test_layout.py``): how a
model is sharded or sampled from is decided by their callers.
"""
from gspo.models.forward import (
    attention_context, attention_implementation, autocast_context, cache_kwarg, disable_dropout, enable_activation_checkpointing, eval_mode,
    final_logits, head_dim, kv_heads, named_weights, pad_prompts, pad_sequences, pad_token_id, positions_from_mask,
)
from gspo.models.load import DEFAULT_MODEL, END_OF_TURN_TOKENS, cache_root, load_model, load_tokenizer, stop_token_ids

__all__ = [
    "DEFAULT_MODEL", "END_OF_TURN_TOKENS", "attention_context", "attention_implementation", "autocast_context",
    "cache_kwarg", "cache_root", "disable_dropout", "enable_activation_checkpointing", "eval_mode", "final_logits", "head_dim", "kv_heads", "load_model",
    "load_tokenizer", "named_weights", "pad_prompts", "pad_sequences", "pad_token_id", "positions_from_mask", "stop_token_ids",
]
