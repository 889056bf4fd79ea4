"""The embedded rollout engine: sampling with the trainer's own Hugging Face model, no weight copies.

Shapes: ``B`` unique prompts, ``n`` samples per prompt, ``N = B * n`` rows, ``P`` padded prompt length,
``T`` generated positions, ``V`` vocabulary.

One generate call:

1. prefill the ``B`` unique prompts once (left-padded; ``position_ids = cumsum(mask) - 1`` so padding does not
   shift positions) and repeat their KV cache ``n`` times along the batch, so the ``n`` samples share a prefill;
2. decode one token per step for all ``N`` rows, sampling in float32 from ``softmax(logits / temperature)``
   (optionally truncated by top-k then top-p); the recorded log-probability is that of the untruncated tempered
   distribution, the quantity the trainer recomputes (greedy decoding records temperature-1 log-probabilities);
3. a row ends on a stop token (kept, finish reason ``stop``) or after ``max_new_tokens`` (``length``); ended rows
   emit padding and the loop exits once every row has ended.

The model object is shared with the trainer, so an optimizer step is visible to the next call (its
``sync_weights`` has nothing to do). Prefill and decode
step are separate methods so that a static-cache / CUDA-graph variant can replace them one at a time.
"""
from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from gspo.errors import UserError
from gspo.models import (attention_context, autocast_context, cache_kwarg, eval_mode, pad_prompts, pad_token_id,
                         positions_from_mask, stop_token_ids)
from gspo.models.moe import Layout, Routing, padded_layout
from gspo.rollout.turns import TurnRows
from gspo.types import FINISH_LENGTH, FINISH_STOP, Rollout, SamplingParams, TurnEnds


def filter_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered logits with top-k, then top-p (nucleus), applied: removed tokens get -inf.  (N, V)"""
    filtered = scaled
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]  # (N, 1)
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(-1)  # (N, V)
        # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it already does.
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p  # (N, V)
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (N, V) back in vocabulary order
        filtered = filtered.masked_fill(drop, float("-inf"))
    return filtered


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``(N,)`` and their log-probabilities ``(N,)`` under the untruncated tempered distribution."""
    logits = logits.float()  # (N, V)
    if params.greedy:
        tokens = logits.argmax(-1)  # (N,)
        logp = F.log_softmax(logits, -1)  # (N, V)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature  # (N, V)
    logp = F.log_softmax(scaled, -1)  # (N, V)
    filtered = filter_logits(scaled, params)
    tokens = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)  # (N,)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def check_request(model, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
    """Refuse a generate() request an engine cannot serve, with a message naming the fix."""
    if not prompts:
        raise UserError("generate() got no prompts: pass at least one list of token ids.")
    if any(len(p) == 0 for p in prompts):
        raise UserError("generate() got an empty prompt: every prompt needs at least one token (apply the chat "
                        "template first).")
    if n < 1:
        raise UserError(f"generate() got n={n} samples per prompt: use n >= 1.")
    if params.max_new_tokens < 1:
        raise UserError(f"SamplingParams.max_new_tokens={params.max_new_tokens}: use a value >= 1.")
    if not params.greedy and not params.temperature > 0:
        raise UserError(f"SamplingParams.temperature={params.temperature}: use a value > 0, or greedy=True.")
    if not 0 < params.top_p <= 1:
        raise UserError(f"SamplingParams.top_p={params.top_p}: use a value in (0, 1].")
    if params.top_k < 0:
        raise UserError(f"SamplingParams.top_k={params.top_k}: use 0 (off) or a positive number.")
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + params.max_new_tokens > limit:
        raise UserError(f"A prompt of {longest} tokens plus max_new_tokens={params.max_new_tokens} exceeds the "
                        f"model's context of {limit} positions: shorten the prompts or lower max_new_tokens.")


