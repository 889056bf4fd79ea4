"""The trainer's side of ``rollout.exact``: log-probs computed by the very forward the graph engine samples with.

The engine's decode step, its prefill and this pass are one function (:meth:`gspo.kernels.fused.FusedDecoder.
forward_tokens`) whose kernels are batch-invariant (:mod:`gspo.kernels.exact_kernels`): for the same weights and tokens
the trainer's log-prob of a token is the engine's, bit for bit, whatever the batch, the lengths or the row compaction.
So ``train.old_logprobs = "rollout"`` is exact (no recompute pass), and the first update's ratio is exactly 1.

The pass keeps its own low-precision copy of the policy's weights (:class:`gspo.rollout.graph.EngineWeights`, the
engine's class: the same rounding of fp32 masters to bf16), refreshed from the policy when they changed.

Gradients: the update needs d log pi / d theta. For a dense model this pass is differentiable: each exact kernel has a
backward (:mod:`gspo.kernels.exact_grad`: torch matmuls, fused Triton kernels, flash attention's), captured with its
forward as one CUDA graph per bucket, and the update runs this one forward. An MoE model's update, and any update under
``model.gradient_checkpointing`` (this pass keeps every layer's activations), takes the exact values with the gradient
of the ordinary (packed) pass at the same weights (:func:`with_gradient_of`): the two functions differ by rounding
only, so this is the gradient any bf16 trainer computes, at the cost of a second forward.

Shapes: ``N`` rows, ``T`` completion positions, ``S`` packed tokens, ``M`` completion tokens.
"""
from __future__ import annotations

import torch

from gspo.models import head_dim, kv_heads, named_weights
from gspo.runtime import free_gpu_bytes, to_device


