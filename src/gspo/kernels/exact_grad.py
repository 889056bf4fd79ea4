"""``rollout.exact``'s update pass with its own gradient: the exact kernels' forward, a backward of its own.

Home: ``gspo.kernels.exact_grad``, beside the forward kernels it wraps; the trainer's exact pass
(:mod:`gspo.train.exact`) calls it.

The update needs the exact values (the first minibatch's ratio is exactly 1) and d log pi / d theta. Without a
backward for the exact kernels it ran two forwards: the exact one for the values, the ordinary one for the gradient
(+16-24% on an update of the reference run). Here each kernel of :meth:`gspo.kernels.fused.FusedDecoder.forward_tokens`
is an autograd Function whose forward is that kernel on the same inputs -- so the values are the engine's, bit for
bit -- and whose backward is the derivative of the function it computes. The issue allows "the backward may use any
kernel"; we write these because no library has a backward for our batch-invariant kernels, and a generic recompute
(activation checkpointing of a torch twin) would pay the ordinary forward again.

Precision follows autocast's (the ordinary pass's): activations and weights in bf16 through the matmuls, the residual
stream, norms and their gradients in fp32 (the residual stream is fp32 in both passes: the embedding and norms keep the
master's dtype), and each weight's gradient goes to its fp32 master, cast as autocast's cast backward does.

- ``linear`` (y = x W^T + b): dx = g W, dW = g^T x (one bf16 matmul each, fp32 accumulation), db = sum g;
  packed q|k|v and gate|up weights split their gradient to each projection's master.
- ``add + RMSNorm`` (r' = r + delta, x = w * r' / rms(r')), ``rotary`` (with Qwen3's per-head q/k norms) and
  ``SiLU * up``: one fused Triton kernel each (:mod:`gspo.kernels.grad_kernels`; as torch ops they were ~10 elementwise
  kernels each and made the backward 20 ms slower than autocast's).
- ``attention``: recomputed by flash attention's variable-length kernel on CUDA in half precision (per-sequence SDPA
  otherwise) and differentiated by it: flash's backward recomputes its scores anyway.
- ``LM head + log-softmax``: per chunk, the logits recomputed as the ordinary pass's checkpointed head computes them
  (a bf16 matmul, as autocast's, where the forward's exact kernel accumulates them in fp32) and differentiated by
  autograd.

MoE blocks keep the two-forward update (:func:`gspo.train.exact.with_gradient_of`): their extra cost was measured at
+1% (``docs/experiments/engine/exact``), the routed experts' backward is not written.

Shapes: ``S`` packed tokens, ``H`` hidden, ``M`` completion tokens, ``D`` head size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

Tensor = torch.Tensor


class _Linear(Function):
    """``ek.linear(x, w, b)``; the gradient of the packed w (and b) goes to the masters it packs, split by rows."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, parts: tuple, *masters: Tensor) -> Tensor:
        # parts: for each master, ("w" | "b", first row, rows) in the packed weight / bias
        from gspo.kernels import exact_kernels as ek

        ctx.save_for_backward(x, w)
        ctx.parts = parts
        return ek.linear(x, w, b)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = g @ w if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x).float()  # (N, K): bf16 operands as autocast's matmul backward, its cast's backward to fp32
        db = g.float().sum(0) if any(kind == "b" for kind, _, _ in ctx.parts) else None
        grads = [(dw if kind == "w" else db)[lo:lo + n] if need else None
                 for (kind, lo, n), need in zip(ctx.parts, ctx.needs_input_grad[4:])]
        return (dx, None, None, None, *grads)


def _linear_parts(modules: list, names: dict[int, str]) -> tuple[tuple, list[str]]:
    """``parts`` of :class:`_Linear` and the masters' names for one packed matmul over ``modules`` (the copy's Linear
    modules, packed by rows in order; ``names``: module id -> its name). Weights first, then the biases there are: a
    bias sits at its module's rows of the packed bias (a missing one is zero there)."""
    parts, used, biases, lo = [], [], [], 0
    for m in modules:
        n = m.weight.shape[0]
        parts.append(("w", lo, n))
        used.append(f"{names[id(m)]}.weight")
        if m.bias is not None:
            biases.append((("b", lo, n), f"{names[id(m)]}.bias"))
        lo += n
    return tuple(parts + [p for p, _ in biases]), used + [n for _, n in biases]


