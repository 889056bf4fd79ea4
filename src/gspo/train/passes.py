"""Per-token log-probabilities (and entropies) of completions under the trainer's model, the numbers every
importance ratio is built from.

Shapes: ``N`` sequences, ``P`` padded prompt length, ``T`` padded completion length, ``H`` hidden size,
``V`` vocabulary, ``M`` completion tokens in the batch (``mask.sum()``).

    logp[i, t] = log softmax(W h[i, P - 1 + t] / tau)[y[i, t]]
    entropy[i, t] = - sum_v pi(v) log pi(v),   pi = softmax(W h[i, P - 1 + t] / tau)

Padded layout (default on a CPU): the decoder runs once on ``[left-padded prompt | right-padded completion]`` with
``position_ids = cumsum(mask) - 1`` (left padding shifts nothing). Packed layout (``packed=True``, default on a GPU with
flash attention): the ``N`` sequences ``prompt_i + completion_i`` (no padding) are concatenated into one row of
``sum_i (len(prompt_i) + len_i)`` tokens, positions restart at 0 for each, and attention is causal within each
sequence only (flash attention's variable-length kernel on CUDA): no compute is spent on padding, which in RL batches
(a long tail of completion lengths) is often most of the padded tensor. The language-model head is then applied only at the ``M`` completion positions, in
chunks of ``chunk_size``, each wrapped in activation checkpointing under grad: the float32 ``(N, T, V)`` logits
never exist at once, neither in the forward nor as saved activations (the backward recomputes one chunk's logits).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from gspo.errors import UserError
from gspo.models import (attention_context, attention_implementation, autocast_context, final_logits, pad_sequences,
                         positions_from_mask)
from gspo.models.moe import Routing, packed_layout, padded_layout
from gspo.runtime import CAPTURE_LOCK, free_gpu_bytes, to_device


def sequence_logprobs(model, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The arguments and docstring are _sequence_logprobs's (copied below); a model sharded by gspo.parallel.fsdp.shard runs it
    # as a forward of its root FSDP unit (see as_fsdp_forward).
    entry = getattr(model, _FSDP_ENTRY, None)
    return entry(*args, **kwargs) if entry is not None else _sequence_logprobs(model, *args, **kwargs)


_FSDP_ENTRY = "gspo_sequence_logprobs"
_FSDP_VALUE_ENTRY = "gspo_sequence_values"


def as_fsdp_forward(model) -> None:
    """Register the log-prob pass as a forward method of ``model``'s root FSDP2 unit. The pass calls the decoder and
    the LM head itself (to compute the head in chunks) instead of ``model.forward``, so without this the root unit's
    parameters -- embeddings, final norm, LM head -- would never be gathered, nor their gradients reduced."""
    def entry(self, *args, **kwargs):
        logp, entropy = _sequence_logprobs(self, *args, **kwargs)
        return logp.clone(), entropy

    _register_fsdp_entry(model, _FSDP_ENTRY, entry)


def as_fsdp_value_forward(critic) -> None:
    """:func:`as_fsdp_forward` for PPO's value model: its embeddings and final norm are the root unit's, which only a
    registered forward method gathers (the pass calls the backbone and the scalar head itself)."""
    _register_fsdp_entry(critic, _FSDP_VALUE_ENTRY, lambda self, *a, **k: _sequence_values(self, *a, **k).clone())


def _register_fsdp_entry(model, name: str, entry) -> None:
    """``entry(model, ...)`` as forward method ``name`` of ``model``'s root FSDP2 unit (entries clone their output:
    FSDP hooks its backward on it, which must not be a view)."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, name, types.MethodType(entry, model))
    register_fsdp_forward_method(model, name)


