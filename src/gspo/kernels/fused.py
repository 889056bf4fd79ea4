"""The graph engine's fused decode step for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) and their MoE
relatives (Mixtral, Qwen2-MoE, Qwen3-MoE).

Home: ``gspo.kernels.fused``, the forward both sides run: the graph engine (:mod:`gspo.rollout.graph`) samples with
:class:`FusedDecoder`, and under ``rollout.exact`` the trainer's pass (:mod:`gspo.train.exact`) is its
``forward_tokens``. Its packed weight copies (``FusedDecoder.copies``) are the storage of the engine's weight copy.

A decode layer becomes 4 GEMMs over packed low-precision copies of the layer's weights (q|k|v, o, gate|up, down) and
5 Triton kernels (:mod:`gspo.kernels.fused_kernels`): residual add + RMSNorm, rotary + K/V cache write, grouped-query
attention over live slots, SiLU-and-multiply, and the next residual add + RMSNorm. It reads the same weights as the
module path (the packed weights are the graph engine's own copy, refreshed by its ``sync_weights``; the norm weights
are read from that copy in place) and rounds like HF's modules under autocast, so it samples the same distribution; a
GPU test checks its tokens and log-probs against the module path, and the CPU tests run the kernels in Triton's interpreter.

An MoE layer runs the same attention kernels; its sparse block (router, top-k, the experts as grouped GEMMs over the
copy's low-precision expert weights, Qwen2-MoE's shared expert) is the family's own module, called on the fused
step's normed hidden state: no host sync inside it (transformers sizes the expert groups with ``histc``), so it is
captured in the step's CUDA graph, and hooks on its router (R3's route records) become kernels of that graph. Under
``rollout.exact`` the block is :func:`exact_sparse` instead: the same function on batch-invariant kernels.

Anything this path does not cover (other activations, sliding windows, odd head sizes, no Triton) makes
:func:`fused_unsupported` say why, and the engine keeps the module path.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from gspo.models import head_dim, kv_heads

FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def _dense_mlp(mlp) -> bool:
    return all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _sparse_block(mlp) -> bool:
    """An MoE block the fused step calls as a module: a top-k router at ``mlp.gate`` and stacked experts."""
    from gspo.models.moe import find_routers

    return hasattr(mlp, "experts") and find_routers(mlp) == [getattr(mlp, "gate", None)]


def fused_unsupported(model, length: int = 0) -> str | None:
    """Why the fused step cannot run this model with ``length`` cache slots (0: any short enough), or None when it can.
    The fused attention has no sliding window, so a cache longer than an active window keeps the module step."""
    cfg = model.config
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if getattr(cfg, "model_type", None) not in FAMILY:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(FAMILY)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    heads, groups, width = cfg.num_attention_heads, kv_heads(cfg), head_dim(cfg)
    if width < 16 or width & (width - 1):
        return f"head_dim {width} is not a power of two >= 16"
    if heads % groups:
        return f"{heads} query heads are not a multiple of {groups} KV heads"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and length > window:
        return f"sliding_window {window} is shorter than the cache"
    layers = model.model.layers[: cfg.num_hidden_layers]
    layer = layers[0]
    attn = layer.self_attn
    if not all(isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "the layer's projections are not plain nn.Linear modules (quantised or adapted?)"
    if not all(_dense_mlp(x.mlp) or _sparse_block(x.mlp) for x in layers):
        return "an MLP is neither plain nn.Linear projections nor a top-k MoE block (quantised or adapted?)"
    if not hasattr(attn, "scaling"):
        return "the attention module has no scaling attribute"
    if not hasattr(layer.input_layernorm, "variance_epsilon"):
        return "the layer norms are not RMSNorm"
    return None


def _exact_sparse_why_not(mlp) -> str | None:
    """Why :func:`exact_sparse` cannot run this sparse block (None when it can): a softmax top-k router at ``gate``,
    experts stored as (E, 2I, H) gate|up and (E, H, I) down weights without biases, and at most a gated dense shared
    expert (Qwen2-MoE)."""
    from gspo.models.moe import plain_top_k

    experts, router = mlp.experts, mlp.gate
    gate_up, down = (getattr(experts, n, None) for n in ("gate_up_proj", "down_proj"))
    E, H = router.weight.shape
    shapes_ok = (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3
                 and gate_up.shape[0] == down.shape[0] == E and gate_up.shape[2] == down.shape[1] == H
                 and gate_up.shape[1] == 2 * down.shape[2])
    if not shapes_ok or any(getattr(experts, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")):
        return f"{type(experts).__name__} does not store its experts as bias-free (E, 2I, H) / (E, H, I) weights"
    if getattr(router, "bias", None) is not None or not plain_top_k(router):
        return f"router {type(router).__name__} is not a plain softmax top-k router"
    shared, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    if shared is not None and not (_dense_mlp(shared) and isinstance(gate, torch.nn.Linear) and gate.bias is None
                                   and all(getattr(shared, n).bias is None for n in ("gate_proj", "up_proj", "down_proj"))):
        return "its shared expert is not a bias-free dense MLP under a sigmoid gate"
    return None


def exact_unsupported(model, fused_why_not: str | None, routing=None) -> str | None:
    """Why ``rollout.exact`` cannot run this model (None when it can): the fused step's families, MoE blocks that
    :func:`exact_sparse` runs (Mixtral, Qwen2-MoE, Qwen3-MoE), no routing records (R3: under exact the gradient pass
    forces the exact pass's routes instead), and a rotary embedding whose frequencies do not change with the length (the
    kernels compute cos / sin from ``inv_freq``)."""
    if fused_why_not is not None:
        return fused_why_not
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        why = None if _dense_mlp(layer.mlp) else _exact_sparse_why_not(layer.mlp)
        if why is not None:
            return f"its MoE block has no batch-invariant kernels: {why}"
    if routing is not None:
        return "routing replay records the engine's routes, and under exact the gradient pass forces the exact pass's"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if "dynamic" in str(rope_type) or rope_type == "longrope":
        return f"rope_type {rope_type!r} changes its frequencies with the sequence length"
    return None


def exact_sparse(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rollout.exact``'s MoE block on normed tokens ``x`` (n, H), batch-invariant: the routed experts
    (:func:`gspo.kernels.exact_kernels.experts`) plus, for Qwen2-MoE, sigmoid(gate(x)) times the shared expert, added
    in x's dtype as the family adds them. Reads the block's (the engine copy's) weights. Returns the output (n, H) and
    each token's experts (n, k)."""
    from gspo.kernels import exact_kernels as ek, fused_kernels as fk
    from gspo.models.moe import renormalises

    router = block.gate
    out, chosen = ek.experts(x, router.weight, router.top_k, renormalises(router), block.experts.gate_up_proj,
                             block.experts.down_proj)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        gate_up = torch.cat([ek.linear(x, shared.gate_proj.weight), ek.linear(x, shared.up_proj.weight)], 1)
        act = fk.silu_mul(gate_up)
        gate = torch.sigmoid(ek.linear(x, block.shared_expert_gate.weight))  # (n, 1)
        out = out + gate * ek.linear(act, shared.down_proj.weight)
    return out, chosen


