"""Per-token log-probabilities (and entropies) of completions under the trainer's model, the numbers every
importance ratio is built from.

Shapes: ``N`` sequences, ``P`` padded prompt length, ``T`` padded completion length, ``H`` hidden size,
``V`` vocabulary, ``M`` completion tokens in the batch (``mask.sum()``).

    logp[i, t] = log softmax(W h[i, P - 1 + t] / tau)[y[i, t]]
    entropy[i, t] = - sum_v pi(v) log pi(v),   pi = softmax(W h[i, P - 1 + t] / tau)

The decoder runs once on ``[left-padded prompt | right-padded completion]`` with ``position_ids = cumsum(mask) - 1``
(left padding shifts nothing). The language-model head is then applied only at the ``M`` completion positions, in
chunks of ``chunk_size``, each wrapped in activation checkpointing under grad: the float32 ``(N, T, V)`` logits
never exist at once, neither in the forward nor as saved activations (the backward recomputes one chunk's logits).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gspo.errors import UserError
from gspo.models import attention_context, autocast_context
from gspo.rollout.hf import pad_prompts, positions_from_mask


def sequence_logprobs(
    model,
    prompt_ids: list[list[int]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    pad_id: int,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``(N, T)`` float32 of ``completion_ids`` given ``prompt_ids`` under
    ``softmax(logits / temperature)``, differentiable w.r.t. the model, 0 where ``completion_mask`` is False;
    and the per-token entropies ``(N, T)`` float32 (no grad) when ``with_entropy``, else ``None``."""
    if len(prompt_ids) != completion_ids.shape[0] or any(len(p) == 0 for p in prompt_ids):
        raise UserError(f"sequence_logprobs got {len(prompt_ids)} prompts for {completion_ids.shape[0]} completions "
                        f"or an empty prompt: pass one non-empty prompt per completion row.")
    device = next(model.parameters()).device
    completion_ids = completion_ids.to(device)  # (N, T)
    completion_mask = completion_mask.to(device).bool()  # (N, T)
    n_rows, width = completion_ids.shape
    prompt, prompt_mask = pad_prompts(prompt_ids, pad_id)  # (N, P)
    prompt_len = prompt.shape[1]
    input_ids = torch.cat([prompt.to(device), completion_ids.masked_fill(~completion_mask, pad_id)], 1)  # (N, P+T)
    attention_mask = torch.cat([prompt_mask.to(device), completion_mask.long()], 1)  # (N, P+T)

    with autocast_context(device, autocast_dtype), attention_context():
        hidden = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state  # (N, P+T, H)
    # Position P-1+t predicts completion token t.
    hidden = hidden[:, prompt_len - 1: prompt_len + width - 1]  # (N, T, H)
    flat = completion_mask.reshape(-1).nonzero().squeeze(-1)  # (M,)
    hidden = hidden.reshape(n_rows * width, -1).index_select(0, flat)  # (M, H)
    targets = completion_ids.reshape(-1).index_select(0, flat)  # (M,)

    head = model.get_output_embeddings()
    config = model.config
    chunk_logp, chunk_entropy = [], []
    for start in range(0, flat.numel(), chunk_size):
        args = (hidden[start:start + chunk_size], targets[start:start + chunk_size], head, config, temperature,
                with_entropy, device, autocast_dtype)
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            logp, entropy = _chunk(*args)
        chunk_logp.append(logp)
        chunk_entropy.append(entropy)

    out = torch.zeros(n_rows * width, dtype=torch.float32, device=device)  # (N*T,)
    logp = out.index_copy(0, flat, torch.cat(chunk_logp)) if chunk_logp else out  # (N*T,)
    entropy = None
    if with_entropy:
        entropy = out.index_copy(0, flat, torch.cat(chunk_entropy)) if chunk_entropy else out.clone()  # (N*T,)
        entropy = entropy.view(n_rows, width).detach()  # (N, T)
    return logp.view(n_rows, width), entropy


def _chunk(hidden, targets, head, config, temperature, with_entropy, device, autocast_dtype):
    """Log-prob of each target (C,) and, without grad, the entropy (C,) for one chunk of C positions."""
    with autocast_context(device, autocast_dtype):
        logits = head(hidden)  # (C, V)
    logits = final_logits(config, logits.float()) / temperature  # (C, V) float32
    logp_all = F.log_softmax(logits, -1)  # (C, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (C,)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # (C,)
    return logp, entropy


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