class _ExactValue(torch.autograd.Function):
    """Forward: the exact values; backward: the gradient goes to the differentiable tensor, unchanged."""

    @staticmethod
    def forward(ctx, exact: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


def with_gradient_of(exact: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
    """``exact``'s values (bit for bit) with ``differentiable``'s gradient (same shape)."""
    return _ExactValue.apply(exact.detach(), differentiable)


class ExactPass:
    """Log-probs of completions by ``rollout.exact``'s forward over one packed row, on a copy of ``model``'s weights in
    ``dtype`` (the engine's: the autocast dtype, else the weights').

    On a GPU the decoder part is a CUDA graph per shape bucket, as the ordinary pass's (:class:`gspo.train.passes.
    PackedGraphs`): the packed row is padded with one dummy sequence to a bucket of tokens, the tile table with empty
    tiles to a bucket of tiles. A forward of a 30-layer model is ~240 Triton launches, each tens of microseconds of
    Python: without the graph the host, not the GPU, sets its time. The padding changes no real token's numbers
    (attention never leaves a sequence; every kernel is batch-invariant)."""

    MAX_GRAPHS = 8

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, chunk_size: int = 1024,
                 use_graphs: bool | None = None, own_backward: bool = True):
        from gspo.errors import UserError
        from gspo.kernels.fused import FusedDecoder, exact_unsupported, fused_unsupported
        from gspo.rollout.graph import EngineWeights

        why_not = exact_unsupported(model, fused_unsupported(model))
        if why_not is not None:
            raise UserError(f"rollout.exact cannot run this model: {why_not}; set rollout.exact = false.")
        self.source = model
        self.weights = EngineWeights(model, dtype, device)
        self.decoder = FusedDecoder(self.weights.model, dtype, device, exact=True)
        self.weights.give_storage(self.decoder.copies())
        self.weights.index()
        self.device = device
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.groups = kv_heads(model.config)
        self.width = head_dim(model.config)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.graphs: dict[tuple[int, int], tuple] = {}  # (tokens, tiles) -> (graph, static inputs, output)
        self.pool = None
        self.warmup_s = 0.0
        self.version: int | None = None  # the policy's weights_version the copy holds (None: unknown)
        # dense models: the update differentiates the exact forward itself (gspo.kernels.exact_grad); MoE, or with
        # own_backward off (activation checkpointing): the values of this pass with the ordinary pass's gradient
        # (with_gradient_of, in the actor)
        self.differentiable = own_backward and all(layer.moe is None for layer in self.decoder.layers)
        # (tokens, tiles, sequences + 2) -> the graphed update forward; None: off after a failed capture
        self.grad_graphs: dict[tuple[int, int, int], torch.nn.Module] | None = {}
        self._module = None
        self.grad_pool = None
        self.grad_bytes_per_token = 0.0  # GPU memory a captured update graph keeps per bucket token (measured)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (S, H) of the packed row ``ids`` (device tensors; ``table``: (4, tiles))."""
        S = ids.shape[0]
        k = torch.empty(S, self.groups, self.width, dtype=self.dtype, device=ids.device)  # every layer's K/V, in turn
        v = torch.empty_like(k)
        layers = len(self.decoder.layers)
        return self.decoder.forward_tokens(ids, pos, [k] * layers, [v] * layers, torch.arange(S, device=ids.device),
                                          tuple(table.unbind(0)))

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, seq_lens: list[int],
                starts: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(S, H) for the packed row (CPU ``ids`` / ``pos``), and each MoE layer's experts (S, k): a graph replay when
        its bucket is captured or fits."""
        from gspo.kernels.exact_kernels import tile_table

        dev, S = self.device, ids.shape[0]
        G = self.decoder.heads // self.decoder.kv_heads

        def eager():  # unpadded
            out = self._forward(to_device(ids, dev), to_device(pos, dev), to_device(tile_table(seq_lens, starts, G), dev))
            return out, self.decoder.routes

        if not self.use_graphs:
            return eager()
        key, inputs = self._bucketed(ids, pos, seq_lens, starts, S)
        if key not in self.graphs and len(self.graphs) >= self.MAX_GRAPHS:
            return eager()
        if key not in self.graphs:
            self._capture(key, inputs)
        graph, static, out, routes = self.graphs[key]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return out[:S], [r[:S] for r in routes]

    def _bucketed(self, ids: torch.Tensor, pos: torch.Tensor, seq_lens: list[int], starts: list[int],
                  at_least: int) -> tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A graph's shape key (tokens, tiles) and its CPU inputs (ids, pos, tile table): the packed row padded with one
        dummy sequence to the bucket of ``at_least + 1`` tokens (at least one dummy token, so that sequence is never
        empty), the tile table with empty tiles to a bucket of tiles."""
        from gspo.kernels.exact_kernels import tile_table
        from gspo.train.passes import PackedGraphs

        S = ids.shape[0]
        size = PackedGraphs.bucket(at_least + 1)
        pad = size - S
        table = tile_table([*seq_lens, pad], [*starts, S], self.decoder.heads // self.decoder.kv_heads)
        tiles = PackedGraphs.bucket(table.shape[1])
        return (size, tiles), (torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, torch.arange(pad)]),
                               torch.cat([table, table.new_zeros(4, tiles - table.shape[1])], 1))

    def _capture(self, key: tuple[int, int], inputs: tuple) -> None:
        import time

        from gspo.runtime import CAPTURE_LOCK

        t0 = time.perf_counter()
        static = tuple(x.to(self.device) for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(*static)  # compiles the kernels' variants for these shapes outside the capture
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(*static)
        self.graphs[key] = (graph, static, out, self.decoder.routes)  # the routes: outputs of the graph too
        self.warmup_s += time.perf_counter() - t0

    def _hidden_grad(self, ids: torch.Tensor, pos: torch.Tensor, seq_lens: list[int], starts: list[int],
                     at_least: int = 0, use_graphs: bool = True) -> torch.Tensor:
        """:meth:`_hidden`'s values (bit for bit), differentiable with respect to the policy's parameters: one CUDA
        graph of forward and backward per bucket (``make_graphed_callables``, as :class:`gspo.train.passes.
        PackedGraphs`), eager past ``MAX_GRAPHS`` shapes or what fits in memory, without graphs, or (with a warning)
        after a failed capture, or with ``use_graphs`` False (a pass not worth a graph per shape). ``at_least``: the
        packed length to pad to at least (:meth:`PackedGraphs.hidden`'s)."""
        from gspo.kernels.exact_grad import DifferentiableExact
        from gspo.kernels.exact_kernels import tile_table
        from gspo.train.passes import allocate_grads, capture_graphed, graph_fits

        dev, S = self.device, ids.shape[0]
        cu = torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        key = None
        # fp32 on CUDA stays eager: flash attention (the backward's) has no fp32 kernel, and SDPA per sequence syncs
        graphs = (use_graphs and self.use_graphs and self.grad_graphs is not None
                  and self.dtype in (torch.float16, torch.bfloat16))
        if graphs:
            (size, tiles), padded = self._bucketed(ids, pos, seq_lens, starts, max(S, at_least))
            key = (size, tiles, cu.numel() + 1)
            # as PackedGraphs: each graph keeps its activations for the run; capture only while that fits
            if key not in self.grad_graphs and not graph_fits(size, len(self.grad_graphs), self.MAX_GRAPHS, 65536,
                                                              self.grad_bytes_per_token, free_gpu_bytes(dev)):
                key = None
        if key is None:
            if self._module is None:
                self._module = DifferentiableExact(self.source, self.decoder)
            self._module.max_len = max(seq_lens)
            G = self.decoder.heads // self.decoder.kv_heads
            return self._module(*(to_device(t, dev) for t in (ids, pos, tile_table(seq_lens, starts, G), cu)))
        inputs = tuple(to_device(t, dev) for t in (*padded, torch.cat([cu, cu.new_full((1,), size)])))
        allocate_grads(p for p in self.source.get_decoder().parameters() if p.requires_grad)
        if key not in self.grad_graphs:
            if self.grad_pool is None:
                self.grad_pool = torch.cuda.graph_pool_handle()
            # make_graphed_callables replaces the module's forward: one module per graph
            graphed, per_token, seconds = capture_graphed(lambda: DifferentiableExact(self.source, self.decoder, size),
                                                          inputs, self.grad_pool, "of the exact update")
            self.warmup_s += seconds
            if graphed is None:
                self.grad_graphs = None
                return self._hidden_grad(ids, pos, seq_lens, starts)  # eager: graphs are off now
            self.grad_graphs[key] = graphed
            self.grad_bytes_per_token = max(self.grad_bytes_per_token, per_token)
        return self.grad_graphs[key](*inputs)[:S]

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                 temperature: float = 1.0, with_entropy: bool = False, routing=None, row_ids: torch.Tensor | None = None,
                 version: int | None = None, pack_tokens: int = 0,
                 graphs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``(N, T)`` float32 under softmax(logits / temperature) of the current weights (0 where the mask
        is False), and the entropies ``(N, T)`` with ``with_entropy``. Completion tokens must be a prefix of each row.
        Under grad (the update) with a dense model the log-probs are differentiable with respect to the policy's
        parameters (:mod:`gspo.kernels.exact_grad`), the same numbers; the entropies never are. ``routing`` (an MoE
        policy's :class:`gspo.models.moe.Routing`): every token's experts here become its records,
        at batch rows ``row_ids`` (default 0..N-1), for the gradient pass to force. ``version``: the policy's
        :attr:`gspo.parallel.holding.Holding.weights_version`; the copy is refreshed only when it changed (None:
        always), so the micro-batches of one minibatch and of a frozen pass copy the weights once. ``pack_tokens``:
        the update's graph pads to at least this many tokens (as the ordinary pass's, :meth:`gspo.parallel.plan.Plan.
        pack_hint`); ``graphs`` False: the update's pass runs eager."""
        from gspo.kernels.exact_grad import head_logprobs

        grad = torch.is_grad_enabled() and self.differentiable
        if version is None or version != self.version:
            with torch.no_grad():
                self.weights.load(named_weights(self.source))
            self.version = version
        dev = self.device
        mask = completion_mask.cpu().bool()
        ids_cpu = completion_ids.cpu()
        lengths = mask.sum(-1).tolist()
        seq_lens = [len(p) + n for p, n in zip(prompt_ids, lengths)]
        ids = torch.tensor([t for p, c, n in zip(prompt_ids, ids_cpu.tolist(), lengths) for t in (*p, *c[:n])],
                           dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in seq_lens])
        starts = torch.tensor([0, *seq_lens]).cumsum(0)[:-1]  # (N,) each sequence's first packed token
        first = starts + torch.tensor([len(p) for p in prompt_ids]) - 1  # the position that predicts token 0
        at = (first[:, None] + torch.arange(mask.shape[1])[None, :])[mask]  # (M,) row-major
        targets = to_device(ids_cpu[mask], dev)  # (M,)
        flat = to_device(mask.reshape(-1).nonzero().squeeze(-1), dev)
        with torch.set_grad_enabled(grad):
            if grad:
                hidden = self._hidden_grad(ids, pos, seq_lens, starts.tolist(), pack_tokens, graphs)
            else:
                hidden, routes = self._hidden(ids, pos, seq_lens, starts.tolist())
                if routing is not None and routes:
                    rows = torch.arange(len(seq_lens)) if row_ids is None else row_ids.cpu()
                    routing.write_records(to_device(torch.repeat_interleave(rows, torch.tensor(seq_lens)), dev),
                                          to_device(pos, dev), routes)
            head = self.source.get_output_embeddings()
            masters = (head.weight,) + (() if head.bias is None else (head.bias,))
            logp, entropy = head_logprobs(hidden.index_select(0, to_device(at, dev)), targets, self.decoder,
                                          temperature, self.chunk_size, with_entropy, masters)
            out = torch.zeros(mask.numel(), dtype=torch.float32, device=dev)
            ent_full = out.detach().index_copy(0, flat, entropy).view(mask.shape) if with_entropy else None
            return out.index_copy(0, flat, logp).view(mask.shape), ent_full
