"""Batch-invariant Triton kernels: the forward that the graph engine and the trainer share under ``rollout.exact``.

Home: ``gspo.kernels.exact_kernels``, beside the fused step that calls them (:mod:`gspo.kernels.fused`) and their
backward (:mod:`gspo.kernels.exact_grad`, :mod:`gspo.kernels.grad_kernels`).

What "exact" needs: the engine's log-prob of a sampled token must be the trainer's recomputation of it, bit for bit,
whatever else is in either batch. A kernel is *batch-invariant* when each output element is computed by the same
sequence of floating-point operations whatever the other rows are. cuBLAS is not (it picks a tile shape and a split of
the reduction from the number of rows), flash attention is not the same reduction for one decode query as for the
packed causal pass, and a decode step and a packed pass usually run different kernels altogether. Here:

* ``linear``: a matmul whose tile shape and K-loop are fixed (they depend on nothing but the weight's shape, never on
  the rows), with no split of K: element (m, n) is the same dot product, in the same order, for 1 row or 100,000.
* ``tile_attention``: ONE attention kernel for both sides. A program is a *tile* of consecutive query tokens of one
  sequence and one KV head, its rows the (token, query-head) pairs; each row walks its keys from the sequence's first
  in blocks of ``BLOCK_N`` with an online softmax. A decode step is tiles of one token reading the KV cache; the
  packed pass (the trainer's, and the engine's prefill) is tiles of up to ``BLOCK_M // G`` tokens. A row's numbers do
  not depend on its tile: blocks past its own keys are masked to -inf, which leaves every running value as it was.
* ``rope_write``: rotary embedding (cos / sin computed in the kernel from the position) + the K/V write, per token.
* ``token_logprobs``: log softmax(logits / T)[target], one program per token, a fixed two-pass reduction over V.
* MoE (``experts``): ``route`` (a token's softmax top-k, one program per token), ``grouped_linear`` (the experts'
  matmuls over (token, expert) pairs sorted by expert, each pair's row the dense matmul's dot product whatever tile it
  lands in) and ``_combine`` (each token's experts summed in top-k order, fp32).
* The residual-add + RMSNorm and SiLU-and-multiply kernels of :mod:`gspo.kernels.fused_kernels` are per-row already.

Why by hand: no library ships batch-invariant kernels that run an HF model's own weights inside our CUDA graphs
(Thinking Machines' ``batch_invariant_ops`` replaces aten ops globally, which would also change the backward and every
other pass; SGLang's and vLLM's deterministic modes need their own runtimes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gspo.kernels.fused_kernels import INTERPRETED, rounded

# The matmul's one configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps). Every call uses it, whatever the rows: the point of
# the kernel. A sweep on an H200 (benchmarks/exact_engine.py --matmul-configs, SmolLM2-135M) gave the exact engine, at
# 512 x 128 / 1024 x 512, of the fused step's tokens/s: 64 x 64 x 64 91% / 93%, 64 x 128 x 64 93% / 95%, 128 x 64 x 64
# 86% / 91%, 128 x 128 x 64 (8 warps) 82% / 92%, 32 x 64 x 64 83% / 82%. This one's exactness was measured on the GPU
# for dense and MoE families (docs/experiments/engine/exact); a change of it needs that run again.
MATMUL_BLOCK = (64, 128, 64, 4)
MATMUL_SPLIT_K = 1  # 2: a split-K reduction order (the tests' fault injection; never set by gspo)
# Attention: rows of a tile (token x query head of one KV head) and keys per block. A decode tile uses G of the
# BLOCK_M rows; the same BLOCK_M for both sides keeps each row's dot products the same instructions.
ATTENTION_BLOCK_N = 64
LOGPROB_BLOCK = 1024
# Triton's interpreter (the CPU tests) runs tl.dot as numpy's matmul, i.e. the CPU's BLAS, whose micro-kernels sum an
# output element's products in an order that depends on the element's row within the block (OpenBLAS on an AVX-512
# CPU: rows 0-5, 6-11 and 12-15 of every 16 differ in the last bits), so a row's numbers would depend on where its batch
# puts it. Under the interpreter the dot is the products summed over K in order instead, the same for every element.
_SEQUENTIAL_DOT = tl.constexpr(INTERPRETED)


@triton.jit
def _dot_fp32(a, b):
    # a (M, K) @ b (K, N) in fp32: products in full precision (not TF32; the interpreter multiplies 16-bit floats
    # wrongly), each output element's sum over K in an order that does not depend on its row or column.
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    if _SEQUENTIAL_DOT:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _k_range(acc, a_ptr, w_ptr, ra, am, rn, rk, N, K, k_lo, k_hi, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    # acc + a[ra, k_lo:k_hi] @ w[rn, k_lo:k_hi]^T, in BLOCK_K steps: ra (BM,) int64 the rows of a, am (BM,) which are
    # real. The dense matmul and the experts' grouped one both run this, so their rows are the same dot products.
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + ra[:, None] * K + kk[None, :], mask=am[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)  # (BK, BN)
        if UPCAST:
            acc += _dot_fp32(a, w)
        else:
            acc += tl.dot(a, w)
    return acc


@triton.jit
def _linear(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr):
    # c (M, N) = a (M, K) @ w (N, K)^T (+ bias), fp32 accumulation over K in BLOCK_K steps from k = 0. SPLIT_K = 2
    # (only the tests' fault injection) sums the two halves of K apart and adds them: what a split-K GEMM does.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ra, am = rm.to(tl.int64), rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SPLIT_K == 1:
        acc = _k_range(acc, a_ptr, w_ptr, ra, am, rn, rk, N, K, 0, K, BLOCK_K, UPCAST)
    else:
        mid = tl.cdiv(tl.cdiv(K, BLOCK_K), 2) * BLOCK_K
        acc = _k_range(acc, a_ptr, w_ptr, ra, am, rn, rk, N, K, 0, mid, BLOCK_K, UPCAST)
        acc += _k_range(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), a_ptr, w_ptr, ra, am, rn, rk, N, K, mid, K, BLOCK_K,
                        UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], rounded(acc, c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _grouped_linear(a_ptr, rows_ptr, w_ptr, c_ptr, tile_expert_ptr, tile_lo_ptr, tile_hi_ptr, N, K,
                    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr):
    # The experts' matmul over (token, expert) pairs sorted by expert: program (tile p, column block) computes pairs
    # lo[p] .. hi[p] - 1, all routed to expert e[p]: c[i] = a[rows[i] if GATHER else i] @ w[e]^T (w: (E, N, K)). A
    # pair's row is the dense kernel's dot product whatever tile it lands in (the same _k_range, the same blocks).
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    lo = tl.load(tile_lo_ptr + p).to(tl.int64)
    hi = tl.load(tile_hi_ptr + p).to(tl.int64)
    if hi > lo:  # tiles past the last expert's are empty (the grid is sized for the worst case)
        e = tl.load(tile_expert_ptr + p).to(tl.int64)
        i = lo + tl.arange(0, BLOCK_M)
        im = i < hi
        if GATHER:
            ra = tl.load(rows_ptr + i, mask=im, other=0).to(tl.int64)
        else:
            ra = i
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _k_range(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), a_ptr, w_ptr + e * N * K, ra, im, rn,
                       tl.arange(0, BLOCK_K), N, K, 0, K, BLOCK_K, UPCAST)
        tl.store(c_ptr + i[:, None] * N + rn[None, :], rounded(acc, c_ptr.dtype.element_ty),
                 mask=im[:, None] & (rn[None, :] < N))


@triton.jit
def _route(logits_ptr, weight_ptr, expert_ptr, E, TOP_K: tl.constexpr, RENORMALISE: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    # One program per token: softmax over its E router logits (fp32), the TOP_K largest probabilities in order (ties to
    # the lower expert), divided by their sum where the family renormalises.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * E + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(cols < E, p, -1.0)  # padding lanes are never chosen, not even over underflowed probabilities
    slots = tl.arange(0, BLOCK_TOP)
    vals = tl.zeros([BLOCK_TOP], tl.float32)
    idx = tl.zeros([BLOCK_TOP], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, cols, BLOCK_E), axis=0)  # the lowest expert among equals
        vals = tl.where(slots == j, best, vals)
        idx = tl.where(slots == j, pick, idx)
        left = tl.where(cols == pick, -1.0, left)
    if RENORMALISE:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(weight_ptr + row * TOP_K + slots, vals, mask=slots < TOP_K)
    tl.store(expert_ptr + row * TOP_K + slots, idx, mask=slots < TOP_K)


@triton.jit
def _combine(y_ptr, at_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token t, column block): out[t] = sum_j w[t, j] * y[at[t * K + j]] over its experts in top-k order, fp32,
    # rounded once: the same operations for a token whatever the others.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(at_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(y_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32) * tl.load(w_ptr + t * TOP_K + j)
    tl.store(out_ptr + t * H + cols, rounded(acc, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_write(qkv_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_store, v_store, slot_ptr, qn_ptr, kn_ptr, eps, rope_scale,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr,
                QK_NORM: tl.constexpr):
    # Program b (one token, every head at once): rotate its query heads into q and its key heads into k_store at flat
    # slot slot[b], copy its value heads to v_store there. cos / sin are computed here from the token's position
    # (angle = pos * inv_freq, HF's formula), so no other kernel's rounding enters. qkv row: [HQ*D | HKV*D | HKV*D].
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)  # query heads, then key heads
    hm = h < HQ + HKV
    half = tl.arange(0, D // 2)
    src = qkv_ptr + b * (HQ + 2 * HKV) * D + h[:, None] * D
    x1 = tl.load(src + half[None, :], mask=hm[:, None], other=0.0).to(tl.float32)  # (HP, D/2)
    x2 = tl.load(src + D // 2 + half[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: an RMSNorm over each head before the rotation
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D  # (HP,)
        r = tl.rsqrt(var + eps)[:, None]
        is_q = (h < HQ)[:, None]
        w1 = tl.where(is_q, tl.load(qn_ptr + half).to(tl.float32)[None, :], tl.load(kn_ptr + half).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(qn_ptr + D // 2 + half).to(tl.float32)[None, :],
                      tl.load(kn_ptr + D // 2 + half).to(tl.float32)[None, :])
        x1 = rounded(x1 * r, qkv_ptr.dtype.element_ty).to(tl.float32) * w1
        x2 = rounded(x2 * r, qkv_ptr.dtype.element_ty).to(tl.float32) * w2
    angle = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + half).to(tl.float32)  # (D/2,)
    c = (tl.cos(angle) * rope_scale)[None, :]
    s = (tl.sin(angle) * rope_scale)[None, :]
    o1 = x1 * c - x2 * s  # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    o2 = x2 * c + x1 * s
    qm = (h < HQ)[:, None]
    dst = q_ptr + (b * HQ + h[:, None]) * D
    tl.store(dst + half[None, :], rounded(o1, q_ptr.dtype.element_ty), mask=qm)
    tl.store(dst + D // 2 + half[None, :], rounded(o2, q_ptr.dtype.element_ty), mask=qm)
    km = ((h >= HQ) & hm)[:, None]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    koff = (slot * HKV + (h[:, None] - HQ)) * D
    tl.store(k_store + koff + half[None, :], rounded(o1, k_store.dtype.element_ty), mask=km)
    tl.store(k_store + koff + D // 2 + half[None, :], rounded(o2, k_store.dtype.element_ty), mask=km)
    g = tl.arange(0, KP)
    d = tl.arange(0, D)
    gm = (g < HKV)[:, None]
    v = tl.load(qkv_ptr + b * (HQ + 2 * HKV) * D + (HQ + HKV + g[:, None]) * D + d[None, :], mask=gm, other=0.0)
    tl.store(v_store + (slot * HKV + g[:, None]) * D + d[None, :], v.to(v_store.dtype.element_ty), mask=gm)


@triton.jit
def _tile_attention(q_ptr, k_store, v_store, out_ptr, q0_ptr, ntok_ptr, kstart_ptr, kcount_ptr, scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    # Program (tile i, KV head): tokens q0[i] .. q0[i] + ntok[i] - 1 of one sequence, whose keys start at flat slot
    # kstart[i] of k_store / v_store (slots, HKV, D); token j of the tile attends kcount[i] + j of them. Row r of the
    # tile is token r // G, query head kvh * G + r % G.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    q0 = tl.load(q0_ptr + tile).to(tl.int64)
    ntok = tl.load(ntok_ptr + tile)
    kstart = tl.load(kstart_ptr + tile).to(tl.int64)
    c0 = tl.load(kcount_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    t = r // G
    valid = t < ntok
    count = tl.where(valid, c0 + t, 0)  # (BM,) keys each row attends
    hi = tl.max(count, axis=0)
    d = tl.arange(0, D)
    qrow = (q0 + t) * HQ + kvh * G + r % G  # (BM,)
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)  # (BM, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        off = ((kstart + n) * HKV + kvh) * D  # (BN,)
        k = tl.load(k_store + off[:, None] + d[None, :], mask=nm[:, None], other=0.0)  # (BN, D)
        if UPCAST:
            s = _dot_fp32(q, tl.trans(k)) * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # (BM, BN) fp32
        s = tl.where(n[None, :] < count[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0, not NaN
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_store + off[:, None] + d[None, :], mask=nm[:, None], other=0.0)  # (BN, D)
        if UPCAST:
            acc = acc * alpha[:, None] + _dot_fp32(rounded(p, v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(rounded(p, v.dtype), v)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]  # a row with no key (an ended decode row) gets zeros
    tl.store(out_ptr + qrow[:, None] * D + d[None, :], rounded(out, out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _token_logprobs(logits_ptr, target_ptr, out_ptr, V, inv_temperature, BLOCK: tl.constexpr):
    # One program per token: log softmax(logits * (1 / T))[target], two passes over V in BLOCK chunks.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m = tl.maximum(m, x)
    top = tl.max(m, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        acc += tl.exp(x - top)
    lse = top + tl.log(tl.sum(acc, axis=0))
    target = tl.load(target_ptr + row)
    x_t = tl.load(base + target).to(tl.float32) * inv_temperature
    tl.store(out_ptr + row, x_t - lse)


# ---------------------------------------------------------------------------------------------- launchers


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRETED or dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x (M, K) @ weight (N, K)^T + bias`` in ``out_dtype`` (default x's), batch-invariant: row m of the result does
    not depend on M or on the other rows."""
    if x.dtype != weight.dtype:  # the GPU's dot needs one dtype; the interpreter would hide a mismatch
        raise TypeError(f"linear: x is {x.dtype} and weight {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, bk, warps = MATMUL_BLOCK
    _linear[(triton.cdiv(M, bm), triton.cdiv(N, bn))](x, weight, bias if bias is not None else weight, out, M, N, K,
                                                      HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                      SPLIT_K=MATMUL_SPLIT_K, UPCAST=_upcast(x.dtype),
                                                      num_warps=warps)
    return out


def rope_write(qkv: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float, q_out: torch.Tensor,
               k_store: torch.Tensor, v_store: torch.Tensor, slot: torch.Tensor, heads: int, kv_heads: int,
               head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 0.0) -> None:
    """Rotate token b's queries of ``qkv`` (n, (Hq + 2 Hkv) D) into ``q_out`` (n, Hq, D) at position ``pos[b]`` and
    write its rotated keys and its values to flat slot ``slot[b]`` of ``k_store`` / ``v_store`` (slots, Hkv, D)."""
    n = qkv.shape[0]
    if n == 0:
        return
    _rope_write[(n,)](qkv, pos, inv_freq, q_out, k_store, v_store, slot, q_norm if q_norm is not None else inv_freq,
                      k_norm if k_norm is not None else inv_freq, eps, rope_scale, HQ=heads, HKV=kv_heads, D=head_dim,
                      HP=triton.next_power_of_2(heads + kv_heads), KP=triton.next_power_of_2(kv_heads),
                      QK_NORM=q_norm is not None)


def attention_rows(groups: int) -> int:
    """Rows of an attention tile for ``groups`` query heads per KV head (the same for a decode step and a packed
    pass); a packed tile holds ``attention_rows(G) // G`` tokens."""
    return max(16, triton.next_power_of_2(groups))


def tile_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, tiles: tuple, scale: float,
                   out: torch.Tensor) -> torch.Tensor:
    """Attention of queries ``q`` (n, Hq, D) over ``k_store`` / ``v_store`` (slots, Hkv, D) by ``tiles`` = (first
    query, tokens, first key slot, keys of the first token), four int32 tensors of one entry per tile (see
    :func:`packed_tiles`; a decode step: one tile per row). Writes and returns ``out`` (n, Hq, D)."""
    q0, ntok, kstart, kcount = tiles
    heads, D = q.shape[1], q.shape[2]
    kv_heads = k_store.shape[1]
    G = heads // kv_heads
    if q0.numel():
        _tile_attention[(q0.numel(), kv_heads)](q, k_store, v_store, out, q0, ntok, kstart, kcount, scale, HQ=heads,
                                                HKV=kv_heads, G=G, D=D, BLOCK_M=attention_rows(G),
                                                BLOCK_N=ATTENTION_BLOCK_N, UPCAST=_upcast(q.dtype))
    return out


