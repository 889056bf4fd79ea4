"""Triton kernels for the backward of ``rollout.exact``'s update pass (:mod:`gspo.kernels.exact_grad`).

Home: ``gspo.kernels.grad_kernels``, beside the forward kernels they differentiate.

Why by hand: written as torch ops, the backward of the residual add + RMSNorm, of the rotary embedding and of
SiLU-and-multiply is ~10 elementwise kernels each, per layer, over fp32 activations; on an H200 that made the exact
update's backward ~20 ms slower than autocast's (63.2 against 48.8 ms for a 64-row minibatch of the reference run,
``benchmarks/exact_engine.py --parts trainer``). Each kernel here is one pass over its rows. They need not be
batch-invariant (the issue: "the backward may use any kernel"); their math is the derivative of what the forward
kernels (:mod:`gspo.kernels.fused_kernels`, :mod:`gspo.kernels.exact_kernels`) compute, ignoring the forward's roundings
to the storage dtype, as autograd of the ordinary pass does. The CPU tests run them in Triton's interpreter against
autograd of torch re-statements on random inputs, and the whole update's gradient against a float64 ordinary pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_backward(r_ptr, gx_ptr, w_ptr, gnew_ptr, gr_ptr, gw_ptr, N, eps, HAS_GNEW: tl.constexpr,
                      BLOCK: tl.constexpr):
    # One program per row. Forward: y = r * rstd, rstd = (mean(r^2) + eps)^-1/2, x = w * y. Backward:
    # dr = rstd * (gy - y * mean(gy * y)) (+ the gradient reaching r directly), gy = gx * w; dw's row term gx * y.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    r = tl.load(r_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(r * r, axis=0) / N + eps)
    y = r * rstd
    gx = tl.load(gx_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    gy = gx * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = rstd * (gy - y * (tl.sum(gy * y, axis=0) / N))
    if HAS_GNEW:
        g += tl.load(gnew_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(gr_ptr + row * N + offs, g, mask=m)
    tl.store(gw_ptr + row * N + offs, gx * y, mask=m)


@triton.jit
def _rope_backward(gq_ptr, gk_ptr, gv_ptr, pos_ptr, inv_freq_ptr, out_ptr, rope_scale, HQ: tl.constexpr,
                   HKV: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr):
    # Program b (one token): the rotation's transpose (by -angle) of the gradients of its rotated query and key heads,
    # and its value heads' gradient as it is, into out's row [HQ*D | HKV*D | HKV*D] (the q|k|v layout). Forward:
    # o1 = x1 c - x2 s, o2 = x2 c + x1 s; so dx1 = g1 c + g2 s, dx2 = g2 c - g1 s.
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    half = tl.arange(0, D // 2)
    is_q = (h < HQ)[:, None]
    is_k = ((h >= HQ) & (h < HQ + HKV))[:, None]
    q_at = gq_ptr + (b * HQ + h[:, None]) * D + half[None, :]
    k_at = gk_ptr + (b * HKV + (h[:, None] - HQ)) * D + half[None, :]
    g1 = tl.where(is_q, tl.load(q_at, mask=is_q, other=0.0), tl.load(k_at, mask=is_k, other=0.0)).to(tl.float32)
    g2 = tl.where(is_q, tl.load(q_at + D // 2, mask=is_q, other=0.0),
                  tl.load(k_at + D // 2, mask=is_k, other=0.0)).to(tl.float32)
    angle = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + half).to(tl.float32)
    c = (tl.cos(angle) * rope_scale)[None, :]
    s = (tl.sin(angle) * rope_scale)[None, :]
    W = (HQ + 2 * HKV) * D
    dst = out_ptr + b * W + h[:, None] * D + half[None, :]
    keep = is_q | is_k
    tl.store(dst, (g1 * c + g2 * s).to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(dst + D // 2, (g2 * c - g1 * s).to(out_ptr.dtype.element_ty), mask=keep)
    g = tl.arange(0, KP)
    d = tl.arange(0, D)
    gm = (g < HKV)[:, None]
    v = tl.load(gv_ptr + (b * HKV + g[:, None]) * D + d[None, :], mask=gm, other=0.0)
    tl.store(out_ptr + b * W + (HQ + HKV + g[:, None]) * D + d[None, :], v.to(out_ptr.dtype.element_ty), mask=gm)


@triton.jit
def _silu_mul_backward(x_ptr, g_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # x row = [gate | up]; forward out = silu(gate) * up. d gate = g up silu'(gate), d up = g silu(gate), with
    # silu'(a) = s (1 + a (1 - s)), s = sigmoid(a).
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < I
    gate = tl.load(x_ptr + row * 2 * I + col, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * I + I + col, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * I + col, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * 2 * I + col, (g * up * s * (1.0 + gate * (1.0 - s))).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + row * 2 * I + I + col, (g * gate * s).to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------- launchers


def rmsnorm_backward(r: torch.Tensor, g_x: torch.Tensor, weight: torch.Tensor, eps: float,
                     g_r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (fp32) of ``x = weight * rmsnorm(r)`` with respect to r (rows, N) -- plus ``g_r``, a gradient that
    reaches r directly, when given -- and to weight (N,), from the gradient ``g_x`` (rows, N) of x."""
    rows, N = r.shape
    out = torch.empty(rows, N, dtype=torch.float32, device=r.device)
    terms = torch.empty_like(out)
    if rows:
        _rmsnorm_backward[(rows,)](r.contiguous(), g_x.contiguous(), weight, g_r.contiguous() if g_r is not None else r,
                                   out, terms, N, eps, HAS_GNEW=g_r is not None, BLOCK=triton.next_power_of_2(N))
    return out, terms.sum(0)


def rope_backward(g_q: torch.Tensor, g_k: torch.Tensor, g_v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                  rope_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The gradient (n, (Hq + 2 Hkv) D) in ``dtype`` of the q|k|v rows that :func:`gspo.kernels.exact_kernels.
    rope_write` rotated into q (n, Hq, D) and k, v (n, Hkv, D), from their gradients (before any q/k norm)."""
    n, heads, D = g_q.shape
    kv_heads = g_k.shape[1]
    out = torch.empty(n, (heads + 2 * kv_heads) * D, dtype=dtype, device=g_q.device)
    if n:
        _rope_backward[(n,)](g_q.contiguous(), g_k.contiguous(), g_v.contiguous(), pos, inv_freq, out, rope_scale,
                             HQ=heads, HKV=kv_heads, D=D, HP=triton.next_power_of_2(heads + kv_heads),
                             KP=triton.next_power_of_2(kv_heads))
    return out


def silu_mul_backward(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient (B, 2I) in x's dtype of ``silu(x[:, :I]) * x[:, I:]`` from its gradient ``g`` (B, I)."""
    B, I = g.shape
    out = torch.empty(B, 2 * I, dtype=x.dtype, device=x.device)
    if B:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_backward[(B, triton.cdiv(I, block))](x.contiguous(), g.contiguous(), out, I, BLOCK=block)
    return out
