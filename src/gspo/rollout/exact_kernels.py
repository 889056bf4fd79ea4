"""Batch-invariant Triton kernels: the forward that the graph engine and the trainer share under ``rollout.exact``.

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
* The residual-add + RMSNorm and SiLU-and-multiply kernels of :mod:`gspo.rollout.kernels` are per-row already.

Why by hand: no library ships batch-invariant kernels that run an HF model's own weights inside our CUDA graphs
(Thinking Machines' ``batch_invariant_ops`` replaces aten ops globally, which would also change the backward and every
other pass; SGLang's and vLLM's deterministic modes need their own runtimes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gspo.rollout.kernels import INTERPRETED, rounded

# The matmul's one configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps). Every call uses it, whatever the rows: the point of
# the kernel. A sweep on an H200 (benchmarks/exact_engine.py --matmul-configs, SmolLM2-135M) gave the exact engine, at
# 512 x 128 / 1024 x 512, of the fused step's tokens/s: 64 x 64 x 64 91% / 93%, 64 x 128 x 64 93% / 95%, 128 x 64 x 64
# 86% / 91%, 128 x 128 x 64 (8 warps) 82% / 92%, 32 x 64 x 64 83% / 82%. This one is the configuration whose exactness
# was measured on the GPU (docs/experiments/engine/exact.md); 64 x 128 x 64 is faster but not yet measured there.
MATMUL_BLOCK = (64, 64, 64, 4)
MATMUL_SPLIT_K = 1  # 2: a split-K reduction order (the tests' fault injection; never set by gspo)
# Attention: rows of a tile (token x query head of one KV head) and keys per block. A decode tile uses G of the
# BLOCK_M rows; the same BLOCK_M for both sides keeps each row's dot products the same instructions.
ATTENTION_BLOCK_N = 64
LOGPROB_BLOCK = 1024


@triton.jit
def _k_range(acc, a_ptr, w_ptr, rm, rn, rk, M, N, K, k_lo, k_hi, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    # acc + a[rm, k_lo:k_hi] @ w[rn, k_lo:k_hi]^T, in BLOCK_K steps
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)  # (BK, BN)
        if UPCAST:  # fp32 products in full precision (not TF32); the interpreter multiplies 16-bit floats wrongly
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SPLIT_K == 1:
        acc = _k_range(acc, a_ptr, w_ptr, rm, rn, rk, M, N, K, 0, K, BLOCK_K, UPCAST)
    else:
        mid = tl.cdiv(tl.cdiv(K, BLOCK_K), 2) * BLOCK_K
        acc = _k_range(acc, a_ptr, w_ptr, rm, rn, rk, M, N, K, 0, mid, BLOCK_K, UPCAST)
        acc += _k_range(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), a_ptr, w_ptr, rm, rn, rk, M, N, K, mid, K, BLOCK_K,
                        UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], rounded(acc, c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


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
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
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
            acc = acc * alpha[:, None] + tl.dot(rounded(p, v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
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


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[targets]`` per row: logits (n, V) float32, targets (n,) -> (n,) float32."""
    logits = logits.contiguous()
    n, V = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _token_logprobs[(n,)](logits, targets.contiguous(), out, V, 1.0 / temperature, BLOCK=LOGPROB_BLOCK)
    return out