def packed_tiles(seq_lens: list[int], key_starts: list[int], groups: int, device,
                 held: list[int] | None = None) -> tuple:
    """The tiles of a packed pass over sequences of ``seq_lens`` tokens (queries in order, sequence i's first at
    ``sum(seq_lens[:i])``), sequence i's keys from flat slot ``key_starts[i]``: (q0, ntok, kstart, kcount) int32.
    ``held[i]``: keys sequence i already has before its first token here (a multi-turn row's cache), 0 by default."""
    return tuple(tile_table(seq_lens, key_starts, groups, held).to(device, non_blocking=True).unbind(0))


def tile_table(seq_lens: list[int], key_starts: list[int], groups: int, held: list[int] | None = None) -> torch.Tensor:
    """:func:`packed_tiles` as one CPU tensor (4, tiles) int32; a column of zeros is a tile with no token."""
    per = attention_rows(groups) // groups
    q0, ntok, kstart, kcount = [], [], [], []
    first = 0
    for n, k, h in zip(seq_lens, key_starts, held or [0] * len(seq_lens)):
        for j in range(0, n, per):
            q0.append(first + j)
            ntok.append(min(per, n - j))
            kstart.append(k)
            kcount.append(h + j + 1)
        first += n
    return torch.tensor([q0, ntok, kstart, kcount], dtype=torch.int32)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts under router ``logits`` (n, E) and their gate weights (fp32 softmax over all
    experts, taken at the chosen ones, renormalised where the family does): weights (n, k) float32, experts (n, k)
    int32, largest first."""
    logits = logits.contiguous()
    n, E = logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    if n:
        _route[(n,)](logits, weights, experts, E, TOP_K=top_k, RENORMALISE=renormalise,
                     BLOCK_E=triton.next_power_of_2(E), BLOCK_TOP=triton.next_power_of_2(top_k))
    return weights, experts


def expert_tiles(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The (token, expert) pairs of ``experts`` (n, k) in expert order, and the grouped matmul's tiles over them.
    Pair ``t * k + j`` is token t's j-th expert. Returns ``order`` (P,): the pair at each sorted row; ``at`` (P,): the
    sorted row of each pair; and (expert, first row, end row) of each tile, ``cdiv(P, BLOCK_M) + E`` tiles with the
    empty ones last. A stable counting sort in device ops of static shapes, no host sync: a decode step's CUDA graph
    captures it (E x P int32 of scratch)."""
    bm = MATMUL_BLOCK[0]
    flat = experts.reshape(-1).long()
    P, E, dev = flat.numel(), num_experts, flat.device
    hits = torch.arange(E, device=dev)[:, None] == flat[None, :]  # (E, P): a scan along the inner dimension is fast
    counts = hits.sum(1)  # (E,) pairs of each expert
    rank = hits.to(torch.int32).cumsum(1, dtype=torch.int32).gather(0, flat[None, :])[0] - 1  # among its expert's
    pair_start = counts.cumsum(0) - counts  # (E,) each expert's first sorted row
    at = pair_start[flat] + rank
    order = torch.empty_like(at).scatter_(0, at, torch.arange(P, device=dev))
    tiles = (counts + bm - 1) // bm  # (E,) tiles of each expert
    tile_end = tiles.cumsum(0)
    p = torch.arange(triton.cdiv(P, bm) + E, device=dev)
    e = torch.searchsorted(tile_end, p, right=True).clamp_(max=E - 1)  # (T,) tile p's expert
    lo = pair_start[e] + (p - (tile_end - tiles)[e]) * bm
    hi = torch.minimum(lo + bm, pair_start[e] + counts[e])
    real = p < tile_end[-1]
    return order, at, (e, torch.where(real, lo, 0), torch.where(real, hi, 0))


