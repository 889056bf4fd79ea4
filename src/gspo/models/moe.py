"""Mixture-of-Experts: the routers of HF MoE models, Routing Replay (R2) and the expert-volatility metric.

Every MoE family transformers >= 5 ships with a separate top-k router (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) has
``mlp.gate``: a module whose forward maps the flattened hidden states ``(n, H)`` of a layer to
``(router_logits (n, E), gate weights (n, k), expert indices (n, k))``, and the experts consume the weights and indices.
A forward hook on that module sees every routing decision and may replace it; nothing else in the model changes.

Routing Replay (the GSPO paper, section 5.3): the experts a token was routed to under the old policy (R2,
``replay = "old"``: recorded in the old-policy pass) or under the policy that sampled it (R3, ``"rollout"``: recorded
by the rollout engine, then forced in the old-policy pass too) are forced in every update forward of that rollout
batch, so that token-level importance ratios compare the same sub-networks:

    idx_t  = recorded top-k experts of token t (old policy)          (only the discrete choice is forced)
    g_t    = softmax(W_router h_t)            in fp32, the *current* router
    w_t,j  = g_t[idx_t,j] / sum_j' g_t[idx_t,j']   (renormalised where the family renormalises its top-k)

so the router still gets gradients. Tokens without a record (padding, positions outside the recorded pass) route
natively. Records are kept per (row, position) of the rollout batch, not per flattened token, so the update may lay
the rows out differently (other micro-batches, packed or padded) than the pass that recorded them.

Under ``rollout.exact`` (``replay = "exact"``, set by the trainer): the exact pass (gspo.train.exact), which computes
the update's values, writes each token's experts as its records, and the gradient pass -- the ordinary one, whose
rounding would route some tokens elsewhere -- forces them, so the gradient is that of the sub-network the values came
from; ``moe/flip_rate`` then counts the slots the gradient pass would have routed differently.

Expert volatility (``moe/flip_rate``): the fraction of (token, layer, top-k slot) whose recorded old-policy expert is
not among the current policy's top-k experts, on the positions that predict a trained completion token.

Shapes: ``L`` routed layers, ``N`` rows of the rollout batch, ``S`` positions (prompt + completion), ``k`` experts per
token, ``E`` experts, ``n`` tokens in one forward (flattened as the MoE block flattens them).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gspo.errors import UserError

log = logging.getLogger("gspo")

REPLAY_MODES = ("off", "old", "rollout")


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of each MoE layer, in layer order (empty for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Router") and all(hasattr(m, a) for a in ("top_k", "num_experts", "weight"))]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(find_routers(model))


def renormalises(router: torch.nn.Module) -> bool:
    """Whether the family divides the top-k gate weights by their sum (Mixtral always; Qwen-MoE / OLMoE by config)."""
    return bool(getattr(router, "norm_topk_prob", True))


def gate_weights(logits: torch.Tensor, indices: torch.Tensor, like: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """Gate weights ``(n, k)`` of the experts ``indices`` under router logits ``(n, E)``, computed as the family does
    (fp32 softmax over all experts, taken at the chosen ones, renormalised or not, cast to the dtype of ``like``)."""
    top = F.softmax(logits.float(), dim=-1).gather(-1, indices)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(like.dtype)


def plain_top_k(router: torch.nn.Module) -> bool:
    """Whether ``router`` picks the top-k of a softmax over its logits and weighs them by :func:`gate_weights`, checked
    on random hidden states (a router with bias correction, groups or sigmoid scores would need its own formula)."""
    with torch.no_grad():
        h = torch.randn(16, router.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(router.weight)
        logits, scores, idx = router(h)
        top = torch.topk(F.softmax(logits.float(), dim=-1), router.top_k, dim=-1).indices
        return torch.equal(gate_weights(logits, idx, scores, renormalises(router)), scores) and torch.equal(top, idx)


def check_router(router: torch.nn.Module) -> None:
    """The replay recomputes gate weights with :func:`gate_weights`; refuse a router family it does not reproduce
    bit for bit."""
    if not plain_top_k(router):
        raise UserError(f"moe.routing_replay cannot replay {type(router).__name__}: its gate weights are not a softmax "
                        "over the experts taken at the top-k (and renormalised); set moe.routing_replay = 'off'.")


def disable_router_noise(model: torch.nn.Module) -> None:
    """Router jitter off (noise would make the old-policy pass and the update route differently by chance)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "router_jitter_noise", 0.0):
        log.info("router jitter %g set to 0 for RL", config.router_jitter_noise)
        config.router_jitter_noise = 0.0
    for m in model.modules():
        if getattr(m, "jitter_noise", 0.0):
            m.jitter_noise = 0.0