class _Layer:
    """One decoder layer's packed weights (views into the engine's low-precision copies) and its norms."""

    def __init__(self, layer, dtype, device):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.w_qkv = _packed([m.weight for m in self.qkv_parts], dtype, device)
        self.b_qkv = _packed_bias(self.qkv_parts, dtype, device)
        self.o = attn.o_proj
        self.w_o = torch.empty_like(self.o.weight, dtype=dtype)
        self.b_o = None if self.o.bias is None else torch.empty_like(self.o.bias, dtype=dtype)
        self.moe = None if _dense_mlp(mlp) else mlp  # a sparse block runs as its module, on the copy's own weights
        self.gate_up_parts = [] if self.moe is not None else [mlp.gate_proj, mlp.up_proj]
        self.down = None if self.moe is not None else mlp.down_proj
        if self.moe is None:
            self.w_gate_up = _packed([m.weight for m in self.gate_up_parts], dtype, device)
            self.b_gate_up = _packed_bias(self.gate_up_parts, dtype, device)
            self.w_down = torch.empty_like(self.down.weight, dtype=dtype)
            self.b_down = None if self.down.bias is None else torch.empty_like(self.down.bias, dtype=dtype)
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.scale = float(attn.scaling)

    def copies(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """(module, parameter name, low-precision storage) for every weight and bias this layer packs."""
        out = []
        packed = [(self.qkv_parts, self.w_qkv, self.b_qkv)]
        singles = [(self.o, self.w_o, self.b_o)]
        if self.moe is None:
            packed.append((self.gate_up_parts, self.w_gate_up, self.b_gate_up))
            singles.append((self.down, self.w_down, self.b_down))
        for parts, w, bias in packed:
            row = 0
            for m in parts:
                n = m.weight.shape[0]
                out.append((m, "weight", w[row:row + n]))
                if m.bias is not None:
                    out.append((m, "bias", bias[row:row + n]))
                row += n
        for m, w, b in singles:
            out.append((m, "weight", w))
            if b is not None:
                out.append((m, "bias", b))
        return out


def _packed(weights: list[torch.Tensor], dtype, device) -> torch.Tensor:
    return torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=dtype, device=device)