class _AddNorm(Function):
    """``r' = r + delta`` (fp32 residual, as the kernel adds it) and ``x = w * rmsnorm(r')`` in ``dtype``."""

    @staticmethod
    def forward(ctx, res: Tensor, delta: Tensor | None, weight: Tensor, eps: float, dtype: torch.dtype):
        from gspo.kernels import fused_kernels as fk

        new = res.clone()
        x = torch.empty(new.shape, dtype=dtype, device=new.device)
        fk.add_rmsnorm(new, delta, weight, eps, x)
        ctx.save_for_backward(new, weight)
        ctx.eps, ctx.delta_dtype = eps, None if delta is None else delta.dtype
        return new, x

    @staticmethod
    def backward(ctx, g_new: Tensor | None, g_x: Tensor | None):
        from gspo.kernels import grad_kernels

        new, weight = ctx.saved_tensors
        if g_x is None:
            g_total, dw = g_new.float(), None
        else:
            g_total, dw = grad_kernels.rmsnorm_backward(new, g_x, weight, ctx.eps, g_new)
        d_delta = None if ctx.delta_dtype is None else g_total.to(ctx.delta_dtype)
        return g_total, d_delta, dw, None, None


class _Rope(Function):
    """``ek.rope_write``: (q, k, v) (n, Hq|Hkv|Hkv, D) of the q|k|v matmul's output, rotated (Qwen3: normed first)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, pos: Tensor, shape: tuple, inv_freq: Tensor, scale: float, eps: float,
                q_norm: Tensor | None, k_norm: Tensor | None):
        from gspo.kernels import exact_kernels as ek

        heads, kv_heads, D = shape
        n = qkv.shape[0]
        q = torch.empty(n, heads, D, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(n, kv_heads, D, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        ek.rope_write(qkv, pos, inv_freq, scale, q, k, v, torch.arange(n, device=qkv.device), heads, kv_heads, D,
                      q_norm, k_norm, eps)
        ctx.save_for_backward(qkv, pos, inv_freq, q_norm, k_norm)
        ctx.shape, ctx.scale, ctx.eps = shape, scale, eps
        return q, k, v

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor, gv: Tensor):
        from gspo.kernels import grad_kernels

        qkv, pos, inv_freq, q_norm, k_norm = ctx.saved_tensors
        heads, kv_heads, D = ctx.shape
        n = qkv.shape[0]
        if q_norm is None:
            return grad_kernels.rope_backward(gq, gk, gv, pos, inv_freq, ctx.scale, qkv.dtype), *[None] * 7
        # Qwen3: the rotation's gradient is the per-head norms' output gradient; then each head's norm backward
        pre = grad_kernels.rope_backward(gq, gk, gv, pos, inv_freq, ctx.scale, torch.float32)
        split = [heads * D, kv_heads * D, kv_heads * D]
        (q_raw, k_raw, _), (g_q, g_k, g_v) = qkv.split(split, 1), pre.split(split, 1)
        dq, dqn = grad_kernels.rmsnorm_backward(q_raw.reshape(-1, D), g_q.reshape(-1, D), q_norm, ctx.eps)
        dk, dkn = grad_kernels.rmsnorm_backward(k_raw.reshape(-1, D), g_k.reshape(-1, D), k_norm, ctx.eps)
        d_qkv = torch.cat([dq.view(n, -1), dk.view(n, -1), g_v], 1).to(qkv.dtype)
        return d_qkv, None, None, None, None, None, dqn, dkn


def reference_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    """Causal attention within each packed sequence (``cu``: (N+1,) int32 boundaries): q (S, Hq, D), k / v (S, Hkv, D)
    -> (S, Hq, D), differentiable: flash attention's variable-length kernel on CUDA in half precision, else SDPA per
    sequence."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        if kv_heads != heads:  # torch 2.11's varlen_attn has no grouped-query option
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scale,
                           window_size=(-1, 0))
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=kv_heads != heads).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs)


