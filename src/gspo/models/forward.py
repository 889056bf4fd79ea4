"""What every forward pass over a Hugging Face decoder shares: the rollout engines, the log-prob pass and the probe all
import these, so each rule lives once.

Shapes: ``B`` rows, ``P`` padded prompt length, ``L`` positions, ``V`` vocabulary.
"""
from __future__ import annotations

import contextlib
import inspect

import torch


# --------------------------------------------------------------------------------------------- shapes of a config


def head_dim(config) -> int:
    """Per-head width: the config's ``head_dim`` when set (Qwen3, Gemma), else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    """Key/value heads (grouped-query attention); configs without the field have one per query head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# --------------------------------------------------------------------------------------------- inputs


def pad_prompts(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(input_ids, attention_mask)``, both ``(B, P)`` int64."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, P)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def pad_sequences(prompts: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[left-padded prompt | right-padded completion]`` rows: ``(input_ids, attention_mask)``, both ``(N, P+T)``
    int64, and the padded prompt length ``P`` (position ``P-1+t`` predicts completion token ``t``)."""
    prompt, prompt_mask = pad_prompts(prompts, pad_id)  # (N, P)
    mask = completion_mask.bool()
    input_ids = torch.cat([prompt, completion_ids.masked_fill(~mask, pad_id)], 1)  # (N, P+T)
    return input_ids, torch.cat([prompt_mask, mask.long()], 1), prompt.shape[1]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens, so a left-padded row starts at position 0.  (B, L)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_token_id(tokenizer, stop_ids: list[int]) -> int:
    """The id that fills ended rows and padding: the tokenizer's pad token, else the first stop token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]


def cache_kwarg(forward) -> str:
    """The keyword a forward takes its KV cache under: transformers 5.24 renamed ``past_key_values`` to ``cache``
    (5.17, the GPU image's version, only knows the old name)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


# --------------------------------------------------------------------------------------------- outputs


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """Apply the output transforms some architectures put after the LM head (their forward does it too)."""
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    if scale is not None:
        logits = logits * scale
    scaling = getattr(config, "logits_scaling", None)  # Granite divides
    if scaling is not None:
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3 squash with tanh
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


# --------------------------------------------------------------------------------------------- contexts


def autocast_context(device: torch.device, dtype: torch.dtype | None, *, cache: bool = True):
    """Mixed-precision context for forward passes: bf16 autocast on CUDA, and on CPUs (oneDNN, ~2x on AVX512-BF16).

    ``cache=False`` for CUDA-graph capture: autocast's weight-cast cache would freeze the bf16 copies of the weights
    made before capture (and free them when the context exits), so the graph must cast the live weights itself.
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def attention_context():
    """Scaled-dot-product attention without the cuDNN kernel.

    Left-padded prompts leave fully masked query rows; cuDNN's attention backward returns NaN for them under bf16
    (seen on an H200 with torch 2.11), which silently turns whole optimizer steps non-finite. The efficient and
    math kernels handle such rows; flash is kept for unmasked batches.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode for the block; afterwards every module's own mode is back (a trainer may keep some
    submodules, a frozen part say, in another mode than the rest)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """Every attention module of the model reads ``config._attn_implementation`` at each call: set it to a registered
    ``AttentionInterface`` name for the block (and for a CUDA-graph capture inside it)."""
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


# --------------------------------------------------------------------------------------------- RL preparation


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward (non-reentrant). transformers 5.2x renamed the method; 5.17
    (the GPU image) only has the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability to 0 and return how many modules had one.

    RL updates compare the policy with itself: the old log-probs come from a no-grad pass and the update recomputes
    them with gradients, in train mode (needed for gradient checkpointing). Active dropout would make the on-policy
    ratio differ from 1 and GSPO's 4e-4 clip range would discard most sequences.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float) and getattr(module, name) > 0:
                setattr(module, name, 0.0)  # functional dropout read from an attribute (e.g. LlamaAttention)
                changed += 1
    for key, value in list(vars(model.config).items()):
        if "dropout" in key and isinstance(value, float) and value > 0:
            setattr(model.config, key, 0.0)
    return changed


def named_weights(model: torch.nn.Module):
    """``(name, tensor)`` for every parameter, tied ones under each of their names (an engine that unties them, as the
    graph engine does for the LM head, needs both): what :meth:`RolloutEngine.sync_weights` takes."""
    for name, param in model.named_parameters(remove_duplicate=False):
        yield name, param.detach()