def _packed_bias(parts: list[torch.nn.Linear], dtype, device) -> torch.Tensor | None:
    if all(m.bias is None for m in parts):
        return None
    # A missing bias among biased siblings is zero; its slice is never synced, so it stays zero.
    return torch.zeros(sum(m.weight.shape[0] for m in parts), dtype=dtype, device=device)


class FusedDecoder:
    """The fused decode forward for the graph engine's copy of the model. ``copies()`` lists its packed weights, which
    :class:`gspo.rollout.graph.EngineWeights` makes the storage of that copy's Linear modules: the prefill's module path
    and the fused step read the same tensors, and ``sync_weights`` fills them (no second copy of the weights)."""

    def __init__(self, model, dtype: torch.dtype, device, exact: bool = False):
        cfg = model.config
        self.model = model
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, kv_heads(cfg), head_dim(cfg)
        self.layers = [_Layer(layer, dtype, device) for layer in model.model.layers[: cfg.num_hidden_layers]]
        self.norm = model.model.norm
        self.dtype = dtype
        # rollout.exact: every step runs the batch-invariant kernels of gspo.kernels.exact_kernels, and the prefill
        # (and the trainer's pass, gspo.train.exact) is the same forward over packed tokens (see ``forward_tokens``)
        self.exact = exact
        self.routes: list[torch.Tensor] = []  # see forward_tokens
        self._decode_tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> (arange, ones), static
        if exact:
            rotary = model.model.rotary_emb
            self.inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
            self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    def copies(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        return [c for layer in self.layers for c in layer.copies()]

    def forward(self, tok: torch.Tensor, pos: torch.Tensor, cache, slot: torch.Tensor, starts: torch.Tensor,
                used: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden state (B, H) of one new token per row: tok (B,), pos (B, 1); writes the token's K/V
        to ``cache`` (:class:`~gspo.rollout.graph.StaticKV`) at ``slot`` and attends each row's live slots."""
        # the attention's tiles: one per row, its live slots from starts[b], used[b] of them (0: an ended row)
        first, ones = self._decode_tiles.get(tok.shape[0]) or self._decode_tiles.setdefault(
            tok.shape[0], (torch.arange(tok.shape[0], dtype=torch.int32, device=tok.device),
                           torch.ones(tok.shape[0], dtype=torch.int32, device=tok.device)))
        return self.forward_tokens(tok, pos.view(-1), cache.k, cache.v, slot, (first, ones, starts[:-1], used))

    def packed_forward(self, seqs: list[list[int]], key_starts: list[int], k_store: list[torch.Tensor],
                       v_store: list[torch.Tensor], held: list[int] | None = None) -> torch.Tensor:
        """``forward_tokens`` over sequences ``seqs`` packed in one call (the engine's prefill, a multi-turn
        extension): sequence i already holds ``held[i]`` keys (default 0) from flat slot ``key_starts[i]``, its token
        j is at position ``held[i] + j`` and writes slot ``key_starts[i] + held[i] + j``. The final-norm hidden state
        of each sequence's last token (len(seqs), H)."""
        from gspo.kernels.exact_kernels import packed_tiles
        from gspo.runtime import to_device

        held = held or [0] * len(seqs)
        lens = [len(x) for x in seqs]
        dev = k_store[0].device
        ids = torch.tensor([t for x in seqs for t in x], dtype=torch.long)
        pos = torch.cat([torch.arange(h, h + n) for h, n in zip(held, lens)])
        slot = torch.cat([torch.arange(n) + k + h for n, k, h in zip(lens, key_starts, held)])
        last = torch.tensor(lens).cumsum(0) - 1
        tiles = packed_tiles(lens, key_starts, self.heads // self.kv_heads, dev, held=held)
        return self.forward_tokens(*(to_device(t, dev) for t in (ids, pos)), k_store, v_store, to_device(slot, dev),
                                   tiles, at=to_device(last, dev))

    def forward_tokens(self, ids: torch.Tensor, pos: torch.Tensor, k_store: list[torch.Tensor],
                       v_store: list[torch.Tensor], slot: torch.Tensor, tiles: tuple,
                       at: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states (n, H) of tokens ``ids`` (n,) at positions ``pos`` (n,) (only rows ``at``,
        when given). Each token's K/V go to flat slot ``slot`` of each layer's ``k_store`` / ``v_store`` (any leading
        shape, then Hkv, D) and ``tiles`` say which slots each token attends
        (:func:`gspo.kernels.exact_kernels.tile_attention`). With ``exact`` every kernel is batch-invariant (the
        matmuls too, and rotary from the position in the kernel), so a token's numbers are the same whatever else is
        in the call: a decode step's, a packed pass's, the trainer's (gspo.train.exact)."""
        from gspo.kernels import exact_kernels as ek, fused_kernels as fk

        inner = self.model.model
        n = ids.shape[0]
        linear = ek.linear if self.exact else F.linear
        self.routes = []  # exact: each MoE layer's chosen experts (n, k) of this call, in layer order
        res = inner.embed_tokens(ids)  # (n, H): the residual stream, in the embedding's dtype (as HF's)
        if not self.exact:  # HF's rotary embedding, once for every layer
            cos, sin = inner.rotary_emb(res[:, None], pos[:, None])  # (n, 1, D) each
            cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
        x = torch.empty(n, res.shape[1], dtype=self.dtype, device=res.device)  # the normed input of each block
        q = torch.empty(n, self.heads, self.head_dim, dtype=k_store[0].dtype, device=res.device)
        attn = torch.empty_like(q)
        delta = None
        for i, layer in enumerate(self.layers):
            k, v = k_store[i].view(-1, self.kv_heads, self.head_dim), v_store[i].view(-1, self.kv_heads, self.head_dim)
            fk.add_rmsnorm(res, delta, layer.in_norm.weight, layer.in_norm.variance_epsilon, x)
            qkv = linear(x, layer.w_qkv, layer.b_qkv)  # (n, (Hq + 2 Hkv) D)
            norms = (None if layer.q_norm is None else layer.q_norm.weight,
                     None if layer.k_norm is None else layer.k_norm.weight,
                     0.0 if layer.q_norm is None else layer.q_norm.variance_epsilon)
            if self.exact:
                ek.rope_write(qkv, pos, self.inv_freq, self.rope_scale, q, k, v, slot, self.heads, self.kv_heads,
                              self.head_dim, *norms)
            else:
                fk.rope_cache(qkv, cos, sin, q, k, v, slot, self.heads, self.kv_heads, self.head_dim, *norms)
            ek.tile_attention(q, k, v, tiles, layer.scale, attn)
            o = linear(attn.view(n, -1).to(self.dtype), layer.w_o, layer.b_o)  # (n, H)
            fk.add_rmsnorm(res, o, layer.post_norm.weight, layer.post_norm.variance_epsilon, x)
            if layer.moe is not None:  # the sparse block: the family's module, or its batch-invariant twin
                if self.exact:
                    delta, chosen = exact_sparse(layer.moe, x)  # (n, H), (n, k)
                    self.routes.append(chosen)
                else:
                    delta = layer.moe(x[:, None]).reshape(n, -1)  # (n, H)
                continue
            act = fk.silu_mul(linear(x, layer.w_gate_up, layer.b_gate_up))  # (n, I) from (n, 2I)
            delta = linear(act, layer.w_down, layer.b_down)  # (n, H)
        if at is not None:  # the final norm is per row: only the rows asked for
            res, delta = res.index_select(0, at), delta.index_select(0, at)
        out = torch.empty(res.shape, dtype=self.dtype, device=res.device)
        return fk.add_rmsnorm(res, delta, self.norm.weight, self.norm.variance_epsilon, out)

    def exact_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-norm hidden states (n, H): float32 logits (n, V), batch-invariant."""
        from gspo.kernels import exact_kernels as ek
        from gspo.models import final_logits

        head = self.model.get_output_embeddings()
        return final_logits(self.model.config, ek.linear(hidden, head.weight, head.bias, out_dtype=torch.float32))
