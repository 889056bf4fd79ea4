"""The fast rollout engine: its own decode loop around the HF model's modules, a static KV cache, CUDA graphs.

Shapes: ``B`` rows of the batch bucket (N = prompts x n, rounded up), ``L`` cache slots, ``P`` prompt slots
(prompts are left-padded to ``P = L - max_new_tokens``), ``H`` hidden size, ``V`` vocabulary.

How one ``generate`` runs:

1. the unique prompts are prefilled once (eager) into a static cache, and their K/V copied to their ``n`` rows;
2. the first completion token is sampled from the prefill logits;
3. each later token is one replay of a CUDA graph that embeds the last token, runs every decoder layer -- on CUDA for
   Llama-family models the fused step of :mod:`gspo.kernels.fused` (4 GEMMs and 5 Triton kernels a layer), else the
   HF model's own modules (attention, MLP, norms, rotary embedding) against the static cache with a boolean mask of
   the valid slots -- applies the LM head, samples (temperature, top-k, top-p via Gumbel-max) and records the token's
   log-probability under softmax(logits / temperature), then advances every position counter on the device;
4. the host counts the rows still sampling only every ``sync_every`` steps, so there is no host synchronisation per
   token; it stops when none is left, and (``compact``, on with CUDA graphs) once at most half the rows of the step
   are live, moves them to the front and continues on a step captured for that many rows (a power of two, >= 8).

The graph reads the engine's own copy of the weights in place; ``sync_weights`` refreshes it from the trainer's
parameters before each rollout batch, so an optimizer step is seen by the next rollout and the graphs stay valid. Caches and graphs are kept per shape bucket and reused across calls.
On a CPU the same step runs eagerly: the CPU tests check this engine token for token against ``model.generate``.

Differences from the simple engine (``hf.py``): sampling uses Gumbel-max instead of ``torch.multinomial`` (the same
distribution, a different random stream); rows that have ended still run through the step until every row ends
or the next host check shrinks it (their output is masked); attention reads each row's live slots (the fused step,
flash) or all ``L`` slots with a mask.
"""
from __future__ import annotations

import copy
import time
from typing import Protocol

import torch
import torch.nn.functional as F

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gspo.errors import UserError
from gspo.kernels.fused import FusedDecoder, exact_unsupported, fused_unsupported
from gspo.models import (attention_context, attention_implementation, autocast_context, cache_kwarg, final_logits,
                         head_dim, kv_heads, named_weights, pad_prompts, pad_token_id, stop_token_ids)
from gspo.models.moe import Routing, find_routers
from gspo.rollout.hf import check_request, filter_logits
from gspo.rollout.turns import TurnRows
from gspo.runtime import free_gpu_bytes
from gspo.types import FINISH_LENGTH, FINISH_STOP, Rollout, SamplingParams, TurnEnds

# Decoder-only architectures whose layers take (hidden, attention_mask, position_ids, position_embeddings, cache) and
# whose inner model has embed_tokens / layers / norm / rotary_emb with nothing else between them.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3",
             # MoE: transformers' grouped-GEMM experts are CUDA-graph safe (offsets from histc, no host sync); the fused
             # step runs them as modules between its own attention kernels (not OLMoE: its q/k norms span all heads)
             "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def supports(model) -> bool:
    """Whether the graph engine can run this model's architecture (else use :class:`gspo.rollout.hf.HFEngine`)."""
    inner = getattr(model, "model", None)
    return (getattr(model.config, "model_type", None) in SUPPORTED
            and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")))


def unsupported(model, autocast_dtype: torch.dtype | None, exact: bool = False) -> str | None:
    """Why the graph engine cannot run ``model`` on CUDA with this precision, or None when it can (``exact``: the
    sparse blocks run rollout.exact's kernels, never transformers' experts)."""
    if not supports(model):
        return f"model_type {getattr(model.config, 'model_type', None)!r} is not one of {', '.join(SUPPORTED)}"
    if autocast_dtype is None and next(model.parameters()).dtype == torch.float32 and find_routers(model) and not exact:
        return ("an fp32 MoE: transformers' grouped-GEMM experts copy to the host in fp32, which a CUDA graph cannot "
                "capture (bf16 autocast, the GPU default, can)")
    return None


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, gspo_live=None, **kwargs):
    """Attention for one new token per row against the static cache.

    With ``gspo_live = (starts, used)`` (CUDA, flash kernel available) row ``b`` attends only its live slots
    ``starts[b] - b * L ..`` (``used[b]`` of them) through flash attention's variable-length path, which handles grouped
    K/V natively: the cost follows the live context, not the ``L`` allocated slots, and there is no mask to read.

    Otherwise SDPA with the boolean mask over all ``L`` slots, reading grouped K/V in place: HF's sdpa path repeats K
    and V for every query head of a group first, which with a static cache copies the whole cache twice per layer per
    step (on an H200 at 512 rows, 8 of 17 ms per step). The G query heads of one KV head can instead be G queries of
    that head (G * S of them for S positions): no copy, the same result.
    """
    B, H, S, D = query.shape
    if gspo_live is not None and S == 1:
        starts, used, cu_q = gspo_live  # (B+1,), (B,), (B+1,) int32
        L, Hkv = key.shape[2], key.shape[1]
        k = key.transpose(1, 2).reshape(B * L, Hkv, D)  # the cache's (B, L, Hkv, D) storage: a view
        v = value.transpose(1, 2).reshape(B * L, Hkv, D)
        # Under autocast the rotary embedding leaves the query in float32 (SDPA would be cast by autocast; this op isn't).
        q = query.reshape(B, H, D).to(k.dtype)
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, starts, 1, L, 0.0, False, False, scale=scaling,
                                                      seqused_k=used)[0]  # (B, H, D)
        return out.view(B, 1, H, D), None
    Hkv = key.shape[1]
    if Hkv == H or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    G = H // Hkv
    # Several query positions (a prefill, a multi-turn extension): the G heads' S queries are G * S queries of their KV
    # head, each with its position's mask row; no copy of K and V either.
    q = query.reshape(B, Hkv, G * S, D)  # head h = kv * G + g, the layout repeat_kv assumes
    mask = attention_mask.expand(B, 1, S, attention_mask.shape[-1])  # (B, 1, S, L)
    mask = mask[:, :, None].expand(B, 1, G, S, mask.shape[-1]).reshape(B, 1, G * S, -1)  # one row per query
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # (B, Hkv, G * S, D)
    return out.reshape(B, H, S, D).transpose(1, 2).contiguous(), None


AttentionInterface.register("gspo_decode", _decode_attention)