def grouped_linear(x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, tiles: tuple) -> torch.Tensor:
    """Per-expert matmuls over sorted (token, expert) pairs: row i of the result is ``x[rows[i]] @ weight[e]^T`` for
    the expert e of pair i's tile (``rows`` None: ``x[i]``), ``weight`` (E, N, K), ``tiles`` from :func:`expert_tiles`.
    Batch-invariant, and a pair's row is bit for bit :func:`linear`'s of the same row and expert weight."""
    e, lo, hi = tiles
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_linear: x is {x.dtype} and weight {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    P = rows.shape[0] if rows is not None else x.shape[0]
    N, K = weight.shape[1], weight.shape[2]
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    bm, bn, bk, warps = MATMUL_BLOCK
    _grouped_linear[(e.numel(), triton.cdiv(N, bn))](x, rows if rows is not None else lo, weight, out, e, lo, hi, N, K,
                                                     GATHER=rows is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                     UPCAST=_upcast(x.dtype), num_warps=warps)
    return out


def experts(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalise: bool, gate_up: torch.Tensor,
            down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k MoE block's routed experts on tokens ``x`` (n, H), batch-invariant: router logits by :func:`linear`
    (fp32), :func:`route`, each pair's SiLU-gated expert MLP by :func:`grouped_linear` (``gate_up`` (E, 2I, H) as
    [gate | up], ``down`` (E, H, I)), and the combine sum_j w_j * y_j over each token's experts in their top-k order, in
    fp32, rounded once to x's dtype (one kernel). Returns the output (n, H) and the chosen experts (n, k) int32."""
    from gspo.kernels.fused_kernels import silu_mul

    n = x.shape[0]
    if n == 0:
        return torch.zeros_like(x), torch.zeros(0, top_k, dtype=torch.int32, device=x.device)
    weights, chosen = route(linear(x, router_weight, out_dtype=torch.float32), top_k, renormalise)  # (n, k) each
    order, at, tiles = expert_tiles(chosen, router_weight.shape[0])
    h = grouped_linear(x, order // top_k, gate_up, tiles)  # (P, 2I) in expert order
    act = silu_mul(h)
    y = grouped_linear(act, None, down, tiles)  # (P, H) in expert order
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(x.shape[1]))
    _combine[(n, triton.cdiv(x.shape[1], block))](y, at, weights, out, x.shape[1], TOP_K=top_k, BLOCK=block)
    return out, chosen


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[targets]`` per row: logits (n, V) float32, targets (n,) -> (n,) float32."""
    logits = logits.contiguous()
    n, V = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _token_logprobs[(n,)](logits, targets.contiguous(), out, V, 1.0 / temperature, BLOCK=LOGPROB_BLOCK)
    return out