class _Attention(Function):
    """``ek.tile_attention`` over the packed sequences; the backward recomputes with :func:`reference_attention`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, tiles: tuple, cu: Tensor, max_len: int, scale: float) -> Tensor:
        from gspo.kernels import exact_kernels as ek

        out = torch.empty_like(q)
        ek.tile_attention(q, k, v, tiles, scale, out)
        ctx.save_for_backward(q, k, v, cu)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        q, k, v, cu = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = reference_attention(*leaves, cu, ctx.max_len, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, g.to(out.dtype))
        return dq, dk, dv, None, None, None, None


class _SiluMul(Function):
    """``fused_kernels.silu_mul``: silu(gate) * up of x = [gate | up] (n, 2I)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        from gspo.kernels import fused_kernels as fk

        ctx.save_for_backward(x)
        return fk.silu_mul(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        from gspo.kernels import grad_kernels

        (x,) = ctx.saved_tensors
        return grad_kernels.silu_mul_backward(x, g)


class _Head(Function):
    """Log-probs (M,) of ``targets`` under softmax(final_logits(h W^T + b) / temperature), by the exact kernels in
    chunks; entropies (M,) too when asked (no gradient). The backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: Tensor, targets: Tensor, decoder, temperature: float, chunk: int, with_entropy: bool,
                *masters: Tensor):
        from gspo.kernels import exact_kernels as ek

        head = decoder.model.get_output_embeddings()
        logp, entropy = [], []
        for i in range(0, hidden.shape[0], chunk):
            logits = decoder.exact_logits(hidden[i:i + chunk])  # (C, V) float32
            logp.append(ek.token_logprobs(logits, targets[i:i + chunk], temperature))
            if with_entropy:
                lp = torch.log_softmax(logits / temperature, -1)
                entropy.append(-(lp.exp() * lp).sum(-1))
        empty = hidden.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(hidden, targets)
        ctx.head, ctx.config, ctx.temperature, ctx.chunk = head, decoder.model.config, temperature, chunk
        ent = torch.cat(entropy) if entropy else empty.clone()
        ctx.mark_non_differentiable(ent)
        return (torch.cat(logp) if logp else empty), ent

    @staticmethod
    def backward(ctx, g: Tensor, _g_entropy):
        from gspo.models import final_logits

        hidden, targets = ctx.saved_tensors
        head = ctx.head
        dh = torch.empty_like(hidden)
        dw = torch.zeros(head.weight.shape, dtype=torch.float32, device=hidden.device)
        db = None if head.bias is None else torch.zeros(head.bias.shape, dtype=torch.float32, device=hidden.device)
        with torch.enable_grad():
            w = head.weight.detach().requires_grad_()
            b = None if head.bias is None else head.bias.detach().float().requires_grad_()
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i:i + ctx.chunk].detach().requires_grad_()
                logits = F.linear(h, w).float()
                if b is not None:
                    logits = logits + b
                logits = final_logits(ctx.config, logits) / ctx.temperature
                lp = torch.log_softmax(logits, -1).gather(-1, targets[i:i + ctx.chunk, None]).squeeze(-1)
                leaves = (h, w) if b is None else (h, w, b)
                grads = torch.autograd.grad(lp, leaves, g[i:i + ctx.chunk])
                dh[i:i + ctx.chunk] = grads[0]
                dw += grads[1]
                if b is not None:
                    db += grads[2]
        return (dh, None, None, None, None, None, dw, *([] if db is None else [db]))


def head_logprobs(hidden: Tensor, targets: Tensor, decoder, temperature: float, chunk: int, with_entropy: bool,
                  masters: tuple) -> tuple[Tensor, Tensor]:
    """:class:`_Head`: ``(log-probs (M,), entropies (M,) or empty)``; ``masters``: the LM head's weight (and bias)."""
    return _Head.apply(hidden, targets, decoder, temperature, chunk, with_entropy, *masters)


class DifferentiableExact(torch.nn.Module):
    """:meth:`gspo.kernels.fused.FusedDecoder.forward_tokens` over one packed row (dense families), differentiable
    with respect to the policy's parameters: ``forward(ids, pos, table, cu)`` -> final-norm hidden states (S, H) in
    the compute dtype, bit for bit the exact pass's.

    ``fused``: the exact pass's FusedDecoder, on its low-precision copy of ``model``'s weights (kept fresh by the
    caller); the matmuls read that copy, the embedding and norms read the masters themselves (the copy keeps them in
    the masters' dtype: the same numbers). ``model``: the policy, whose parameters (the masters) get the gradient; its
    decoder is a submodule, so that :func:`torch.cuda.make_graphed_callables` differentiates the parameters it reads.
    ``max_len``: a bound on the sequences' lengths for the backward's attention (a graph's bucket size)."""

    def __init__(self, model: torch.nn.Module, fused, max_len: int = 0):
        super().__init__()
        self.inner = model.get_decoder()
        self.fused = fused
        self.max_len = max_len
        masters = dict(model.named_parameters(remove_duplicate=False))
        names = {id(m): n for n, m in fused.model.named_modules()}  # the copy's modules, named as the policy's

        def master(module, what="weight"):
            return None if module is None else masters[f"{names[id(module)]}.{what}"]

        self.matmuls = []  # per layer: (q|k|v, o, gate|up, down), each (copy weight, copy bias, parts, masters)
        for layer in fused.layers:
            entries = []
            for w, b, modules in ((layer.w_qkv, layer.b_qkv, layer.qkv_parts), (layer.w_o, layer.b_o, [layer.o]),
                                  (layer.w_gate_up, layer.b_gate_up, layer.gate_up_parts),
                                  (layer.w_down, layer.b_down, [layer.down])):
                parts, used = _linear_parts(modules, names)
                entries.append((w, b, parts, tuple(masters[n] for n in used)))
            self.matmuls.append(entries)
        self.norms = [(master(layer.in_norm), master(layer.post_norm), master(layer.q_norm), master(layer.k_norm))
                      for layer in fused.layers]
        self.final_norm = (master(fused.norm),)  # (tuples: not registered twice as this module's parameters)
        self.embed = (master(fused.model.get_input_embeddings()),)
        self.padding_idx = getattr(fused.model.get_input_embeddings(), "padding_idx", None)

    def forward(self, ids: Tensor, pos: Tensor, table: Tensor, cu: Tensor) -> Tensor:
        f = self.fused
        tiles = tuple(table.unbind(0))
        shape = (f.heads, f.kv_heads, f.head_dim)
        S = ids.shape[0]
        # (S, H), the residual stream in the embedding's dtype; the pad row gets no gradient, as in nn.Embedding's
        res, delta = F.embedding(ids, self.embed[0], padding_idx=self.padding_idx), None
        for layer, (qkv_w, o_w, gate_up_w, down_w), (in_w, post_w, qn, kn) in zip(f.layers, self.matmuls, self.norms):
            res, x = _AddNorm.apply(res, delta, in_w, layer.in_norm.variance_epsilon, f.dtype)
            qkv = _Linear.apply(x, *qkv_w[:3], *qkv_w[3])
            eps = 0.0 if layer.q_norm is None else layer.q_norm.variance_epsilon
            q, k, v = _Rope.apply(qkv, pos, shape, f.inv_freq, f.rope_scale, eps, qn, kn)
            attn = _Attention.apply(q, k, v, tiles, cu, self.max_len, layer.scale)
            o = _Linear.apply(attn.reshape(S, -1), *o_w[:3], *o_w[3])
            res, x = _AddNorm.apply(res, o, post_w, layer.post_norm.variance_epsilon, f.dtype)
            act = _SiluMul.apply(_Linear.apply(x, *gate_up_w[:3], *gate_up_w[3]))
            delta = _Linear.apply(act, *down_w[:3], *down_w[3])
        return _AddNorm.apply(res, delta, self.final_norm[0], f.norm.variance_epsilon, f.dtype)[1]