def _flash_decode_works(device: torch.device, dtype: torch.dtype, config) -> bool:
    """Whether flash attention's variable-length path (with ``seqused_k``) runs here for this head layout."""
    heads, groups, width = config.num_attention_heads, kv_heads(config), head_dim(config)
    if dtype not in (torch.float16, torch.bfloat16) or not torch.backends.cuda.flash_sdp_enabled():
        return False
    try:
        q = torch.zeros(2, heads, width, dtype=dtype, device=device)
        kv = torch.zeros(2 * 4, groups, width, dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        starts = torch.tensor([1, 4, 8], dtype=torch.int32, device=device)
        used = torch.tensor([3, 2], dtype=torch.int32, device=device)
        torch.ops.aten._flash_attention_forward(q, kv, kv, cu, starts, 1, 4, 0.0, False, False, seqused_k=used)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class StaticKV:
    """K/V buffers for every layer, allocated once per shape bucket; ``slots`` says where the next forward writes.

    It stands in for a transformers ``Cache``: attention modules call ``update`` and attend over what it returns.
    Each layer's K and V are ``(B, L, Hkv, D)`` (rows of slots, the layout flash attention's variable-length path
    reads), views of one ``(2, layers, B, L, Hkv, D)`` tensor; ``update`` returns ``(B, Hkv, L, D)`` views of them, the
    layout HF attention functions expect.

    Two ways to write: ``slots`` of shape ``(S,)`` are the same slots of the first ``rows`` rows (the prefill);
    ``slots`` of shape ``(b, S)`` are each fed row's own, in cache row ``row_ids[i]`` (a decode step: the rows
    ``0..b-1``; a multi-turn extension: any rows, whose K/V ``update`` then returns gathered).
    """

    def __init__(self, layers: int, batch: int, groups: int, length: int, width: int, dtype, device):
        # One tensor for each of K and V across layers, so that moving rows (``take_rows``) is a few kernels, not a
        # few per layer; the layers' (B, L, Hkv, D) buffers are views of it.
        self.kv = torch.zeros(2, layers, batch, length, groups, width, dtype=dtype, device=device)
        self.k, self.v = list(self.kv[0]), list(self.kv[1])
        self.slots = torch.zeros(1, dtype=torch.long, device=device)  # (S,) or (b, S): slots the forward writes
        self.row_ids: torch.Tensor | None = None  # (b,) the cache rows of a per-row write
        self.gather = False  # per-row writes: return the rows ``row_ids`` (True) or the first ``rows`` rows (False)
        self.window: tuple[int, int] | None = None  # return only slots lo..hi-1 (what the forward can attend)
        self.rows = batch  # forwards may use the first `rows` rows only (prefill of the unique prompts)

    def view(self, rows: int) -> "StaticKV":
        """The first ``rows`` rows of every layer's buffers (views of the same storage; each layer's is contiguous)."""
        out = copy.copy(self)
        out.kv = self.kv[:, :, :rows]
        out.k, out.v = [k[:rows] for k in self.k], [v[:rows] for v in self.v]
        out.rows = rows
        return out

    def take_rows(self, src: torch.Tensor) -> None:
        """Row ``i`` of every layer's K and V becomes what row ``src[i]`` held, for ``i < len(src)``, where
        ``src[i] >= i`` (rows moved towards the front, in order): so rows can be copied in ascending chunks in place,
        none reading a row an earlier chunk wrote. The temporaries hold at most ``_MOVE_BYTES`` (or one row of one
        layer's K and V, if that is more): the cache fills most of the free memory."""
        n, layers = len(src), self.kv.shape[1]
        row = 2 * self.kv[0, 0, 0].nbytes  # K and V of one row of one layer
        rows = max(1, min(n, _MOVE_BYTES // row))
        per = max(1, _MOVE_BYTES // (row * rows)) if rows == n else 1  # layers per chunk
        for i in range(0, layers, per):
            part = self.kv[:, i:i + per]
            for r in range(0, n, rows):
                part[:, :, r:r + rows] = part.index_select(2, src[r:r + rows])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        lo, hi = self.window or (0, self.kv.shape[3])
        if self.slots.dim() == 2:  # each row its own slots: (b, S) slots, key_states (b, Hkv, S, D)
            rows = self.row_ids[:, None]  # (b, 1)
            self.k[layer_idx][rows, self.slots] = key_states.transpose(1, 2).to(self.kv.dtype)  # (b, S, Hkv, D)
            self.v[layer_idx][rows, self.slots] = value_states.transpose(1, 2).to(self.kv.dtype)
            if self.gather:
                return (self.k[layer_idx][self.row_ids, lo:hi].transpose(1, 2),
                        self.v[layer_idx][self.row_ids, lo:hi].transpose(1, 2))
            return (self.k[layer_idx][: self.rows, lo:hi].transpose(1, 2),
                    self.v[layer_idx][: self.rows, lo:hi].transpose(1, 2))
        k = self.k[layer_idx][: self.rows].transpose(1, 2)  # (b, Hkv, L, D) view
        v = self.v[layer_idx][: self.rows].transpose(1, 2)
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, lo:hi], v[:, :, lo:hi]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class EngineWeights:
    """The engine's own copy of the policy: a second instance of the model's modules (buffers such as rotary frequencies
    copied with them) whose parameters have storage of their own, so the engine never reads the trainer's parameters.

    Linear weights and biases are kept in ``linear_dtype`` (bf16 under autocast: each decode step would otherwise cast
    every fp32 weight again -- inside a CUDA graph it must, see ``autocast_context`` -- one extra kernel per weight and
    ~1.5x the weight bytes moved per token). Norm and embedding weights keep the trainer's dtype, as autocast leaves
    them; a tied LM head gets its own copy (it is a Linear). The copies round exactly as autocast's casts do: the same
    numbers, bit for bit. ``storage`` gives the memory of some of them -- the fused decoder's packed weights -- so one
    copy serves both decode paths. ``load`` copies named tensors in with one ``_foreach_copy_``, in place, so CUDA
    graphs captured over the copies stay valid.
    """

    def __init__(self, model: torch.nn.Module, linear_dtype: torch.dtype, device: torch.device):
        source = dict(model.named_parameters(remove_duplicate=False))
        # A structural copy (modules, config, buffers) whose parameters are placeholders on the meta device: nothing of
        # the size of the weights is copied here, and every parameter the model has -- described by its config or not --
        # gets a slot below.
        memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                for p in model.parameters()}
        replica = copy.deepcopy(model, memo)
        for prefix, module in replica.named_modules():
            module._forward_hooks.clear()  # the trainer's hooks (MoE routing) belong to the trainer's modules
            module._forward_pre_hooks.clear()
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                master = source[f"{prefix}.{name}" if prefix else name]
                # Linear weights, MoE experts' stacked weights (read by grouped GEMMs, not through nn.Linear) and
                # routers' (an F.linear under autocast: the same bf16 numbers as a cast at each call)
                low = isinstance(module, torch.nn.Linear) or type(module).__name__.endswith(("Experts", "Router"))
                dtype = linear_dtype if low and master.dtype.is_floating_point else master.dtype
                module._parameters[name] = torch.nn.Parameter(torch.empty(master.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
        self.model = replica.eval().requires_grad_(False)
        self.slots: dict[str, torch.Tensor] = {}

    def give_storage(self, storage) -> None:
        """Back ``(module, parameter name, tensor)`` triples of the replica with the given tensors (packed weights)."""
        for module, name, tensor in storage:
            module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)

    def index(self) -> None:
        """Fix the name -> tensor map ``load`` writes to (after ``give_storage``)."""
        self.slots = dict(self.model.named_parameters(remove_duplicate=False))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots.values())

    @torch.no_grad()
    def load(self, weights) -> None:
        """Copy every ``(name, tensor)`` into the replica; each of its parameters must be given exactly once."""
        dst, src, seen, pending = [], [], set(), 0
        for name, tensor in weights:
            slot = self.slots.get(name)
            if slot is None or name in seen:
                why = "twice" if name in seen else "but the engine's model has no such parameter"
                raise UserError(f"sync_weights got a weight named {name!r} {why}; pass the policy's named parameters "
                                "(gspo.models.named_weights(model)).")
            seen.add(name)
            dst.append(slot)
            src.append(tensor)
            pending += tensor.numel() * tensor.element_size()
            if pending > _FLUSH_BYTES:  # gathered full tensors (a sharded policy) are copied and freed as they come
                torch._foreach_copy_(dst, src)
                dst, src, pending = [], [], 0
        missing = [n for n in self.slots if n not in seen]
        if missing:
            raise UserError(f"sync_weights was not given {len(missing)} of the engine's weights ({missing[:3]}...); pass "
                            "every named parameter of the policy (gspo.models.named_weights(model)).")
        if dst:  # empty when the last weight filled a chunk (a 7B model's LM head alone is 1 GB)
            torch._foreach_copy_(dst, src)


_FLUSH_BYTES = 256 << 20
_MOVE_BYTES = 64 << 20
_COMPACT_MIN = 8  # the fewest rows a step is compacted to (the smallest bucket): fewer saves nothing measurable


class _Bucket:
    """Everything static for one (batch, length) shape: cache, step buffers, and the captured graphs."""

    # The buffers with one entry per row that the decode step reads or writes (moved together by ``_compact``)
    ROW_STATE = ("tok", "pos", "valid", "used", "fill", "count", "room", "done", "out_tok", "out_logp", "order")

    def routes(self, routing) -> torch.Tensor:
        """The static route records ``(Lr, B+1, L, k)`` of this bucket (row B takes prompt padding), zeroed."""
        shape = (len(routing.routers), self.batch + 1, self.length, routing.top_k)
        if self._routes is None or self._routes.shape != shape:
            self._routes = routing.empty_records(self.batch, self.length, self.route_rows.device).records
            self.clear_graphs()  # captured graphs point at the old buffer
        else:
            self._routes.zero_()
        return self._routes

    def clear_graphs(self) -> None:
        """Drop the captured graphs of the bucket and of its views (they point at buffers about to change)."""
        self.graphs.clear()
        self.views.clear()

    def view(self, rows: int) -> "_Bucket":
        """The bucket's first ``rows`` rows as a bucket of their own: every per-row buffer and the cache are views of
        this bucket's (the step counters are shared), with graphs of its own; kept, so its graphs are captured once."""
        if rows == self.batch:
            return self
        if rows not in self.views:
            v = copy.copy(self)
            v.batch, v.cache, v.graphs, v.views = rows, self.cache.view(rows), {}, {}
            v.extension, v.extension_pool = {}, None  # multi-turn extensions run on the whole bucket
            for name in (*self.ROW_STATE, "route_rows", "wslot", "row_base"):
                setattr(v, name, getattr(self, name)[:rows])
            v.starts, v.cu_q = self.starts[:rows + 1], self.cu_q[:rows + 1]
            self.views[rows] = v
        return self.views[rows]

    def __init__(self, engine: "GraphEngine", batch: int, length: int):
        cfg, dev = engine.model.config, engine.device
        self.cache = StaticKV(cfg.num_hidden_layers, batch, kv_heads(cfg), length, head_dim(cfg), engine.cache_dtype, dev)
        self.batch, self.length = batch, length
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) last sampled token
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, 1) its position id
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) its index in this turn's output + 1
        # (B,) the K/V slots each row holds (its prompt, then every token fed since): the row's next token's position,
        # and its next slot after the row's first
        self.fill = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.wslot = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) the slot the step writes (see ``_step``)
        self.count = torch.zeros(batch, dtype=torch.int32, device=dev)  # (B,) tokens sampled in this turn
        self.room = torch.zeros(batch, dtype=torch.int32, device=dev)  # (B,) tokens the row may sample in this turn
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=dev)  # (B, L) slots a query may attend
        # The same as offsets for flash attention: row b's live slots are starts[b] - b * L .. + used[b] - 1.
        # The fused step moves rows' state, not their K/V, so its starts may point at another row's storage.
        self.starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * length  # (B+1,)
        self.row_base = self.starts[:-1].clone()  # (B,) static: each row's own first slot, b * L
        self.used = torch.zeros(batch, dtype=torch.int32, device=dev)  # (B,)
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)  # (B+1,) one query per row
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)  # (B,)
        self.out_tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, T) grown per call
        self.out_logp = torch.zeros(batch, 1, dtype=torch.float32, device=dev)
        # (B,) the request row each bucket row holds: rows are reordered when live ones move to the front
        self.order = torch.arange(batch, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.views: dict[int, _Bucket] = {}  # rows -> the first rows as a bucket (see ``view``)
        # Multi-turn: the static inputs of an extension of width W (ids, ids to feed, room; see ``_extend_step``), and
        # the memory pool its graphs share
        self.extension: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.extension_pool = None
        self.route_rows = torch.arange(batch, device=dev)  # (B,) static: the rows a decode step records (and writes)
        self._routes: torch.Tensor | None = None
        self.root = self  # the whole bucket (a view's is the bucket it is the first rows of)
        # The fused step, unless a sliding window is shorter than this bucket's cache.
        self.fused = engine.fused is not None and fused_unsupported(engine.model, length) is None


class GraphEngine:
    """Fast sampling for supported HF decoder models; same interface and output as :class:`HFEngine`.

    The engine samples from its own copy of the policy (:class:`EngineWeights`), built from ``model`` (architecture,
    buffers and first weights) and refreshed by ``sync_weights`` with the trainer's named parameters before each
    rollout; between two syncs it never reads the trainer's parameters.

    ``max_batch`` caps the rows of one batch bucket; a request with more rows (or more than fit in free GPU memory)
    is generated in several calls of whole prompts. ``low_precision_weights`` (default: on under autocast) keeps the
    copy's Linear weights in the autocast dtype instead of casting fp32 copies at every step; ``flash_decode``
    (default: on when flash attention runs on this GPU) makes decode attention read live cache slots only; ``fused``
    (default: on for CUDA, 16-bit caches and the models :func:`gspo.kernels.fused.fused_unsupported` accepts) runs each
    decode layer as 4 GEMMs and 5 Triton kernels (:mod:`gspo.kernels.fused`) instead of the HF modules;
    ``compact`` (default: on with CUDA graphs) moves the rows still sampling to a smaller step once half of them have
    ended (see ``_compact``). ``routing`` (an MoE policy's :class:`gspo.models.moe.Routing`, R3): every fed token's
    experts are recorded into ``Rollout.routes`` (see the ``routing`` setter).
    """

    records_routing = True
    takes_weights_in_flight = True  # it polls ``swaps`` between decode steps (rollout.in_flight)

    def __init__(self, model, tokenizer, *, stop_ids: list[int] | None = None, device=None,
                 autocast_dtype: torch.dtype | None = None, sync_every: int = 4, use_graphs: bool | None = None,
                 max_batch: int | None = None, low_precision_weights: bool | None = None,
                 flash_decode: bool | None = None, fused: bool | None = None, compact: bool | None = None,
                 routing: Routing | None = None, exact: bool = False):
        if not supports(model):
            fix = "set rollout.exact = false (it needs this engine)" if exact else "set rollout.engine = 'hf'"
            raise UserError(f"The graph rollout engine does not support model_type {model.config.model_type!r} "
                            f"(supported: {', '.join(SUPPORTED)}); {fix}.")
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        self.autocast_dtype = autocast_dtype
        master_dtype = next(model.parameters()).dtype
        self.cache_dtype = autocast_dtype or master_dtype
        self.sync_every = sync_every
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and (why_not := unsupported(model, autocast_dtype, exact)) is not None:
            raise UserError(f"The graph rollout engine cannot capture this model: {why_not}; set model.precision = "
                            "'bf16-autocast' or rollout.engine = 'hf'.")
        self.max_batch = max_batch
        self.compact = self.use_graphs if compact is None else compact
        self._stop = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._gen: torch.Generator | None = None  # the generator captured graphs draw from
        self._cache_arg = cache_kwarg(model.model.layers[0].forward)
        self.warmup_s = 0.0  # seconds spent capturing graphs, cumulative
        why_not = fused_unsupported(model)
        if exact:  # rollout.exact: the fused step's batch-invariant kernels, everywhere
            why_exact = exact_unsupported(model, why_not, routing)
            if why_exact is not None:
                raise UserError(f"rollout.exact cannot run this model: {why_exact}; set rollout.exact = false.")
            fused = True
        self.exact = exact
        if exact:
            from gspo.kernels.exact_kernels import token_logprobs  # needs triton: imported only here

            self._exact_logprobs = token_logprobs
        if fused is None:  # MoE included: on an H100 its fused step gave 62% of the dense fused step's tokens/s
            # (the module step 49%; benchmarks/README.md#mixture-of-experts)
            fused = self.device.type == "cuda" and self.cache_dtype in (torch.float16, torch.bfloat16) and why_not is None
        elif fused and why_not is not None:
            raise UserError(f"The fused decode step cannot run this model: {why_not}; leave fused unset (it falls back "
                            "to the HF modules' step).")
        if low_precision_weights is None:
            low_precision_weights = autocast_dtype is not None
        self.weights = EngineWeights(model, self.cache_dtype if fused or low_precision_weights else master_dtype,
                                     self.device)
        self.model = self.weights.model
        self.fused = FusedDecoder(self.model, self.cache_dtype, self.device, exact=exact) if fused else None
        if self.fused is not None:  # its packed weights are the copy's Linear weights: one copy for both paths
            self.weights.give_storage(self.fused.copies())
        self.weights.index()
        self.sync_weights(named_weights(model))
        if flash_decode is None:
            flash_decode = self.device.type == "cuda" and _flash_decode_works(self.device, self.cache_dtype, model.config)
        self.flash_decode = flash_decode
        self._routing = None  # the trainer's gspo.models.moe.Routing when the engine records routes (R3)
        self._route_layout: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, positions) of the forward
        self._route_buffer: torch.Tensor | None = None  # (Lr, B+1, L, k) of the bucket in use
        self._route_hooks: list = []
        self.routing = routing
        # In-flight weight updates (rollout.in_flight): a source of newer weights polled between decode steps (see
        # InFlight), and this call's (first output column, version) of each set of weights it sampled with
        self.swaps: InFlight | None = None
        self._swap_log: list[tuple[int, int]] = []
        self._swap_prompts: tuple[list[list[int]], int] | None = None

    @property
    def routing(self):
        return self._routing

    @routing.setter
    def routing(self, routing) -> None:
        """Record each fed token's experts (R3): hooks on the engine's own routers write into a static per-bucket
        buffer at static (row, position) tensors, so the writes are captured in the decode step's CUDA graph (Python
        hooks do not run when a graph replays; the kernels they launched at capture do)."""
        for h in self._route_hooks:
            h.remove()
        self._routing, self._route_hooks = routing, []
        if routing is None:
            return
        self._routers = find_routers(self.model)
        self._route_hooks = [r.register_forward_hook(self._record_route) for r in self._routers]
        self._router_index = {id(r): i for i, r in enumerate(self._routers)}
        for b in self._buckets.values():
            b.clear_graphs()  # captured without the recording kernels

    def _record_route(self, router, args, output) -> None:
        if self._route_layout is None or self._route_buffer is None:
            return
        rows, pos = self._route_layout
        self._route_buffer[self._router_index[id(router)], rows, pos] = output[2].to(self._route_buffer.dtype)

    def sync_weights(self, weights) -> None:
        """Copy the policy's ``(name, tensor)`` pairs into the engine's own copy, in place (captured graphs stay valid)."""
        self.weights.load(weights)

    # ------------------------------------------------------------------------------------------ model pieces

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: StaticKV, live=None) -> torch.Tensor:
        """Hidden state of the last position after every layer: ids (b, S), pos (b, S), mask (b, 1, S, L); ``live``
        is passed to the decode attention (see ``_decode_attention``).  (b, H)"""
        inner = self.model.model
        h = inner.embed_tokens(ids)  # (b, S, H)
        rope = inner.rotary_emb(h, pos)
        extra = {} if live is None else {"gspo_live": live}
        for layer in inner.layers[: self.model.config.num_hidden_layers]:
            out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope, use_cache=True,
                        **{self._cache_arg: cache}, **extra)
            h = out[0] if isinstance(out, tuple) else out
        return inner.norm(h[:, -1])  # (b, H)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return self.fused.exact_logits(hidden)  # (b, V) float32
        return final_logits(self.model.config, self.model.get_output_embeddings()(hidden).float())  # (b, V)


    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (b,) and log pi(token) under softmax(logits / temperature); graph-safe (no host sync)."""
        if params.greedy:
            tok = logits.argmax(-1)  # (b,)
            if self.exact:  # the trainer's kernel; greedy rows record log pi at temperature 1, as every engine does
                return tok, self._exact_logprobs(logits, tok, 1.0)
            return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        scaled = logits / params.temperature  # (b, V)
        filtered = filter_logits(scaled, params)
        # Gumbel-max: with E ~ Exp(1), -log E is Gumbel, and argmax(l - log E) is a draw from softmax(l), with no
        # multinomial (which syncs). E is clamped away from 0, whose log would pick a token of probability 0.
        e = torch.empty_like(filtered).exponential_(generator=self._gen).clamp_(min=1e-30).log_()  # (b, V)
        tok = (filtered - e).argmax(-1)  # (b,)
        if self.exact:  # the trainer's own log-prob kernel (gspo.train.exact), not torch's logsumexp
            return tok, self._exact_logprobs(logits, tok, params.temperature)
        lse = torch.logsumexp(scaled, -1)  # (b,): log pi(v) = scaled[v] - lse, without writing a (b, V) log-softmax
        return tok, scaled.gather(-1, tok[:, None]).squeeze(-1) - lse

    # ------------------------------------------------------------------------------------------ decode step

    def _step(self, b: _Bucket, params: SamplingParams) -> None:
        """One decode step on the bucket's static buffers: everything in it may be captured in a graph.

        Each row writes its fed token's K/V to its own next slot (first slot + ``fill``) and only a row still sampling
        advances: a row whose turn has ended keeps its K/V as they are, so a multi-turn row can go on later in its own
        cache (what it was fed meanwhile lands past its end, where the next real token overwrites it)."""
        live = ~b.done  # (B,)
        if b.fused:
            # The fused step's slots are flat indices into the whole bucket's cache (row r, slot s: r * L + s).
            b.wslot.copy_(b.starts[:-1] + b.fill)
            # A row that has ended attends no slots at all (its output is masked): ended rows stop costing attention.
            torch.where(b.done, torch.zeros_like(b.used), b.fill + 1, out=b.used)
            hidden = self.fused.forward(b.tok, b.pos, b.root.cache, b.wslot, b.starts, b.used)  # (B, H)
        else:
            b.wslot.copy_(b.starts[:-1] - b.row_base + b.fill)  # the slot in the row's own cache row
            torch.add(b.fill, 1, out=b.used)
            b.cache.slots, b.cache.row_ids, b.cache.gather, b.cache.rows = b.wslot[:, None], b.route_rows, False, b.batch
            b.cache.window = None
            b.valid.scatter_(1, b.wslot[:, None], live[:, None])
            live_slots = (b.starts, b.used, b.cu_q) if self.flash_decode else None
            hidden = self._forward(b.tok[:, None], b.pos, b.valid[:, None, None, :], b.cache, live_slots)  # (B, H)
        b.fill += live
        tok, logp = self._sample(self._logits(hidden), params)  # (B,), (B,)
        tok = torch.where(b.done, torch.full_like(tok, self.pad_id), tok)
        logp = torch.where(b.done, torch.zeros_like(logp), logp)
        b.out_tok.index_copy_(1, b.step, tok[:, None])
        b.out_logp.index_copy_(1, b.step, logp[:, None])
        b.count += live
        b.done |= self._is_stop(tok) | (b.count >= b.room)
        b.tok.copy_(tok)
        b.pos += live[:, None]  # an ended row stays at its last position: its routes record stays inside the buffer
        b.step += 1

    def _graph(self, b: _Bucket, params: SamplingParams) -> torch.cuda.CUDAGraph:
        """The decode step of bucket (or view) ``b`` for these sampling settings, captured once."""
        return self._capture(b, ("step", *self._sampling_key(params)), lambda: self._step(b, params))

    def _sampling_key(self, params: SamplingParams) -> tuple:
        return params.greedy, params.temperature, params.top_p, params.top_k, id(self._gen), self._routing is not None

    def _capture(self, b: _Bucket, key: tuple, body, pool=None) -> torch.cuda.CUDAGraph:
        """``body`` (graph-safe work on ``b``'s static buffers) captured as ``b.graphs[key]``, once: two warm-up runs
        on a side stream (lazy initialisation, autotuning), each undone on the bucket's per-row state, then the
        capture, which runs nothing. ``pool``: a memory pool shared with other graphs that are never replayed at once
        and keep nothing in it between replays."""
        if key not in b.graphs:
            t0 = time.perf_counter()
            state = (b.tok, b.pos, b.step, b.valid, b.used, b.fill, b.count, b.room, b.done, b.out_tok, b.out_logp)
            saved = [t.clone() for t in state]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    body()
                    for t, s in zip(state, saved):
                        t.copy_(s)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._gen is not None:
                graph.register_generator_state(self._gen)
            # thread-local: an update on another thread (asynchronous rollouts) may allocate and synchronise meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                body()
            for t, s in zip(state, saved):
                t.copy_(s)
            b.graphs[key] = graph
            self.warmup_s += time.perf_counter() - t0
        return b.graphs[key]

    # ------------------------------------------------------------------------------------------ generate

    def _bucket(self, rows: int, length: int) -> _Bucket:
        batch = max(8, 1 << (rows - 1).bit_length())
        key = (batch, length)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(self, batch, length)
        return self._buckets[key]

    def _bytes_per_row(self, length: int) -> int:
        cfg = self.model.config
        itemsize = torch.empty((), dtype=self.cache_dtype).element_size()
        kv = 2 * cfg.num_hidden_layers * kv_heads(cfg) * length * head_dim(cfg) * itemsize
        # + fp32 logits, log-softmax, Gumbel noise and temporaries; with compaction the graphs of the smaller steps
        # (half, a quarter, ... of the rows) keep theirs too, as many again
        return kv + (12 if self.compact else 6) * cfg.vocab_size * 4

    def rows_that_fit(self, length: int) -> int:
        """The largest power-of-two batch bucket of ``length`` slots that fits ``max_batch`` and, on CUDA, 90% of the
        free memory (buckets already allocated count as free: they are reused)."""
        limit = self.max_batch or 1 << 20
        if self.device.type == "cuda":
            free = free_gpu_bytes(self.device) + sum(b.cache.nbytes() for b in self._buckets.values())
            limit = min(limit, int(0.9 * free) // self._bytes_per_row(length))
        if limit < 8:
            raise UserError(f"Not even 8 rollout rows of {length} cache slots fit in the free GPU memory; lower "
                            "rollout.max_new_tokens or data.max_prompt_tokens, or free memory.")
        return 1 << (limit.bit_length() - 1)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator | None = None, turns: TurnEnds | None = None) -> Rollout:
        """``n`` completions for each token-id prompt; row ``i`` belongs to prompt ``i // n``. ``turns``: multi-turn
        rows, as :meth:`gspo.rollout.hf.HFEngine.generate` takes them (each turn continues the row's own KV cache)."""
        check_request(self.model, prompts, n, params)
        width = max(len(p) for p in prompts)
        length = -(-(width + params.max_new_tokens) // 64) * 64  # slots, in buckets of 64
        per_call = max(1, self.rows_that_fit(length) // n)  # prompts per call; more are generated in turn
        if len(prompts) > per_call:
            return Rollout.concat([self.generate(prompts[i:i + per_call], n, params, generator,
                                                 None if turns is None else _offset(turns, i * n))
                                   for i in range(0, len(prompts), per_call)])
        rows = len(prompts) * n
        b = self._bucket(rows, length)
        P = length - params.max_new_tokens
        self._gen = generator
        if self.swaps is not None:
            if turns is not None:
                raise UserError("In-flight weight updates (rollout.in_flight) are not built for multi-turn rows; set "
                                "rollout.in_flight = 'off'.")
            self._swap_log, self._swap_prompts = [(0, self.swaps.version)], (prompts, n)
        with torch.no_grad(), autocast_context(self.device, self.autocast_dtype, cache=False), attention_context():
            if turns is not None:
                return self._multi_turn(b, prompts, n, P, params, turns)
            self._prefill(b, prompts, n, P, params, params.max_new_tokens)
            self._decode(b, params)
        return self._collect(b, prompts, n, rows, params)

    def _multi_turn(self, b: _Bucket, prompts: list[list[int]], n: int, P: int, params: SamplingParams,
                    turns: TurnEnds) -> Rollout:
        """Rows of several turns. A turn is one decode of the bucket, each row ending on a stop token or its room
        (``max_turn_tokens``, and what is left of ``max_new_tokens``); the rows ``turns`` answers get the answer's ids
        fed in one forward into their own caches (``_extend``), and the next turn decodes them. The first turn is
        the single-turn decode, step for step: rows that end after it are the single-turn rollout."""
        rows = len(prompts) * n
        book = TurnRows(rows, params, turns, self.stop_ids)
        self._prefill(b, prompts, n, P, params, book.per_turn)
        going = list(range(rows))
        while True:
            self._decode(b, params, keep_ended=True)
            if b.fused:
                self._home(b)
            self._route_layout = (b.route_rows, b.pos[:, 0])  # eager steps record the whole bucket's rows again
            at = torch.argsort(b.order)[:rows]  # (N,) the bucket row of each request row
            tok, logp, count = b.out_tok[at].cpu(), b.out_logp[at].float().cpu(), b.count[at].cpu()
            ended = [r for r in going if book.sampled(r, tok[r, :int(count[r])].tolist(),
                                                      logp[r, :int(count[r])].tolist())]
            answers = book.answer(ended)
            if not answers:
                break
            going = list(answers)
            # The stop token that ended each turn was sampled but not fed (the row had ended): it goes in first.
            self._extend(b, at[going], [[book.stop_token(r), *answers[r]] for r in going],
                         [book.room(r) for r in going], params)
        rollout = book.rollout(self.tokenizer, self.pad_id, prompts, n)
        if self._routing is not None:  # every fed position: the prompt, sampled turns and appended ids, not the last
            rollout.routes = self._route_buffer[:, at].permute(1, 2, 0, 3).cpu()  # (N, L, Lr, k)
            fed = torch.tensor([len(prompts[i // n]) for i in range(rows)]) + rollout.completion_mask.sum(-1) - 1
            rollout.routes_mask = torch.arange(rollout.routes.shape[1])[None, :] < fed[:, None]  # (N, L)
            self._route_layout = self._route_buffer = None
        return rollout

    def _extend(self, b: _Bucket, at: torch.Tensor, chunks: list[list[int]], room: list[int],
                params: SamplingParams) -> None:
        """Feed bucket row ``at[i]`` the ids ``chunks[i]`` into its own cache after its last slot, sample each row's
        first token of its next turn, and make those rows the only live ones, each with ``room[i]`` tokens for the
        turn.

        One forward of every row of the bucket over a width of ``W`` ids, ``W`` the longest chunk rounded up to a power
        of two, attending the slots ``0 .. S-1``, ``S`` the furthest slot a fed row reaches rounded up to a power of two
        (at least 64, at most the cache's length): the shapes are static, so on CUDA the forward is a graph captured
        once per ``(W, S)`` and replayed (as one eager forward it cost a roughly fixed 38-57 ms of kernel launches on an
        H200, 14-47% of re-prefilling the history). Rows with nothing to feed are all padding and end at once."""
        if self.exact:
            return self._exact_extend(b, at, chunks, room, params)
        W = max(8, 1 << (max(len(c) for c in chunks) - 1).bit_length())
        ids = torch.full((b.batch, W), self.pad_id, dtype=torch.long)
        k = torch.zeros(b.batch, dtype=torch.int32)
        rooms = torch.zeros(b.batch, dtype=torch.int32)
        for r, c, m in zip(at.tolist(), chunks, room):
            ids[r, W - len(c):] = torch.tensor(c)
            k[r], rooms[r] = len(c), m
        if W not in b.extension:
            b.extension[W] = tuple(t.to(self.device) for t in (ids, k, rooms))
        for buffer, value in zip(b.extension[W], (ids, k, rooms)):
            buffer.copy_(value)
        reach = int((b.starts[:-1] % b.length + b.fill + b.extension[W][1]).max())  # slots the furthest row holds after
        S = min(b.length, max(64, 1 << (reach - 1).bit_length()))
        if self.use_graphs:
            if b.extension_pool is None:
                b.extension_pool = torch.cuda.graph_pool_handle()
            self._capture(b, ("extend", W, S, *self._sampling_key(params)),
                          lambda: self._extend_step(b, W, S, params), pool=b.extension_pool).replay()
        else:
            self._extend_step(b, W, S, params)
        self._route_layout = (b.route_rows, b.pos[:, 0])  # decode: every row, at its fed token's position

    def _exact_extend(self, b: _Bucket, at: torch.Tensor, chunks: list[list[int]], room: list[int],
                      params: SamplingParams) -> None:
        """``_extend`` under ``rollout.exact``: the fed ids of every row as one packed pass of the exact forward (each
        row a sequence whose keys start at its cache row's first slot, after the ``fill`` it holds), so that their
        K/V and the next turn's first token are the trainer's numbers; the rows' state then changes as
        ``_extend_step`` changes it. Eager: once per turn, and its shapes change with every turn."""
        dev, L = self.device, b.length
        rows = at.tolist()
        first = (b.starts[:-1] % L).tolist()  # after _home: row i's state is over its own cache row i
        fill = b.fill.tolist()
        hidden = self.fused.packed_forward(chunks, [r * L + first[r] for r in rows], b.cache.k, b.cache.v,
                                           held=[fill[r] for r in rows])  # (R, H)
        tok, logp = self._sample(self._logits(hidden), params)  # (R,)
        on = torch.zeros(b.batch, dtype=torch.bool, device=dev)
        on[at] = True
        fed = torch.zeros(b.batch, dtype=torch.long, device=dev)
        fed[at] = torch.tensor([len(c) for c in chunks], device=dev)
        rooms = torch.zeros(b.batch, dtype=b.room.dtype, device=dev)
        rooms[at] = torch.tensor(room, dtype=b.room.dtype, device=dev)
        all_tok = torch.full((b.batch,), self.pad_id, dtype=torch.long, device=dev)
        all_tok[at] = tok
        all_logp = torch.zeros(b.batch, dtype=logp.dtype, device=dev)
        all_logp[at] = logp
        self._start_turn(b, on, b.fill.long() + fed, all_tok, all_logp, rooms)

    def _extend_step(self, b: _Bucket, W: int, S: int, params: SamplingParams) -> None:
        """The work of ``_extend`` on the bucket's static buffers (``b.extension[W]``: ids ``(B, W)``, right-aligned;
        ids to feed ``(B,)``, 0 for a row that goes on no more; its room ``(B,)``), attending slots ``0 .. S-1`` of
        each row's own cache row (see ``_home``); graph-safe.

        Right-aligned: the padding on the left writes to the cache's last slot, which no row ever fills (a row's
        last sampled token is never fed), and attends the row's first slot only."""
        dev, L = self.device, b.length
        ids, k, room = b.extension[W]
        first, fill, k = (b.starts[:-1] % L).long(), b.fill.long(), k.long()  # (B,) each
        on = k > 0  # (B,) the rows fed
        off = torch.arange(W, device=dev)[None, :] - (W - k)[:, None]  # (B, W): index in the chunk (< 0: padding)
        real = off >= 0
        last = torch.where(real, first[:, None] + fill[:, None] + off, first[:, None])  # the last slot each query sees
        slot = torch.arange(S, device=dev)
        attend = (slot[None, None, :] >= first[:, None, None]) & (slot[None, None, :] <= last[:, :, None])  # (B, W, S)
        cache = b.cache
        cache.row_ids, cache.gather, cache.rows, cache.window = b.route_rows, False, b.batch, (0, S)
        cache.slots = torch.where(real, last, L - 1)  # (B, W)
        pos = (fill[:, None] + off).clamp(min=0)  # (B, W)
        if self._routing is not None:  # the fed ids' experts at their positions; padding goes to the spare row
            self._route_layout = (torch.where(real, b.route_rows[:, None], b.batch).reshape(-1), pos.reshape(-1))
        with attention_implementation(self.model.config, "gspo_decode"):
            hidden = self._forward(ids, pos, attend[:, None], cache)  # (B, H)
        cache.window = None
        tok, logp = self._sample(self._logits(hidden), params)  # (B,)
        fill = fill + k
        slot = torch.arange(L, device=dev)
        b.valid.copy_(torch.where(on[:, None], (slot[None, :] >= first[:, None]) & (slot[None, :] < (first + fill)[:, None]),
                                  b.valid))  # the module step's mask
        self._start_turn(b, on, fill, tok, logp, room)

    def _start_turn(self, b: _Bucket, on: torch.Tensor, fill: torch.Tensor, tok: torch.Tensor, logp: torch.Tensor,
                    room: torch.Tensor) -> None:
        """After an extension: the rows ``on`` (B,) begin a turn holding ``fill`` (B,) slots, with ``tok`` / ``logp``
        (B,) their first sampled token and ``room`` (B,) the tokens they may sample; the others end. Graph-safe."""
        b.fill.copy_(fill)
        b.pos.copy_(torch.where(on, fill, b.pos[:, 0])[:, None])  # the position of the token just sampled
        b.tok.copy_(torch.where(on, tok, b.tok))
        b.done.copy_(~on | self._is_stop(tok) | (room <= 1))
        b.count.copy_(on.int())
        b.room.copy_(room)
        b.out_tok.fill_(self.pad_id)
        b.out_logp.zero_()
        b.out_tok[:, 0] = torch.where(on, tok, torch.full_like(tok, self.pad_id))
        b.out_logp[:, 0] = torch.where(on, logp, torch.zeros_like(logp)).to(b.out_logp.dtype)
        b.step.fill_(1)

    def _is_stop(self, tok: torch.Tensor) -> torch.Tensor:
        """Whether each token (B,) is a stop token. Not torch.isin: past a few stop ids it sorts, which a CUDA graph
        cannot capture."""
        return (tok[:, None] == self._stop[None, :]).any(-1)

    def _home(self, b: _Bucket) -> None:
        """Put every row's state back over its own cache row (``starts[i] // L == i``), in place: the fused step's
        compaction moves rows' state and leaves their K/V where they are, and the extension then reads K/V in place
        (``order`` keeps each request row's place)."""
        home = torch.argsort(b.starts[:-1] // b.length)  # (B,) the bucket row whose state goes to row i
        self._permute_rows(b, home)
        b.starts[:-1] = b.starts[:-1][home]

    def _permute_rows(self, v: _Bucket, order: torch.Tensor) -> None:
        """Row ``i`` of view ``v``'s per-row state (and its recorded experts) becomes what row ``order[i]`` held."""
        for name in v.ROW_STATE:
            t = getattr(v, name)
            t.copy_(t[order])
        if self._route_buffer is not None:  # a row's recorded experts move with it
            self._route_buffer[:, :v.batch] = self._route_buffer[:, order]

    def _prefill(self, b: _Bucket, prompts: list[list[int]], n: int, P: int, params: SamplingParams,
                 room: int) -> None:
        """Prefill the unique prompts, copy their K/V to their ``n`` rows and sample each row's first token; a row may
        sample ``room`` tokens before its turn ends."""
        dev = self.device
        ids, mask = pad_prompts(prompts, self.pad_id)  # (U, w)
        ids = F.pad(ids, (P - ids.shape[1], 0), value=self.pad_id).to(dev)  # (U, P)
        mask = F.pad(mask, (P - mask.shape[1], 0), value=0).to(dev).bool()  # (U, P)
        U = ids.shape[0]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, P)
        # Query q attends key slot s <= q that holds a prompt token; a padding query attends itself only, which keeps
        # its (unused) K/V finite: a NaN there would poison every row through 0 * NaN in the attention product.
        slot = torch.arange(b.length, device=dev)
        q = torch.arange(P, device=dev)
        key_ok = torch.zeros(U, b.length, dtype=torch.bool, device=dev)
        key_ok[:, :P] = mask
        attn = key_ok[:, None, :] & (slot[None, None, :] <= q[None, :, None])  # (U, P, L)
        attn |= (~mask)[:, :, None] & (slot[None, None, :] == q[None, :, None])
        b.cache.rows, b.cache.slots = U, torch.arange(P, device=dev)
        if self._routing is not None:  # prompt u is recorded as its first sample's row; padding goes to the spare row
            self._route_buffer = b.routes(self._routing)
            first = torch.where(mask, (torch.arange(U, device=dev) * n)[:, None], b.batch)  # (U, P)
            self._route_layout = (first.reshape(-1), pos.reshape(-1))
        b.cache.window = (0, P)  # the prompts' slots: the rest of the cache is empty
        if self.exact:
            hidden = self._exact_prefill(b, prompts, P)  # (U, H)
        else:
            with attention_implementation(self.model.config, "gspo_decode"):
                hidden = self._forward(ids, pos, attn[:, None, :, :P], b.cache)  # (U, H)
        b.cache.window = None
        if self._routing is not None:
            src_first = torch.arange(b.batch, device=dev).div(n, rounding_mode="floor").clamp(max=U - 1) * n
            self._route_buffer[:, :b.batch] = self._route_buffer[:, src_first]
            self._route_layout = (b.route_rows, b.pos[:, 0])  # decode: every row, at its fed token's position
        # Each prompt's K/V goes to its n rows (bucket rows past N copy the last prompt and are marked done).
        src = torch.arange(b.batch, device=dev).div(n, rounding_mode="floor").clamp(max=U - 1)  # (B,)
        for k, v in zip(b.cache.k, b.cache.v):
            k.copy_(k[src])
            v.copy_(v[src])
        b.cache.rows = b.batch
        tok, logp = self._sample(self._logits(hidden)[src], params)  # (B,)
        rows = U * n
        b.done.copy_(torch.arange(b.batch, device=dev) >= rows)
        tok = torch.where(b.done, torch.full_like(tok, self.pad_id), tok)
        logp = torch.where(b.done, torch.zeros_like(logp), logp)
        T = params.max_new_tokens
        if b.out_tok.shape[1] != T:
            b.out_tok, b.out_logp = b.out_tok.new_zeros(b.batch, T), b.out_logp.new_zeros(b.batch, T)
            b.clear_graphs()  # captured graphs point at the old output buffers
        b.out_tok.fill_(self.pad_id)
        b.out_logp.zero_()
        torch.arange(b.batch, device=dev, out=b.order)
        b.out_tok[:, 0], b.out_logp[:, 0] = tok, logp
        b.count.copy_(b.done.logical_not())
        b.room.fill_(room)
        b.done |= torch.isin(tok, self._stop) | (b.count >= b.room)
        b.tok.copy_(tok)
        b.pos.copy_(mask.long().sum(-1)[src][:, None])
        b.valid.zero_()
        b.valid[:, :P] = mask[src]
        plen = mask.sum(-1)[src].int()  # (B,) live prompt slots: the last plen of the first P
        b.starts[:-1] = torch.arange(b.batch, device=dev, dtype=torch.int32) * b.length + (P - plen)
        b.fill.copy_(plen)
        b.step.fill_(1)

    def _exact_prefill(self, b: _Bucket, prompts: list[list[int]], P: int) -> torch.Tensor:
        """``rollout.exact``'s prefill: the unique prompts as one packed pass of the fused decoder's exact forward (the
        trainer's pass, gspo.train.exact), prompt u's K/V written to its cache row u at the slots the decode step reads
        (the last ``len`` of the first ``P``). The final-norm hidden state of each prompt's last token (U, H)."""
        if not b.fused:
            raise UserError(f"rollout.exact: the model's sliding window is shorter than the {b.length}-slot cache, "
                            "which only the module step handles; lower rollout.max_new_tokens or "
                            "data.max_prompt_tokens, or set rollout.exact = false.")
        L = b.length
        return self.fused.packed_forward(prompts, [u * L + P - len(p) for u, p in enumerate(prompts)], b.cache.k,
                                         b.cache.v)

    def _decode(self, b: _Bucket, params: SamplingParams, keep_ended: bool = False) -> None:
        """Decode until every row of ``b`` has ended its turn (or ``max_new_tokens`` steps); ``keep_ended``: rows that
        end must keep their K/V (multi-turn), so the module step does not compact."""
        T = params.max_new_tokens
        compact = self.compact and (b.fused or not keep_ended)
        # A capture runs 2 warm-up steps ahead in the buffers (then records a third, which does not run): the last
        # steps of a request decode eagerly.
        graph_for = lambda v, j: self._graph(v, params) if self.use_graphs and T - j >= 3 else None  # noqa: E731
        with attention_implementation(self.model.config, "gspo_decode"):
            v = b  # the rows a step runs: the whole bucket, then its first rows, where the live ones were moved
            graph = graph_for(v, 1)
            for j in range(1, T):
                if (j - 1) % self.sync_every == 0 or graph is None:  # steps 1, 1 + sync_every, ...; any with sync_every 1
                    live = int(v.done.logical_not().sum())  # the only host sync: once every sync_every steps
                    if not live:
                        break
                    if self.swaps is not None and not keep_ended and self.swaps.poll():  # newer weights are loaded
                        self._swap_log.append((j, self.swaps.version))  # they sample output column j onwards
                        if self.swaps.recompute:
                            if b.fused:  # the rewrite reads each row's K/V in its own cache row
                                self._home(b)
                                v = b
                            self._recompute_cache(b)
                            graph = graph_for(v, j)
                    rows = max(_COMPACT_MIN, 1 << (live - 1).bit_length())
                    if compact and rows < v.batch and T - j >= 3:  # not for the last eager steps
                        v = self._compact(b, v, rows, live)
                        graph = graph_for(v, j)
                if graph is not None:
                    graph.replay()
                else:
                    self._step(v, params)

    def _recompute_cache(self, b: _Bucket, chunk: int = 32) -> None:
        """After an in-flight weight update (``rollout.in_flight = "recompute"``): write every live row's K/V again
        with the engine's current weights, so the row's next tokens are sampled by exactly those weights.

        A live row's cache holds its prompt and every token it sampled but the last (which the next step feeds), in
        slots ``first .. first + fill - 1`` of its own cache row (``first = starts % L``: the module step keeps its
        rows there, and the fused step's after ``_home``). They are fed again, left-aligned at positions
        ``0 .. fill - 1``, ``chunk`` rows per forward, causally; padding queries write the cache's last slot, which no
        row fills, and attend their row's first slot only. Nothing else of the row changes: its pending token,
        position, room and outputs stay. Eager (once per swap), at roughly the cost of one prefill."""
        dev, L = self.device, b.length
        prompts, n = self._swap_prompts
        live = (~b.done).nonzero().flatten().tolist()
        order, count, fill = b.order.tolist(), b.count.tolist(), b.fill.tolist()
        first_all = (b.starts[:-1] % L).tolist()
        cache = b.cache
        for i in range(0, len(live), chunk):
            rows = live[i:i + chunk]
            seqs = [prompts[order[r] // n] + b.out_tok[r, :count[r] - 1].tolist() for r in rows]
            assert all(len(q) == fill[r] for q, r in zip(seqs, rows)), "a row's cache holds its prompt and fed tokens"
            W = max(len(q) for q in seqs)
            ids = torch.full((len(rows), W), self.pad_id, dtype=torch.long)
            for k, q in enumerate(seqs):
                ids[k, :len(q)] = torch.tensor(q)
            k_len = torch.tensor([len(q) for q in seqs], device=dev)[:, None]  # (c, 1)
            first = torch.tensor([first_all[r] for r in rows], device=dev)[:, None]  # (c, 1)
            off = torch.arange(W, device=dev)[None, :]  # (1, W)
            real = off < k_len  # (c, W)
            slot = torch.arange(L, device=dev)[None, None, :]  # (1, 1, L)
            last = torch.where(real, first + off, first)  # (c, W) the last slot each query sees
            attend = (slot >= first[:, :, None]) & (slot <= last[:, :, None])  # (c, W, L)
            cache.row_ids, cache.gather, cache.window = torch.tensor(rows, device=dev), True, None
            cache.slots = torch.where(real, first + off, L - 1)  # (c, W)
            with attention_implementation(self.model.config, "gspo_decode"):
                self._forward(ids.to(dev), torch.where(real, off, 0), attend[:, None], cache)
        cache.gather, cache.row_ids = False, b.route_rows

    def _compact(self, b: _Bucket, v: _Bucket, rows: int, live: int) -> _Bucket:
        """Move the ``live`` rows of view ``v`` to its front and return the bucket's first ``rows`` rows, which hold
        them.

        A small model's decode step is bound by its kernels' latency more than by its rows, and with a long tail of
        response lengths most steps have few rows left: on one H100 a step of SmolLM2-135M takes 2.38 ms for 256 rows,
        1.55 for 64 and 1.32 for 8 (``benchmarks/README.md#rollout-throughput``), so the whole bucket's
        step would cost the few live rows nearly twice what a step of their own does. Their per-row state moves
        (``order`` remembers the request row of each); ended rows left behind keep their outputs. The fused step's
        K/V stay where they are (its slots are flat indices into the whole cache, which move with the row), so an ended
        row keeps its cache and can go on in a later turn; the module step's live rows' K/V move to the front over the
        ended rows'. The step then samples its Gumbel noise for fewer rows: the same distribution, another random
        stream."""
        n = v.batch
        move = torch.argsort(v.done.to(torch.uint8), stable=True)  # (n,) live rows first, in their order
        self._permute_rows(v, move)
        if v.fused:  # its slots are flat indices into the bucket's cache: a row's K/V stay where they are
            v.starts[:n] = v.starts[:n][move]
        else:  # the module step attends each row's own cache row: the live rows' K/V move to the front
            row_start = torch.arange(n, device=move.device, dtype=v.starts.dtype) * b.length
            v.starts[:n] = row_start + (v.starts[:n] - row_start)[move]  # each row's first live slot moves with it
            v.cache.take_rows(move[:live])  # an ended row's K/V is never read again
        out = b.view(rows)
        if self._routing is not None:
            self._route_layout = (out.route_rows, out.pos[:, 0])
        return out

    def _collect(self, b: _Bucket, prompts: list[list[int]], n: int, rows: int, params: SamplingParams) -> Rollout:
        at = torch.argsort(b.order)[:rows]  # (N,) the bucket row that holds each request row
        tok = b.out_tok[at].cpu()  # (N, T)
        logp = b.out_logp[at].float().cpu()  # (N, T)
        is_stop = torch.isin(tok, self._stop.cpu())  # (N, T)
        T = tok.shape[1]
        first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1), torch.full((rows,), T))  # (N,)
        lengths = torch.minimum(first_stop + 1, torch.full((rows,), T))  # (N,)
        width = int(lengths.max())
        mask = torch.arange(width)[None, :] < lengths[:, None]  # (N, T')
        tok = torch.where(mask, tok[:, :width], torch.full_like(tok[:, :width], self.pad_id))
        logp = torch.where(mask, logp[:, :width], torch.zeros_like(logp[:, :width]))
        finish = [FINISH_STOP if int(first_stop[i]) < T else FINISH_LENGTH for i in range(rows)]
        texts = self.tokenizer.batch_decode([t[m].tolist() for t, m in zip(tok, mask)], skip_special_tokens=True)
        versions = None
        if self.swaps is not None:  # each output column's version (a swap applies to every row from its column on)
            column = torch.empty(width, dtype=torch.long)
            for j, version in self._swap_log:
                column[j:] = version
            versions = torch.where(mask, column[None, :], -1)
        routes = routes_mask = None
        if self._routing is not None:  # every fed token: the prompt and the completion but its last token
            routes = self._route_buffer[:, at].permute(1, 2, 0, 3).cpu()  # (N, L, Lr, k)
            fed = torch.tensor([len(prompts[i // n]) for i in range(rows)]) + lengths - 1  # (N,)
            routes_mask = torch.arange(routes.shape[1])[None, :] < fed[:, None]  # (N, L)
            self._route_layout = self._route_buffer = None
        return Rollout(prompt_ids=Rollout.repeat_prompts(prompts, n), completion_ids=tok, completion_mask=mask,
                       logprobs=logp, finish_reasons=finish, texts=texts, pad_id=self.pad_id, routes=routes,
                       routes_mask=routes_mask, versions=versions)


class InFlight(Protocol):
    """A source of newer policy weights for in-flight updates (``rollout.in_flight``), which the engine polls between
    decode steps: the ahead feed's is ``gspo.feed.ahead._InFlight``."""

    version: int  # the version of the weights the engine holds
    recompute: bool  # rewrite the live rows' KV cache with new weights (else keep it)

    def poll(self) -> bool:
        """Load a newer published version into the engine (``sync_weights``) if there is one; whether it did."""
        ...


def _offset(turns: TurnEnds, offset: int) -> TurnEnds:
    """``turns`` for a part of a request whose row 0 is the request's row ``offset``."""
    return lambda rows, ids: turns([r + offset for r in rows], ids)