def _sequence_logprobs(
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
    packed: bool = False,
    graphs: "PackedGraphs | None" = None,
    routing: Routing | None = None,
    row_ids: torch.Tensor | None = None,
    pack_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``(N, T)`` float32 of ``completion_ids`` given ``prompt_ids`` under
    ``softmax(logits / temperature)``, differentiable w.r.t. the model, 0 where ``completion_mask`` is False;
    and the per-token entropies ``(N, T)`` float32 (no grad) when ``with_entropy``, else ``None``.

    With ``routing`` (an MoE model's :class:`gspo.models.moe.Routing`), the forward's token layout goes to it first:
    row ``i`` here is row ``row_ids[i]`` of the rollout batch, so routing records follow rows whatever the layout.
    ``pack_tokens``: with CUDA graphs, the packed row is padded to the bucket of at least this many tokens (see
    :meth:`PackedGraphs.hidden`)."""
    if len(prompt_ids) != completion_ids.shape[0] or any(len(p) == 0 for p in prompt_ids):
        raise UserError(f"sequence_logprobs got {len(prompt_ids)} prompts for {completion_ids.shape[0]} completions "
                        f"or an empty prompt: pass one non-empty prompt per completion row.")
    device = next(model.parameters()).device
    # Index arithmetic on the CPU, then one non-blocking copy each: on a GPU a nonzero(), a boolean index or a plain
    # .to() would each wait for every kernel queued before it.
    ids_cpu, mask_cpu = completion_ids.cpu(), completion_mask.cpu().bool()  # (N, T)
    n_rows, width = ids_cpu.shape
    flat_cpu = mask_cpu.reshape(-1).nonzero().squeeze(-1)  # (M,) completion tokens, row-major
    flat = to_device(flat_cpu, device)
    targets = to_device(ids_cpu.reshape(-1).index_select(0, flat_cpu), device)  # (M,)
    if routing is not None and row_ids is None:
        row_ids = torch.arange(n_rows)
    hidden = _completion_hidden(model, prompt_ids, ids_cpu, mask_cpu, flat, pad_id=pad_id, autocast_dtype=autocast_dtype,
                                packed=packed, graphs=graphs, routing=routing, row_ids=row_ids,
                                pack_tokens=pack_tokens)  # (M, H)

    head = model.get_output_embeddings()
    config = model.config
    chunk_logp, chunk_entropy = [], []
    for start in range(0, flat_cpu.numel(), chunk_size):
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


def _completion_hidden(model, prompt_ids, ids_cpu, mask_cpu, flat, *, pad_id, autocast_dtype, packed, graphs=None,
                       routing=None, row_ids=None, pack_tokens: int = 0) -> torch.Tensor:
    """The decoder's final hidden states ``(M, H)`` at the positions that predict each completion token (row-major,
    ``flat`` the completion tokens' flat indices on the device): one packed row, or padded rows."""
    if packed:
        return _packed_hidden(model, prompt_ids, ids_cpu, mask_cpu, autocast_dtype, graphs, routing, row_ids,
                              pack_tokens)  # (M, H)
    device = next(model.parameters()).device
    n_rows, width = ids_cpu.shape
    input_ids, attention_mask, prompt_len = pad_sequences(prompt_ids, ids_cpu, mask_cpu, pad_id)  # (N, P+T)
    input_ids, attention_mask = to_device(input_ids, device), to_device(attention_mask, device)
    position_ids = positions_from_mask(attention_mask)
    if routing is not None:  # position P-1+t predicts completion token t
        predicts = torch.nn.functional.pad(mask_cpu, (prompt_len - 1, 1))  # (N, P+T)
        routing.set_layout(padded_layout(attention_mask, position_ids, to_device(predicts, device), row_ids))
    with autocast_context(device, autocast_dtype), attention_context():
        hidden = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state  # (N, P+T, H)
    # Position P-1+t predicts completion token t.
    hidden = hidden[:, prompt_len - 1: prompt_len + width - 1]  # (N, T, H)
    return hidden.reshape(n_rows * width, -1).index_select(0, flat)  # (M, H)


def sequence_values(critic, *args, **kwargs) -> torch.Tensor:
    # The arguments and docstring are _sequence_values's; a value model sharded by gspo.parallel.fsdp.shard runs it as
    # a forward of its root FSDP unit (see as_fsdp_value_forward).
    entry = getattr(critic, _FSDP_VALUE_ENTRY, None)
    return entry(*args, **kwargs) if entry is not None else _sequence_values(critic, *args, **kwargs)


def _sequence_values(critic, prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     *, pad_id: int, autocast_dtype: torch.dtype | None = None, packed: bool = False,
                     graphs: "PackedGraphs | None" = None, pack_tokens: int = 0) -> torch.Tensor:
    """A value model's estimates ``(N, T)`` float32, V(s_t) for each completion token t: its scalar head on the hidden
    state at the position that predicts token t (the state before the token is chosen), differentiable w.r.t. the
    critic, 0 where ``completion_mask`` is False. ``critic``: a :class:`gspo.models.value.ValueModel`."""
    device = next(critic.parameters()).device
    ids_cpu, mask_cpu = completion_ids.cpu(), completion_mask.cpu().bool()  # (N, T)
    n_rows, width = ids_cpu.shape
    flat_cpu = mask_cpu.reshape(-1).nonzero().squeeze(-1)  # (M,)
    flat = to_device(flat_cpu, device)
    hidden = _completion_hidden(critic, prompt_ids, ids_cpu, mask_cpu, flat, pad_id=pad_id,
                                autocast_dtype=autocast_dtype, packed=packed, graphs=graphs,
                                pack_tokens=pack_tokens)  # (M, H)
    values = critic.head(hidden.float()).squeeze(-1)  # (M,) in fp32, whatever the backbone computed in
    out = torch.zeros(n_rows * width, dtype=torch.float32, device=device)
    return out.index_copy(0, flat, values).view(n_rows, width)


def _packed_hidden(model, prompt_ids, completion_ids, completion_mask, autocast_dtype, graphs=None, routing=None,
                   row_ids=None, pack_tokens: int = 0) -> torch.Tensor:
    """Final hidden states ``(M, H)`` at the positions that predict each completion token (row-major, as ``flat``),
    from one packed row of every ``prompt_i + completion_i``. ``completion_ids`` and ``completion_mask`` are CPU
    tensors: the layout is worked out here and sent to the device without a synchronisation.

    Completion tokens must be a prefix of each row (``completion_mask[i] = [1]*len_i + [0]*...``), as rollouts are.
    """
    device = next(model.parameters()).device
    lengths = completion_mask.sum(-1)  # (N,)
    if not torch.equal(completion_mask, torch.arange(completion_mask.shape[1])[None, :] < lengths[:, None]):
        raise UserError("packed log-probs need each completion's tokens first in its row (mask = 1..1 0..0); use "
                        "train.packing = 'off' for other layouts.")
    comp = completion_ids.tolist()
    seq_lens = [len(p) + int(n) for p, n in zip(prompt_ids, lengths.tolist())]
    ids = [t for p, c, n in zip(prompt_ids, comp, lengths.tolist()) for t in (*p, *c[:n])]
    ids = to_device(torch.tensor(ids, dtype=torch.long)[None], device)  # (1, S) S = sum of seq_lens
    pos = to_device(torch.cat([torch.arange(n) for n in seq_lens])[None], device)  # (1, S)
    cu_cpu = torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # (N+1,)
    cu = to_device(cu_cpu, device)
    # Row i's token t is predicted at packed index start_i + len(prompt_i) - 1 + t.
    first = torch.tensor([s + len(p) - 1 for s, p in zip(cu_cpu[:-1].tolist(), prompt_ids)])  # (N,)
    at = to_device((first[:, None] + torch.arange(completion_mask.shape[1])[None, :])[completion_mask], device)  # (M,)
    if routing is not None:
        routing.set_layout(packed_layout(seq_lens, pos, at, row_ids))
    hidden = graphs.hidden(ids, pos, cu, pack_tokens) if graphs is not None else None  # (1, S, H) or None
    if hidden is None:
        with autocast_context(device, autocast_dtype):
            hidden = _packed_decoder_forward(model.get_decoder(), ids, pos, cu, max(seq_lens))  # (1, S, H)
    return hidden[0].index_select(0, at)  # (M, H)


def _packed_decoder_forward(decoder, ids, pos, cu, max_length: int) -> torch.Tensor:
    """The decoder over one packed row with the packed attention: ``(1, S, H)``."""
    with attention_implementation(decoder.config, "gspo_packed"), fused_norms(decoder, ids.device.type == "cuda"):
        return decoder(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max_length, max_length_k=max_length).last_hidden_state


# RMSNorms computing weight * (x * rsqrt(mean(x^2) + eps)), which torch's rms_norm computes too.
_PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


@contextlib.contextmanager
def fused_norms(decoder: torch.nn.Module, enabled: bool = True):
    """While active, the decoder's RMSNorms over fp32 inputs run as torch's ``rms_norm`` (on CUDA one fused kernel
    forward and one backward) instead of HF's six elementwise and reduction kernels each way.

    With the update's host overhead gone (CUDA graphs), a packed forward and backward is bound by the GPU's many small
    memory-bound kernels, the norms' among the most numerous. Same formula in fp32; inputs of other dtypes (Qwen3's
    per-head norms see bf16 under autocast) keep HF's code, whose casts differ."""
    patched = []
    if enabled:
        for module in decoder.modules():
            if type(module).__name__ in _PLAIN_RMS_NORMS and hasattr(module, "variance_epsilon"):
                module.forward = _fused_rms_forward.__get__(module)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to the class's forward


def _fused_rms_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    if hidden.dtype == torch.float32 and self.weight.dtype == torch.float32:
        return F.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden)


class _GraphableDecoder(torch.nn.Module):
    """The decoder's packed forward with everything a CUDA graph must fix (length bound, autocast) fixed."""

    def __init__(self, decoder: torch.nn.Module, length: int, autocast_dtype: torch.dtype | None):
        super().__init__()
        self.decoder = decoder
        self.length = length
        self.autocast_dtype = autocast_dtype

    def forward(self, ids, pos, cu):
        # Autocast's weight cache must be off under capture (it would freeze the casts made before it).
        with autocast_context(ids.device, self.autocast_dtype, cache=False):
            return _packed_decoder_forward(self.decoder, ids, pos, cu, self.length)


class PackedGraphs:
    """CUDA graphs of the decoder's forward and backward over packed sequences, one pair per shape bucket.

    On a GPU the update is bound by the host, not the chip: an eager forward and backward of a 30-layer model issue
    thousands of small kernels, each costing tens of microseconds of Python and dispatch (on the H200 machine a
    64-sequence update took ~0.13 s whatever the token count). Replaying a captured graph issues them all at once.

    A packed row of ``S`` tokens is padded to a bucket of ``2^k`` or ``1.5 * 2^k`` tokens with one dummy sequence at
    the end (attention never crosses sequences, so the real tokens see exactly what they would unpadded); the graph
    is captured on first use of a (bucket, sequences) shape with ``torch.cuda.make_graphed_callables`` (three eager
    warm-up passes, then capture), all buckets sharing one memory pool. Parameters are read in place, so optimizer
    steps are seen. Gradients reach ``param.grad`` through autograd as usual: ``.grad`` is allocated before a graphed
    backward, so that accumulation adds into it instead of keeping a view of the graph's gradient buffer (which the
    next replay would overwrite). Each graph keeps its own gradient buffers and the activations its backward reads
    (about 1 MB per token for a 135M model), for the life of the run, so a shape is graphed only while that fits
    (:func:`graph_fits`): at most ``max_graphs`` shapes, buckets of at most ``max_tokens`` tokens (past that the GPU
    work dwarfs the host overhead a graph saves), and only with room to spare in free GPU memory for the estimated
    size, measured on the first capture. Other shapes run eagerly. Any capture failure turns the graphs off for the
    run (with a warning).
    """

    def __init__(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None, max_graphs: int = 8,
                 max_tokens: int = 65536):
        self.decoder = model.get_decoder()
        self.autocast_dtype = autocast_dtype
        self.graphed: dict[tuple[int, int], torch.nn.Module] = {}
        self.params = [p for p in self.decoder.parameters() if p.requires_grad]
        self.max_graphs = max_graphs
        self.max_tokens = max_tokens
        self.bytes_per_token = 0.0  # GPU memory a captured graph keeps per bucket token, measured at each capture
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self.warmup_s = 0.0  # seconds spent capturing, cumulative

    @staticmethod
    def bucket(tokens: int) -> int:
        """The smallest of 1024, 1536, 2048, 3072, 4096, ... that is >= ``tokens``."""
        size = 1024
        while size < tokens:
            size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
        return size

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, at_least: int = 0) -> torch.Tensor | None:
        """``(1, S, H)`` hidden states of the packed row ``ids`` ``(1, S)``, or None when graphs are off. The row is
        padded to the bucket of ``max(S, at_least) + 1`` tokens: under torchrun every process passes the largest
        packed length any process has at this micro-batch, so that all of them capture (and replay) the same shapes
        in the same step, instead of each stopping the others at its own captures."""
        if not self.enabled:
            return None
        S = ids.shape[1]
        size = self.bucket(max(S, at_least) + 1)  # at least one dummy token, so the dummy sequence is never empty
        pad = size - S
        ids_b = torch.cat([ids, ids.new_zeros(1, pad)], 1)  # (1, size)
        pos_b = torch.cat([pos, torch.arange(pad, device=pos.device)[None]], 1)  # (1, size)
        cu_b = torch.cat([cu, cu.new_full((1,), size)])  # (N+2,)
        key = (size, cu_b.numel())
        if key not in self.graphed and not graph_fits(size, len(self.graphed), self.max_graphs, self.max_tokens,
                                                      self.bytes_per_token, free_gpu_bytes(ids.device)):
            return None
        if torch.is_grad_enabled():
            allocate_grads(self.params)
        if key not in self.graphed:
            graphed, per_token, seconds = capture_graphed(
                lambda: _GraphableDecoder(self.decoder, size, self.autocast_dtype), (ids_b, pos_b, cu_b), self.pool,
                "for the update")
            self.warmup_s += seconds
            if graphed is None:
                self.enabled = False
                return None
            self.graphed[key] = graphed
            self.bytes_per_token = max(self.bytes_per_token, per_token)
        return self.graphed[key](ids_b, pos_b, cu_b)[:, :S]