class HFEngine:
    """Samples completions from a Hugging Face causal LM, sharing the model object (and its weights) in place.

    ``routing`` (an MoE policy's :class:`gspo.models.moe.Routing`, for ``moe.routing_replay = "rollout"``, R3): each
    generate call records every fed token's experts by (row, position) into ``Rollout.routes``, through the hooks the
    routing has on the model it samples from (so not from a ``replica``, whose copy has none)."""

    records_routing = True
    takes_weights_in_flight = False  # its weights are the trainer's model's, or a copy loaded between batches

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_ids: list[int] | None = None,
        device: str | torch.device | None = None,
        autocast_dtype: torch.dtype | None = None,
        replica: bool = False,
        routing: Routing | None = None,
    ):
        if replica:  # its own copy, for a policy sharded across processes (sync_weights fills it)
            model = copy.deepcopy(model).eval().requires_grad_(False)
            for module in model.modules():
                module._forward_hooks.clear()  # the trainer's hooks (MoE routing) belong to the trainer's modules
                module._forward_pre_hooks.clear()
        self.replica = replica
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
        if not self.stop_ids:
            raise UserError("The tokenizer has no EOS or end-of-turn token: pass stop_ids=[...] to HFEngine.")
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        self._keeps_last_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_arg = cache_kwarg(model.forward)
        self.routing = routing
        self._recording = None

    @torch.no_grad()
    def sync_weights(self, weights) -> None:
        """Nothing to do when this engine samples from the model object it was given, the trainer's own: an optimizer
        step is visible at once (``weights`` is not read). Its own copy (``replica=True``) takes every ``(name,
        tensor)`` in place, one at a time."""
        if not self.replica:
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            if name not in params:
                raise UserError(f"sync_weights got a weight named {name!r} but the engine's model has no such "
                                "parameter; pass the policy's named parameters (gspo.models.named_weights(model)).")
            params[name].copy_(tensor)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        turns: TurnEnds | None = None,
    ) -> Rollout:
        """``n`` completions of each prompt (token ids, chat template applied); row ``i`` is for prompt ``i // n``.

        ``turns`` (multi-turn, :mod:`gspo.envs`): called whenever every row still going has ended its turn; a row's
        turn ends on a stop token, and ``turns`` says for each such row the ids to append (then the row goes on in its
        own KV cache, the appended ids fed in one forward) or ``None`` (the row is finished)."""
        if turns is not None:
            check_request(self.model, prompts, n, params)
            with eval_mode(self.model), torch.no_grad(), self._autocast(), attention_context():
                if self.routing is None:
                    return self._multi_turn(prompts, n, params, generator, turns)
                # R3: every fed token is recorded, appended ones included (the trainer feeds them too)
                width = max(len(p) for p in prompts) + params.max_new_tokens
                with self.routing.engine_recording(len(prompts) * n, width, self.device) as self._recording:
                    rollout = self._multi_turn(prompts, n, params, generator, turns)
                rollout.routes, rollout.routes_mask = self._recording.as_routes()
                self._recording = None
                return rollout
        check_request(self.model, prompts, n, params)
        if generator is not None and generator.device.type != self.device.type:
            raise UserError(f"generate() got a torch.Generator on {generator.device} for a model on {self.device}: "
                            f"create it with torch.Generator(device={str(self.device)!r}).")
        routes = routes_mask = None
        with eval_mode(self.model), torch.no_grad(), self._autocast(), attention_context():
            if self.routing is None:
                tokens, mask, logprobs, stopped = self._generate(prompts, n, params, generator)
            else:
                width = max(len(p) for p in prompts) + params.max_new_tokens
                with self.routing.engine_recording(len(prompts) * n, width, self.device) as self._recording:
                    tokens, mask, logprobs, stopped = self._generate(prompts, n, params, generator)
                routes, routes_mask = self._recording.as_routes()
                self._recording = None
        tokens, mask, logprobs = tokens.cpu(), mask.cpu(), logprobs.cpu()
        return Rollout(
            routes=routes,
            routes_mask=routes_mask,
            prompt_ids=Rollout.repeat_prompts(prompts, n),
            completion_ids=tokens,
            completion_mask=mask,
            logprobs=logprobs,
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()],
            texts=self.tokenizer.batch_decode(
                [row[m].tolist() for row, m in zip(tokens, mask)], skip_special_tokens=True
            ),
            pad_id=self.pad_id,
        )

    # --- steps --------------------------------------------------------------------------------------------------

    def _generate(self, prompts, n, params, generator):
        logits, cache, attention_mask, positions = self._prefill(prompts, n)
        rows = logits.shape[0]
        stop_ids = torch.tensor(self.stop_ids, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)  # (N,)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)  # (N,)
        out_tokens, out_mask, out_logp = [], [], []
        for step in range(params.max_new_tokens):
            tokens, logp = sample_next(logits, params, generator)  # (N,), (N,)
            alive = ~done  # (N,)
            tokens = torch.where(alive, tokens, self.pad_id)  # (N,)
            out_tokens.append(tokens)
            out_mask.append(alive)
            out_logp.append(torch.where(alive, logp, 0.0))
            hit = alive & torch.isin(tokens, stop_ids)  # (N,)
            stopped |= hit
            done |= hit
            if step + 1 == params.max_new_tokens or bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], -1)  # (N, P + t)
            positions = positions + 1  # (N, 1)
            self._record_at(alive[:, None], positions)  # the token fed now sits at `positions`; ended rows feed padding
            logits = self._decode_step(tokens, cache, attention_mask, positions)
        # The loop stops at the first step after which all rows ended, so T is already the longest completion.
        return (
            torch.stack(out_tokens, 1),  # (N, T)
            torch.stack(out_mask, 1),  # (N, T)
            torch.stack(out_logp, 1).float(),  # (N, T)
            stopped,
        )

    def _multi_turn(self, prompts, n, params, generator, turns: TurnEnds) -> Rollout:
        """Rows of several turns. Each decode step is the single-turn loop's (the same tokens fed, the same attention
        mask, the same draws from ``generator``), so rows that end after one turn are the single-turn rollout bit for
        bit. A row waiting for the others to end their turn is fed padding, as an ended row is; before it goes on, the
        columns it was fed padding in are masked out and its positions continue from its last real token."""
        logits, cache, attention_mask, positions = self._prefill(prompts, n)
        rows = logits.shape[0]
        real = attention_mask.bool()  # (N, P + t): the columns each row really holds
        next_pos = positions[:, 0] + 1  # (N,): where each row's next real token goes
        stop_ids = torch.tensor(self.stop_ids, device=self.device)
        book = TurnRows(rows, params, turns, self.stop_ids)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)  # (N,): finished for good
        while True:
            waiting = torch.zeros(rows, dtype=torch.bool, device=self.device)  # (N,): turn ended, not yet answered
            cut = torch.zeros(rows, dtype=torch.bool, device=self.device)  # (N,): out of tokens, turn or row
            room = torch.tensor([book.room(r) for r in range(rows)], device=self.device)
            count = torch.zeros(rows, dtype=torch.long, device=self.device)
            turn_tok: list[torch.Tensor] = []
            turn_logp: list[torch.Tensor] = []
            turn_alive: list[torch.Tensor] = []
            while True:
                tokens, logp = sample_next(logits, params, generator)  # (N,), (N,)
                alive = ~(done | waiting | cut)  # (N,)
                tokens = torch.where(alive, tokens, self.pad_id)
                turn_tok.append(tokens)
                turn_logp.append(torch.where(alive, logp, 0.0))
                turn_alive.append(alive)
                hit = alive & torch.isin(tokens, stop_ids)
                waiting |= hit
                count += alive.long()
                cut |= alive & ~hit & (count >= room)
                if bool((done | waiting | cut).all()):
                    break
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], -1)  # (N, P + t)
                real = torch.cat([real, alive[:, None]], -1)  # the token fed now is real where it was sampled
                positions = positions + 1  # (N, 1)
                next_pos = next_pos + alive.long()
                self._record_at(alive[:, None], positions)
                logits = self._decode_step(tokens, cache, attention_mask, positions)
            tok, al = torch.stack(turn_tok, 1).cpu(), torch.stack(turn_alive, 1).cpu()  # (N, S) each
            lp = torch.stack(turn_logp, 1).float().cpu()
            ended = [r for r in range(rows) if not done[r] and book.sampled(r, tok[r][al[r]].tolist(),
                                                                          lp[r][al[r]].tolist())]
            # the last token sampled in the segment has not been fed yet: it is, in the extension (or never)
            going = book.answer(ended)
            done |= torch.tensor([r not in going for r in range(rows)], device=self.device)
            if not going:
                break
            # A turn that ended before the segment's last step had its stop token fed with the others' next tokens;
            # one that ended on the last step (`hit`) has not: it goes in first with the appended ids.
            chunks = {r: ([book.stop_token(r)] if hit[r] else []) + ids for r, ids in going.items()}
            logits, attention_mask, real, positions, next_pos = self._extend(
                chunks, cache, attention_mask, real, next_pos)
        return book.rollout(self.tokenizer, self.pad_id, prompts, n)

    def _extend(self, chunks, cache, attention_mask, real, next_pos):
        """Feed each continuing row its ids ``chunks[r]`` in one forward (right-aligned, padding on the left masked
        out); the other rows get masked padding. Returns the next logits and the updated state."""
        rows = attention_mask.shape[0]
        width = max(len(c) for c in chunks.values())
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        fed = torch.zeros((rows, width), dtype=torch.bool)
        for r, c in chunks.items():
            ids[r, width - len(c):] = torch.tensor(c)
            fed[r, width - len(c):] = True
        ids, fed = ids.to(self.device), fed.to(self.device)
        start = next_pos[:, None] - (width - fed.sum(-1, keepdim=True))  # (N, 1): real tokens continue at next_pos
        pos = (start + torch.arange(width, device=self.device)[None, :]).clamp(min=0)  # (N, width)
        self._record_at(fed, pos)
        real = torch.cat([real, fed], -1)
        attention_mask = real.long()  # padding columns out: rows that waited never attend to what they were fed
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=pos, use_cache=True,
                         **{self._cache_arg: cache})
        positions = pos[:, -1:]
        return out.logits[:, -1].float(), attention_mask, real, positions, next_pos + fed.sum(-1)

    def _prefill(self, prompts, n):
        """Run the unique prompts once and repeat their cache ``n`` times; returns the logits of the first token."""
        input_ids, attention_mask = pad_prompts(prompts, self.pad_id)  # (B, P)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        positions = positions_from_mask(attention_mask)  # (B, P)
        cache = DynamicCache(config=self.model.config)
        extra = {"logits_to_keep": 1} if self._keeps_last_logits else {}
        if self._recording is not None:  # prompt b is recorded as its first sample's row, then copied to the others
            first = torch.arange(input_ids.shape[0], device=self.device) * n  # (B,)
            no_loss = torch.zeros_like(attention_mask, dtype=torch.bool)
            self.routing.set_layout(padded_layout(attention_mask, positions, no_loss, first))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
            **extra,
        )
        if self._recording is not None:
            self._recording.copy_prefill(torch.arange(input_ids.shape[0] * n, device=self.device) // n * n)
        if n > 1:
            cache.batch_repeat_interleave(n)  # the n samples of a prompt share its prefill
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (N, V)
        attention_mask = attention_mask.repeat_interleave(n, 0)  # (N, P)
        next_positions = positions[:, -1:].repeat_interleave(n, 0)  # (N, 1)
        return logits, cache, attention_mask, next_positions

    def _decode_step(self, tokens, cache, attention_mask, positions):
        """Feed one token per row; returns the logits ``(N, V)`` of the next one."""
        out = self.model(
            input_ids=tokens[:, None],  # (N, 1)
            attention_mask=attention_mask,  # (N, P + t)
            position_ids=positions,  # (N, 1)
            use_cache=True,
            **{self._cache_arg: cache},
        )
        return out.logits[:, -1].float()  # (N, V)

    def _record_at(self, fed: torch.Tensor, positions: torch.Tensor) -> None:
        """R3: the next forward's tokens are recorded at ``positions`` (N, S) of their rows where ``fed`` (N, S)."""
        if self._recording is None:
            return
        rows = torch.arange(fed.shape[0], device=self.device)[:, None].expand_as(fed)
        self.routing.set_layout(Layout(torch.where(fed, rows, -1).reshape(-1), positions.reshape(-1),
                                       torch.zeros_like(fed).reshape(-1)))

    def _autocast(self):
        return autocast_context(self.device, self.autocast_dtype)

