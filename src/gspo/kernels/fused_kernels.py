"""Triton kernels for the graph engine's fused decode step (:class:`gspo.kernels.fused.FusedDecoder`).

Home: ``gspo.kernels.fused_kernels``; the exact forward (:mod:`gspo.kernels.exact_kernels`) and its backward
(:mod:`gspo.kernels.exact_grad`) use them too.

Why hand-written: a decode step of a small model at a few hundred rows is bound by the number of kernels, not by
bytes (``benchmarks/README.md#rollout-throughput``): HF's Llama layer launches ~33 kernels per layer (RMSNorm alone is
six, rotary ten, each cache write one), each a few microseconds of mostly idle GPU. ``torch.compile`` of the step
fuses them but takes ~40 s to compile and copies the whole static cache at every write. These kernels fuse exactly
what a decode step needs -- residual add + RMSNorm, rotary embedding + the K/V cache write, SiLU-and-multiply -- and
the grouped-query attention over each row's live slots is :func:`gspo.kernels.exact_kernels.tile_attention` (one
tile per row), so that a layer is 4 GEMMs and 5 kernels. No library ships these
for an HF model's own weights without taking over the model (vLLM, SGLang, FlashInfer need their own runtimes).

Each kernel rounds like the HF modules under autocast: fp32 arithmetic, and a cast to the storage dtype wherever the
HF code casts, so its output matches the module path up to the order of floating-point sums. The tests run these
kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on a CPU against the HF modules, and on CUDA for real.

Importing this module needs ``triton``; :func:`gspo.kernels.fused.fused_unsupported` checks that it is installed.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# Triton's interpreter (the CPU tests) truncates float32 -> bfloat16 casts, even when asked to round; the GPU rounds to
# nearest even, as torch does. Under the interpreter the rounding is done by hand on the bits, so the CPU tests check
# the same numbers the GPU computes.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it when a kernel is defined, as here
_ROUND_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def rounded(x, dtype: tl.constexpr):
    # x (float32) to ``dtype``, rounding to nearest even as torch's casts do.
    if dtype == tl.float32:
        return x
    elif _ROUND_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _add_rmsnorm(res_ptr, delta_ptr, w_ptr, out_ptr, N, eps,
                 HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: res <- res + delta (in res's dtype, as HF's residual add), out <- w * rmsnorm(res).
    row = tl.program_id(0).to(tl.int64)  # rows * N passes 2^31 in a long packed pass (rollout.exact's)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(res_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        x = rounded(x, res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * N + offs, x, mask=m)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = rounded(x * tl.rsqrt(var + eps), res_ptr.dtype.element_ty).to(tl.float32)  # HF: .to(input_dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, rounded(w * y, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_cache(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache, v_cache, slot_ptr, qn_ptr, kn_ptr, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr):
    # Program (b, h): h < HQ rotates query head h into q; else rotates key head h - HQ and writes it and its value
    # head to the cache at slot slot_ptr[b], an index into the cache's (rows * L) slots: a row's slots need not be
    # the row's own (the graph engine moves row state, not K/V). qkv row layout: [HQ*D queries | HKV*D keys | values].
    b = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    W = (HQ + 2 * HKV) * D
    src = qkv_ptr + b * W + h * D
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    if QK_NORM:  # Qwen3: an RMSNorm over each head before the rotation; its output is weight * x.to(input dtype)
        var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
        r = tl.rsqrt(var + eps)
        if h < HQ:
            w1 = tl.load(qn_ptr + half).to(tl.float32)
            w2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + half).to(tl.float32)
            w2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
        x1 = rounded(x1 * r, qkv_ptr.dtype.element_ty).to(tl.float32) * w1
        x2 = rounded(x2 * r, qkv_ptr.dtype.element_ty).to(tl.float32) * w2
    c1 = tl.load(cos_ptr + b * D + half).to(tl.float32)
    c2 = tl.load(cos_ptr + b * D + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + b * D + half).to(tl.float32)
    s2 = tl.load(sin_ptr + b * D + D // 2 + half).to(tl.float32)
    o1 = x1 * c1 - x2 * s1  # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    o2 = x2 * c2 + x1 * s2
    if h < HQ:
        dst = q_ptr + (b * HQ + h) * D
        tl.store(dst + half, rounded(o1, q_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + half, rounded(o2, q_ptr.dtype.element_ty))
    else:
        kvh = h - HQ
        slot = tl.load(slot_ptr + b).to(tl.int64)
        off = (slot * HKV + kvh) * D
        tl.store(k_cache + off + half, rounded(o1, k_cache.dtype.element_ty))
        tl.store(k_cache + off + D // 2 + half, rounded(o2, k_cache.dtype.element_ty))
        d = tl.arange(0, D)
        v = tl.load(qkv_ptr + b * W + (HQ + HKV + kvh) * D + d)
        tl.store(v_cache + off + d, v.to(v_cache.dtype.element_ty))  # the same dtype: a copy


@triton.jit
def _silu_mul(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # x row = [gate | up] (2I); out = silu(gate) * up, with silu(gate) rounded to the storage dtype first (HF computes
    # act_fn(gate) as its own op).
    row = tl.program_id(0).to(tl.int64)  # rows * 2I passes 2^31 at ~57k tokens of a 7B model's MLP
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < I
    gate = tl.load(x_ptr + row * 2 * I + col, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * I + I + col, mask=m, other=0.0).to(tl.float32)
    act = rounded(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + col, rounded(act * up, out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------- launchers


def add_rmsnorm(res: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor) -> torch.Tensor:
    """``res += delta`` in place (when given), then ``out = weight * rmsnorm(res)``: res (B, N), delta (B, N)."""
    B, N = res.shape
    _add_rmsnorm[(B,)](res, delta if delta is not None else res, weight, out, N, eps,
                       HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N))
    return out


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """Rotate the queries of ``qkv`` (B, (Hq + 2 Hkv) D) into ``q_out`` (B, Hq, D) and write the rotated keys and
    the values to ``k_cache`` / ``v_cache`` (rows, L, Hkv, D): row b's to flat slot ``slot[b]`` (B,) of the cache's
    ``rows * L`` (row ``r``'s slot ``s`` is ``r * L + s``); cos/sin (B, D)."""
    B = qkv.shape[0]
    _rope_cache[(B, heads + kv_heads)](qkv, cos, sin, q_out, k_cache, v_cache, slot,
                                       q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
                                       eps, HQ=heads, HKV=kv_heads, D=head_dim,
                                       QK_NORM=q_norm is not None)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = silu(x[:, :I]) * x[:, I:]`` for x (B, 2I); ``out`` (B, I) is allocated in x's dtype when not given."""
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    B, I = out.shape
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul[(B, triton.cdiv(I, block))](x, out, I, BLOCK=block)
    return out