def allocate_grads(params) -> None:
    """Before a graphed backward: its backward hands autograd views of the graph's gradient buffers, and a parameter
    whose .grad is None would keep such a view as its .grad, which the next replay would then overwrite and add to
    itself; a zero .grad of its own is accumulated into instead."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def capture_graphed(make_module, inputs: tuple, pool, what: str) -> tuple[torch.nn.Module | None, float, float]:
    """One CUDA graph of forward and backward (``torch.cuda.make_graphed_callables``) of the module ``make_module()``
    builds, over the device tensors ``inputs``: ``(the graphed module, the GPU memory it kept per token of inputs[0],
    seconds spent)``. The first use may be a no-grad pass: the backward graph is captured too. A capture can fail in
    many ways (a host sync in a model's forward, memory): then the module is None, after a warning that CUDA graphs
    ``what`` are off for this run."""
    import logging
    import time

    t0 = time.perf_counter()
    device = inputs[0].device
    reserved = torch.cuda.memory_reserved(device)
    failed = None
    try:
        module = make_module()
        module.training = True  # the graphed forward runs while this flag matches; the model's own modes stay
        with torch.enable_grad(), CAPTURE_LOCK:  # not while an asynchronous rollout collects (see gspo.runtime)
            graphed = torch.cuda.make_graphed_callables(module, inputs, pool=pool)
    except Exception as e:  # noqa: BLE001 -- reported below and the pass runs eager
        failed = f"{type(e).__name__}: {e}"
    if failed is not None:  # outside the except block: its traceback no longer holds the capture's tensors
        logging.getLogger("gspo").warning("CUDA graphs %s are off for this run (%s); it runs eager.", what, failed)
        return None, 0.0, time.perf_counter() - t0
    size = inputs[0].numel()
    return graphed, (torch.cuda.memory_reserved(device) - reserved) / size, time.perf_counter() - t0


def graph_fits(size: int, graphs: int, max_graphs: int, max_tokens: int, bytes_per_token: float, free_bytes: int) -> bool:
    """Whether :class:`PackedGraphs` may capture one more graph, of a ``size``-token bucket, with ``graphs`` captured
    so far. Its estimated memory (``bytes_per_token`` as measured on earlier captures; 0 before the first) must leave
    at least as much again free for the eager passes and the next rollout."""
    if graphs >= max_graphs or size > max_tokens:
        return False
    return 2 * bytes_per_token * size <= free_bytes


def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):
    """Causal attention within each packed sequence: query (1, H, S, D), key/value (1, Hkv, S, D) -> (1, S, H, D).

    CUDA: flash attention's variable-length kernel (``torch.nn.attention.varlen``), no padding and no mask. Elsewhere
    (the CPU tests): scaled-dot-product attention per sequence, the reference the flash path is checked against.
    """
    _, H, S, D = query.shape
    kv_heads = key.shape[1]
    q = query[0].transpose(0, 1)  # (S, H, D)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (S, Hkv, D)
    half = torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else value.dtype
    if query.is_cuda and half in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        # Autocast would cast SDPA's inputs to bf16 (the rotary embedding leaves q and k in float32); it does not know
        # this op, so cast here. Flash attention has no float32 kernel: float32 takes the per-sequence path below.
        q, k, v = q.to(half), k.to(half), v.to(half)
        if kv_heads != H:  # torch 2.11's varlen_attn has no grouped-query option
            k, v = k.repeat_interleave(H // kv_heads, 1), v.repeat_interleave(H // kv_heads, 1)
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, cu_seq_lens_q, max_length_q,
                          max_length_q, scale=scaling, window_size=(-1, 0))  # (S, H, D)
        return out[None], None
    outs = []
    bounds = cu_seq_lens_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           is_causal=True, scale=scaling, enable_gqa=kv_heads != H)  # (H, n, D)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)[None], None


AttentionInterface.register("gspo_packed", _packed_attention)


def packing_unsupported(config) -> str | None:
    """Why the packed path cannot run this model (None if it can): it knows causal full attention only."""
    layer_types = getattr(config, "layer_types", None) or []
    if (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)) or \
            any("sliding" in str(t) for t in layer_types):
        return "it uses sliding-window attention"
    return None


def packing_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether packed log-probs run on a fast kernel here: flash attention's variable-length path on CUDA, with
    ``dtype`` (the autocast or weight dtype) half precision."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not torch.backends.cuda.flash_sdp_enabled():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


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


functools.update_wrapper(sequence_logprobs, _sequence_logprobs, assigned=("__doc__",))  # help() shows the arguments