@dataclass
class EngineRecords:
    """What a rollout engine recorded: ``records`` (L, N+1, S, k) (row N takes padding) and ``recorded`` (N+1, S)."""

    records: torch.Tensor
    recorded: torch.Tensor

    def copy_prefill(self, first_row: torch.Tensor) -> None:
        """Row ``i`` takes the records of row ``first_row[i]`` (the samples of a prompt share one prefill)."""
        n = first_row.numel()
        self.records[:, :n] = self.records[:, first_row]
        self.recorded[:n] = self.recorded[first_row]

    def as_routes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(routes (N, S, L, k), routes_mask (N, S))`` on the CPU, for ``Rollout``."""
        return self.records[:, :-1].permute(1, 2, 0, 3).cpu(), self.recorded[:-1].cpu()


@dataclass
class Layout:
    """Where the tokens of one forward sit in the rollout batch: for each of the ``n`` flattened tokens its row
    (``-1`` for padding) and position, and whether it predicts a trained completion token."""

    rows: torch.Tensor  # (n,) int64, -1 = no row
    pos: torch.Tensor  # (n,) int64
    predicts: torch.Tensor  # (n,) bool


class Routing:
    """Hooks on a model's routers: records routing decisions, replays them, measures flips, collects router logits
    for the auxiliary loss. Idle (the hook returns at once) outside :meth:`recording` / :meth:`updating`."""

    def __init__(self, model: torch.nn.Module, replay: str = "off", aux_loss_coef: float = 0.0):
        if replay not in (*REPLAY_MODES, "exact"):  # "exact": rollout.exact's, set by the trainer (not a user value)
            raise UserError(f"moe.routing_replay = {replay!r} is not one of {', '.join(REPLAY_MODES)}.")
        self.routers = find_routers(model)
        if not self.routers:
            raise UserError("moe settings need a Mixture-of-Experts model (one with top-k routers); this one is dense.")
        self.replay = replay
        self.aux_loss_coef = aux_loss_coef
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        if replay == "exact":  # rollout.exact's gradient pass forces the exact pass's routes: its router formula
            odd = [type(r).__name__ for r in self.routers if not plain_top_k(r)]
            if odd:
                raise UserError(f"rollout.exact cannot run router {odd[0]}: it is not a plain softmax top-k router; "
                                "set rollout.exact = false.")
        elif replay != "off":
            for router in self.routers:
                check_router(router)
        self.dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        self.records: torch.Tensor | None = None  # (L, N+1, S, k): row N is where padding tokens write
        self.recorded: torch.Tensor | None = None  # (N+1, S) bool
        self._mode: str | None = None  # None | "record" | "update"
        self._layout: Layout | None = None
        self._flips: torch.Tensor | None = None  # (L,) flipped slots on predicting tokens
        self._slots: torch.Tensor | None = None  # (L,) compared slots
        self._logits: list[torch.Tensor] = []
        self._index = {id(r): i for i, r in enumerate(self.routers)}
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------------------------------ per rollout batch

    def empty_records(self, n_rows: int, max_positions: int, device: torch.device) -> "EngineRecords":
        """Zeroed buffers for ``n_rows`` rows of up to ``max_positions`` positions (and the spare padding row)."""
        shape = (len(self.routers), n_rows + 1, max_positions, self.top_k)
        return EngineRecords(torch.zeros(shape, dtype=self.dtype, device=device),
                             torch.zeros(shape[1:3], dtype=torch.bool, device=device))

    def begin_batch(self, n_rows: int, max_positions: int, device: torch.device) -> None:
        """Forget the previous batch's records; room for ``n_rows`` rows of up to ``max_positions`` positions."""
        shape = (len(self.routers), n_rows + 1, max_positions, self.top_k)
        if self.records is None or self.records.shape != shape or self.records.device != device:
            fresh = self.empty_records(n_rows, max_positions, device)
            self.records, self.recorded = fresh.records, fresh.recorded
        else:
            self.recorded.zero_()

    def record_bytes(self) -> int:
        return 0 if self.records is None else self.records.numel() * self.records.element_size()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Forwards inside record each token's top-k experts (the old-policy pass; routing itself is untouched)."""
        self._mode = "record"
        try:
            yield
        finally:
            self._mode, self._layout = None, None

    @contextlib.contextmanager
    def engine_recording(self, n_rows: int, max_positions: int, device: torch.device) -> Iterator["EngineRecords"]:
        """Forwards inside (a rollout engine sampling with this model) record into a fresh buffer, returned as
        ``EngineRecords``; the batch's records are left alone."""
        out = self.empty_records(n_rows, max_positions, device)
        saved = self.records, self.recorded
        self.records, self.recorded = out.records, out.recorded
        self._mode = "record"
        try:
            yield out
        finally:
            self._mode, self._layout = None, None
            self.records, self.recorded = saved

    def load_rollout_routes(self, routes: torch.Tensor, routes_mask: torch.Tensor) -> None:
        """Take the engine's records of a rollout batch (``Rollout.routes`` (N, S, L, k), ``routes_mask`` (N, S)) as
        the batch's records, after :meth:`begin_batch`."""
        n, width = routes_mask.shape
        width = min(width, self.records.shape[2])
        self.records[:, :n, :width] = routes[:, :width].permute(2, 0, 1, 3).to(self.records.device, self.dtype)
        self.recorded[:n, :width] = routes_mask[:, :width].to(self.recorded.device)

    def write_records(self, rows: torch.Tensor, pos: torch.Tensor, experts: list[torch.Tensor]) -> None:
        """Take ``experts`` (one (n, k) per routed layer) as the records of tokens at batch ``rows`` / ``pos`` (n,):
        rollout.exact's pass, whose routes its update's gradient pass forces (``replay = "exact"``)."""
        if self.records is None:
            return
        real = pos < self.records.shape[2]
        rows, pos = rows[real], pos[real]
        for layer, idx in enumerate(experts):
            self.records[layer, rows, pos] = idx[real].to(self.dtype)
        self.recorded[rows, pos] = True

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Forwards inside replay the records (``replay = 'old'``) or only compare with them, counting flips, and
        collect router logits for the auxiliary loss."""
        self._mode = "update"
        L = len(self.routers)
        dev = self.records.device if self.records is not None else self.routers[0].weight.device
        self._flips = torch.zeros(L, dtype=torch.float64, device=dev)
        self._slots = torch.zeros(L, dtype=torch.float64, device=dev)
        try:
            yield
        finally:
            self._mode, self._layout = None, None

    def set_layout(self, layout: Layout) -> None:
        """Called by the log-prob pass before its decoder forward (see ``gspo.train.passes.sequence_logprobs``)."""
        self._layout = layout if self._mode is not None else None

    # ------------------------------------------------------------------------------------------ results

    def flip_metrics(self) -> dict[str, torch.Tensor]:
        """``moe/flip_rate`` and ``moe/flip_rate/layer_<i>`` of the forwards since :meth:`updating` began (0-dim
        tensors; NaN where nothing was compared)."""
        if self._flips is None:
            return {}
        rate = self._flips / self._slots  # NaN where no slot
        out = {"moe/flip_rate": self._flips.sum() / self._slots.sum()}
        out.update({f"moe/flip_rate/layer_{i}": rate[i] for i in range(len(self.routers))})
        return out

    def sum_counts(self, total) -> None:
        """Replace the flip counts by ``total(counts)``: their sums over the processes of a job, each of which counted
        its own rows (so the rate is that of the whole batch, not a mean of rates)."""
        if self._flips is not None:
            self._flips, self._slots = total(self._flips), total(self._slots)

    def aux_loss(self) -> torch.Tensor | None:
        """The Switch-Transformer load-balancing loss over the real tokens of the forward since the last call (None
        when the coefficient is 0), times the coefficient: transformers' own implementation of it."""
        collected, self._logits = self._logits, []
        if not self.aux_loss_coef or not collected:
            return None
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        logits = tuple(lg for lg, _ in collected)  # one (n, E) per layer, same n
        mask = collected[0][1][None].long()  # (1, n)
        return self.aux_loss_coef * load_balancing_loss_func(logits, self.num_experts, self.top_k, mask)

    # ------------------------------------------------------------------------------------------ the hook

    def _hook(self, router, args, output):
        if self._mode is None:
            return None
        layout = self._layout
        logits, scores, idx = output  # (n, E), (n, k), (n, k)
        in_backward = torch._C._current_graph_task_id() != -1  # a checkpointed layer recomputed: seen already
        if self._mode == "update" and self.aux_loss_coef and torch.is_grad_enabled() and not in_backward:
            real = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device) if layout is None else layout.rows >= 0
            self._logits.append((logits, real))
        if layout is None or self.records is None or layout.rows.numel() != idx.shape[0]:
            return None
        layer = self._index[id(router)]
        n_rows, width = self.records.shape[1] - 1, self.records.shape[2]
        real = (layout.rows >= 0) & (layout.pos >= 0) & (layout.pos < width)  # a position past the records: none
        rows = torch.where(real, layout.rows, n_rows)  # padding writes to (and reads from) the spare row
        pos = torch.where(real, layout.pos, 0)
        if self._mode == "record":
            self.records[layer, rows, pos] = idx.to(self.dtype)
            self.recorded[rows, pos] = True
            return None
        has = self.recorded[rows, pos] & real  # (n,)
        old = self.records[layer, rows, pos].long()  # (n, k)
        if not in_backward:
            counted = (has & layout.predicts).to(torch.float64)  # (n,)
            missing = (old[:, :, None] != idx[:, None, :]).all(-1).sum(-1)  # (n,) old experts not in the current top-k
            self._flips[layer] += (missing * counted).sum()
            self._slots[layer] += counted.sum() * idx.shape[1]
        if self.replay == "off":
            return None
        forced = torch.where(has[:, None], old, idx)
        return logits, gate_weights(logits, forced, scores, renormalises(router)), forced


def packed_layout(seq_lens: list[int], positions: torch.Tensor, predict_at: torch.Tensor,
                  row_ids: torch.Tensor) -> Layout:
    """Layout of one packed row: sequence ``i`` (batch row ``row_ids[i]``) fills ``seq_lens[i]`` consecutive tokens
    at ``positions``; ``predict_at`` are the flat indices of the tokens that predict a completion token."""
    dev = positions.device
    rows = torch.repeat_interleave(row_ids.to(dev), torch.tensor(seq_lens, device=dev))
    predicts = torch.zeros(rows.numel(), dtype=torch.bool, device=dev)
    predicts[predict_at] = True
    return Layout(rows, positions.reshape(-1), predicts)


def padded_layout(attention_mask: torch.Tensor, positions: torch.Tensor, predicts: torch.Tensor,
                  row_ids: torch.Tensor) -> Layout:
    """Layout of a padded ``(N, P+T)`` batch: local row ``i`` is batch row ``row_ids[i]``; padding has no row."""
    rows = row_ids.to(attention_mask.device)[:, None].expand_as(attention_mask)
    rows = torch.where(attention_mask.bool(), rows, -1)
    return Layout(rows.reshape(-1), positions.reshape(-1), predicts.reshape(-1))
