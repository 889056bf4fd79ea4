"""The training loop, and nothing else: it sequences the stages that live in their own modules.

One rollout batch per iteration:
  1. P prompts x G completions from the embedded engine (the trainer's own model, new weights every time)
  2. rewards in isolated workers (failures -> NaN -> left out of the group baseline)
  3. [DAPO] soft overlong punishment; dynamic sampling drops zero-variance groups and refills
  4. group-relative advantages
  5. old-policy log-probs: recomputed by the trainer (default; minibatch 0 takes its own update forward's, so its
     ratio is exactly 1) or the engine's own (``old_logprobs = "rollout"``)
  6. ``minibatches`` optimizer steps over a seeded shuffle of the batch; only the first is on-policy
  7. metrics line per optimizer step, samples, checkpoints
Differences from the GSPO paper's setup: none in the objective; rewards that fail are excluded rather than scored 0.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.algorithms import group_advantages, overlong_penalty, policy_loss, zero_variance_groups
from gspo.checkpoint import complete_checkpoints, load_model_weights, rng_state, save_checkpoint, seed_everything, set_rng_state
from gspo.config import Config
from gspo.data import DataStream, build_dataset, default_reward
from gspo.diagnostics import LOG_RATIO_EDGES, pick_trace_rows, ratio_histograms, token_trace
from gspo.errors import UserError
from gspo.logprobs import PackedGraphs, packing_available, packing_unsupported, sequence_logprobs
from gspo.metrics import Console, JsonlWriter, read_jsonl
from gspo.models import attention_context, disable_dropout, load_model, stop_token_ids
from gspo.prompts import encode_prompts
from gspo.rewards.runner import RewardRunner, RewardSpec
from gspo.rollout import make_engine
from gspo.sinks import MetricSinks, open_sinks
from gspo.types import FINISH_LENGTH, Example, Rollout, SamplingParams

log = logging.getLogger("gspo")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device = {name!r} but no CUDA device is visible; use model.device = 'cpu' or 'auto'.")
    return torch.device(name)


def dataset_args(cfg: Config, seed: int) -> dict[str, Any]:
    """The ``data`` section as :func:`gspo.data.build_dataset` takes it (prompt-side fields stay with the trainer)."""
    skip = {"system_prompt", "max_prompt_tokens", "long_prompts"}
    return {**{k: v for k, v in vars(cfg.data).items() if v is not None and k not in skip}, "seed": seed}


@dataclass
class Batch:
    """One rollout batch ready for the update.  N = P x G rows, groups contiguous."""

    rollout: Rollout
    examples: list[Example]  # N, the example of each row
    rewards: torch.Tensor  # (N,) total reward, NaN where a reward function failed
    advantages: torch.Tensor  # (N,)
    loss_mask: torch.Tensor  # (N, T) bool: completion tokens that enter the loss
    metrics: dict[str, float]


class Trainer:
    """Runs one configured training job in ``run_dir``; ``train()`` does the work."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._prepare_run_dir(resume)
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.model.device)
        precision = cfg.model.precision
        if precision == "auto":
            precision = "bf16-autocast" if self.device.type == "cuda" else "fp32"
        self.autocast = torch.bfloat16 if precision == "bf16-autocast" else None

        self.model, self.tokenizer = load_model(cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(self.device))
        self.model.to(self.device)
        if disable_dropout(self.model):
            log.info("dropout disabled: the update must see the same policy as the old log-prob pass")
        if cfg.train.old_logprobs == "rollout" and self.autocast is not None:
            log.warning("train.old_logprobs = 'rollout' under bf16 autocast: the engine's log-probs differ from the "
                        "trainer's by ~0.02 per token, more than GSPO's clip range; use 'recompute' or model.precision = 'fp32'.")
        if cfg.model.gradient_checkpointing:
            # transformers 5.2x renamed the method; 5.17 (the GPU image) only has the old name.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model = None
        if cfg.loss.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.engine = make_engine(cfg.rollout.engine, self.model, self.tokenizer, stop_ids=self.stop_ids, device=self.device,
                                  autocast_dtype=self.autocast, fused_step=cfg.rollout.fused_step)
        self.sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)

        self.stream = DataStream(build_dataset(dataset_args(cfg, cfg.seed)), seed=cfg.seed)
        specs = [RewardSpec(r.path, r.weight, r.name) for r in cfg.rewards.functions] or [RewardSpec(default_reward(cfg.data.task))]
        self.rewards = RewardRunner(specs, workers=cfg.rewards.workers, timeout_s=cfg.rewards.timeout_s)

        t = cfg.train
        compute_dtype = self.autocast or next(self.model.parameters()).dtype
        why_not = packing_unsupported(self.model.config)
        if cfg.model.gradient_checkpointing:  # recomputation in the backward runs after the packed attention is unset
            why_not = "model.gradient_checkpointing is on"
        if t.packing == "on" and why_not:
            raise UserError(f"train.packing = 'on' cannot be used here: {why_not}; set train.packing = 'off' or 'auto'.")
        self.packed = t.packing == "on" or (t.packing == "auto" and not why_not and packing_available(self.device, compute_dtype))
        use_graphs = (self.packed and self.device.type == "cuda" and t.cuda_graphs == "auto"
                      and not cfg.model.gradient_checkpointing)
        self.graphs = PackedGraphs(self.model, self.autocast) if use_graphs else None
        # One fused kernel for the whole AdamW update on CUDA (the per-tensor loop is ~6 ms per step at 135M).
        fused = self.device.type == "cuda" and all(p.dtype == torch.float32 for p in self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                           fused=fused or None)
        self.lr_scale = 1.0  # lowered by each collapse-sentinel rollback
        self.rollbacks = 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0
        self.rollout_batch = 0
        self.skipped_prompts = 0
        self.nonfinite_steps = 0
        self.nonfinite_in_row = 0
        self.elapsed_before = 0.0  # wall-clock of earlier sessions of a resumed run
        self.stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when train() stopped early on one
        self.collapse: str | None = None  # what the collapse sentinel saw last, if it triggered
        self._rewards_seen: dict[int, float | None] = {}  # rollout batch -> reward/mean, for the collapse sentinel
        self._batch_rows: list[dict[str, Any]] = []  # metrics lines of the rollout batch being trained
        self._rollback_pending = False
        self.hist_writer: JsonlWriter | None = None  # diagnostics sinks, open while train() runs
        self.trace_writer: JsonlWriter | None = None
        self.sinks = MetricSinks()  # TensorBoard / W&B when asked for, open while train() runs
        if resume:
            self._resume()

    # ------------------------------------------------------------------------------------------ setup

    def _prepare_run_dir(self, resume: bool) -> None:
        exists = self.run_dir.exists() and any(self.run_dir.iterdir())
        if exists and not resume:
            raise UserError(f"Run directory {str(self.run_dir)!r} already exists; pass --resume to continue it, "
                            "or choose another log.run_dir.")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        import json

        (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))

    def _lr_factor(self, step: int) -> float:
        return self.lr_scale * self._schedule(step)

    def _schedule(self, step: int) -> float:
        t = self.cfg.train
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return 1.0 - progress if t.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    def _resume(self, before_batch: int | None = None) -> None:
        """Load the newest readable checkpoint (with ``before_batch``: the newest written before that rollout batch)."""
        ckpts = complete_checkpoints(self.run_dir / "checkpoints")
        if before_batch is not None:
            ckpts = [c for c in ckpts if _checkpoint_batch(c) < before_batch]
        if not ckpts:
            raise UserError(f"--resume found no complete checkpoint in {str(self.run_dir / 'checkpoints')!r}; "
                            "start a new run without --resume.")
        for ckpt in reversed(ckpts):  # newest first; a damaged one (disk error, manual edits) falls back to the previous
            try:
                load_model_weights(self.model, ckpt)
                state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
                break
            except Exception as e:  # safetensors, pickle and OS errors all mean "this checkpoint cannot be read"
                log.warning("checkpoint %s cannot be read (%s: %s); trying the previous one", ckpt, type(e).__name__,
                            str(e)[:200])
        else:
            raise UserError(f"--resume found no readable checkpoint in {str(self.run_dir / 'checkpoints')!r} (all "
                            f"{len(ckpts)} failed to load); start a new run without --resume.")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.generator.set_state(state["generator"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        self.stream.load_state_dict(state["data"])
        self.step, self.rollout_batch = state["step"], state["rollout_batch"]
        self.skipped_prompts = state.get("skipped_prompts", 0)
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        self.elapsed_before = state.get("elapsed", 0.0)
        self.lr_scale = min(self.lr_scale, state.get("lr_scale", 1.0))
        self.rollbacks = max(self.rollbacks, state.get("rollbacks", 0))
        # The config's learning rate wins over the checkpoint's (resuming with a lower train.lr is how a user reacts to
        # instability); with the same train.lr this recomputes exactly the saved value.
        self.scheduler.base_lrs = [self.cfg.train.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.cfg.train.lr
            group["lr"] = self.cfg.train.lr * self._lr_factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        # The collapse sentinel's reward history up to the checkpoint, as the run that wrote it saw it.
        kept = read_jsonl(self.run_dir / "metrics.jsonl") if (self.run_dir / "metrics.jsonl").exists() else []
        self._rewards_seen = {r["rollout_batch"]: r.get("reward/mean") for r in kept
                              if r.get("minibatch", 0) == 0 and r["rollout_batch"] < self.rollout_batch}
        log.info("resumed from %s at optimizer step %d", ckpt, self.step)

    def checkpoint(self) -> Path:
        state = {"step": self.step, "rollout_batch": self.rollout_batch, "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "rng": rng_state(), "generator": self.generator.get_state(),
                 "shuffle_gen": self.shuffle_gen.get_state(), "data": self.stream.state_dict(),
                 "skipped_prompts": self.skipped_prompts, "nonfinite_steps": self.nonfinite_steps,
                 "elapsed": time.time() - self.t_start, "lr_scale": self.lr_scale, "rollbacks": self.rollbacks}
        try:
            return save_checkpoint(self.run_dir / "checkpoints", self.step, self.model, self.tokenizer, state,
                                   self.cfg.log.keep_checkpoints)
        except OSError as e:  # no space, read-only or vanished directory: the previous checkpoints are untouched
            newest = self._newest_checkpoint()
            kept = f"the last complete one, {newest}, is intact" if newest else "no earlier checkpoint exists"
            raise UserError(f"Writing the checkpoint of step {self.step} to {str(self.run_dir / 'checkpoints')!r} failed "
                            f"({e.strerror or e}); {kept}. Free disk space or fix the directory, then --resume.") from e

    # ------------------------------------------------------------------------------------------ rollout

    def _prompts(self, k: int) -> tuple[list[Example], list[list[int]]]:
        """The next ``k`` examples whose encoded prompt fits ``data.max_prompt_tokens``."""
        examples, ids = [], []
        while len(examples) < k:
            batch = self.stream.next_batch(k - len(examples))
            for ex, p in zip(batch, encode_prompts(self.tokenizer, batch, self.cfg.data.system_prompt)):
                if len(p) > self.cfg.data.max_prompt_tokens:
                    if self.cfg.data.long_prompts == "fail":
                        raise UserError(f"A prompt of {len(p)} tokens ({str(ex.prompt)[:60]!r}...) exceeds "
                                        f"data.max_prompt_tokens = "
                                        f"{self.cfg.data.max_prompt_tokens}; raise it, or set data.long_prompts = 'skip'.")
                    self.skipped_prompts += 1
                    continue
                examples.append(ex)
                ids.append(p)
            if self.skipped_prompts > 1000 and not examples:
                raise UserError(f"Every prompt is longer than data.max_prompt_tokens = {self.cfg.data.max_prompt_tokens}; raise it.")
        return examples, ids

    def _sample_groups(self, k: int, timing: dict[str, float]) -> tuple[Rollout, list[Example], torch.Tensor, dict[str, Any]]:
        G = self.cfg.rollout.group_size
        examples, prompt_ids = self._prompts(k)
        t0 = time.perf_counter()
        rollout = self.engine.generate(prompt_ids, G, self.sampling, generator=self.generator)
        timing["rollout"] += time.perf_counter() - t0
        timing["gen_tokens"] += float(rollout.completion_mask.sum())
        row_examples = [ex for ex in examples for _ in range(G)]
        t0 = time.perf_counter()
        result = self.rewards.score(rollout.texts, row_examples)
        timing["reward"] += time.perf_counter() - t0
        timing["failures"] += float(sum(result.failures.values()))
        return rollout, row_examples, result.total.float(), {"per_function": result.per_function}

    def _sample_batch(self, timing: dict[str, float]) -> tuple[list, list, dict[str, float]]:
        """P groups for the update: with DAPO dynamic sampling, zero-variance groups are dropped and refilled.

        Returns the kept parts, the rewards of every sampled round (for the metrics) and the sampling counters.
        """
        cfg = self.cfg
        P, G = cfg.rollout.prompts_per_batch, cfg.rollout.group_size
        parts: list[tuple[Rollout, list[Example], torch.Tensor, dict[str, Any]]] = []
        kept, dropped, rounds, padded = 0, 0, 0, 0
        sampled: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []  # rewards of every round, for the metrics
        all_zero = []
        while kept < P:
            part = self._sample_groups(P - kept, timing)
            rounds += 1
            # DAPO filters on the task reward (all right or all wrong), not on the length-shaped one.
            zero_var = zero_variance_groups(part[2], G)  # (groups,)
            sampled.append((part[2], part[3]["per_function"]))
            all_zero.append(zero_var)
            if not cfg.dapo.dynamic_sampling:
                parts.append(part)
                break
            good = [g for g in range(len(zero_var)) if not zero_var[g]]
            dropped += len(zero_var) - len(good)
            if good:
                parts.append(_select_groups(part, good, G))
                kept += len(good)
            if kept < P and rounds > cfg.dapo.max_resample_rounds:
                # Out of retries: fill with dropped groups (advantage 0) so the minibatch schedule keeps its shape.
                bad = [g for g in range(len(zero_var)) if zero_var[g]][: P - kept]
                parts.append(_select_groups(part, bad, G))
                padded, kept, dropped = len(bad), kept + len(bad), dropped - len(bad)
                log.warning("dynamic sampling: only %d of %d groups had reward variance after %d rounds; %d padded with "
                            "zero-advantage groups (raise dapo.max_resample_rounds)", P - padded, P, rounds, padded)
        counters = {"dynamic/dropped_groups": float(dropped), "dynamic/padded_groups": float(padded),
                    "dynamic/rounds": float(rounds), "zero_variance_frac": float(torch.cat(all_zero).float().mean())}
        return parts, sampled, counters

    def collect(self) -> Batch:
        """Sample, score and (DAPO) filter one rollout batch, and compute its advantages."""
        cfg = self.cfg
        G = cfg.rollout.group_size
        timing = {"rollout": 0.0, "reward": 0.0, "gen_tokens": 0.0, "failures": 0.0}
        parts, sampled, counters = self._sample_batch(timing)
        rollout = Rollout.concat([p[0] for p in parts])
        examples = [ex for p in parts for ex in p[1]]
        rewards = torch.cat([p[2] for p in parts])  # (N,)
        shaped = self._shape(rewards, rollout)
        adv = group_advantages(shaped, G, scale=cfg.loss.advantage_scale)  # (N,)
        loss_mask = rollout.completion_mask.clone()  # (N, T)
        truncated = torch.tensor([r == FINISH_LENGTH for r in rollout.finish_reasons])  # (N,)
        if cfg.loss.mask_truncated:
            loss_mask &= ~truncated[:, None]

        m: dict[str, float] = {}
        valid = torch.isfinite(rewards)
        raw = torch.cat([r for r, _ in sampled])
        m["reward/mean"] = _nanmean(raw)
        m["reward/std"] = _nanstd(raw)
        m["reward/trained_mean"] = _nanmean(rewards)
        names = list(sampled[0][1])
        for name in names:
            vals = torch.cat([per_fn[name] for _, per_fn in sampled])
            m[f"reward/{name}/mean"] = _nanmean(vals)
            m[f"reward/{name}/std"] = _nanstd(vals)
        prim = torch.cat([per_fn[names[0]] for _, per_fn in sampled])
        m["accuracy"] = _nanmean((prim >= 1.0).float().masked_fill(~torch.isfinite(prim), float("nan")))
        m["reward/failures"] = timing["failures"]
        m["reward/failed_frac"] = float((~valid).float().mean())
        if cfg.dapo.overlong_penalty:
            m["reward/overlong_penalty_mean"] = float(self._overlong(rollout).mean())
        lengths = rollout.lengths.float()
        m["completion/len_mean"] = float(lengths.mean())
        m["completion/len_max"] = float(lengths.max())
        m["completion/truncated_frac"] = float(truncated.float().mean())
        m.update(counters)
        m["data/skipped_prompts"] = float(self.skipped_prompts)
        m["data/position"] = float(self.stream.position)
        m["time/rollout"] = timing["rollout"]
        m["time/reward"] = timing["reward"]
        m["throughput/rollout_tok_s"] = timing["gen_tokens"] / max(timing["rollout"], 1e-9)
        return Batch(rollout, examples, rewards, adv, loss_mask, m)

    def _overlong(self, rollout: Rollout) -> torch.Tensor:
        return overlong_penalty(rollout.lengths, self.cfg.rollout.max_new_tokens, self.cfg.dapo.overlong_cache)

    def _shape(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        return rewards + self._overlong(rollout) if self.cfg.dapo.overlong_penalty else rewards

    # ------------------------------------------------------------------------------------------ update

    def _logprobs(self, model, rollout: Rollout, rows: torch.Tensor | None = None, *, with_entropy: bool = False):
        r = rollout if rows is None else rollout.select(rows.tolist())
        return sequence_logprobs(model, r.prompt_ids, r.completion_ids.to(self.device), r.completion_mask.to(self.device),
                                 temperature=self.cfg.rollout.temperature, pad_id=r.pad_id, chunk_size=self.cfg.train.logprob_chunk,
                                 with_entropy=with_entropy, autocast_dtype=self.autocast, packed=self.packed,
                                 graphs=self.graphs if model is self.model else None)

    def _zero_grad(self) -> None:
        # With CUDA graphs .grad stays allocated (PackedGraphs allocates it before the first graphed backward).
        self.optimizer.zero_grad(set_to_none=self.graphs is None)

    @torch.no_grad()
    def _frozen_logprobs(self, model, rollout: Rollout, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Log-probs of a frozen policy over the same micro-batches (rows, padding) the update will use.

        Same rows and shapes as the update's forward passes, so a frozen policy's numbers round as the update's would:
        in bf16 a different batch composition changes the rounding by more than GSPO's clip range.
        """
        was_training = model.training
        model.eval()
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=self.device)  # (N, T)
        for rows in micro_batches:
            out[rows.to(self.device)] = self._logprobs(model, rollout, rows)[0]
        model.train(was_training)
        return out

    def update(self, batch: Batch, writer: JsonlWriter, console: Console, steps: int | None = None) -> None:
        """``minibatches`` optimizer steps over a seeded shuffle of ``batch``; one metrics line per step."""
        cfg, t = self.cfg, self.cfg.train
        rollout = batch.rollout
        N = rollout.completion_ids.shape[0]
        dev = self.device
        t0 = time.perf_counter()
        engine_logp = rollout.logprobs.to(dev)  # (N, T)
        mask = batch.loss_mask.to(dev)  # (N, T)
        order = torch.randperm(N, generator=self.shuffle_gen)
        mb_size = N // t.minibatches
        micro = t.micro_batch_size or mb_size
        micro_batches = [order[i:i + micro] for i in range(0, N, micro)]  # minibatch k = micro-batches of rows k*mb_size..
        recompute = t.old_logprobs == "recompute"
        first = mb_size // micro  # micro-batches of minibatch 0
        if recompute:
            # Minibatch 0 is on-policy: its old log-probs are its own update forward's (detached, filled in below), so
            # only the later minibatches need the frozen pass; they get it now, before any weight changes.
            old_logp = self._frozen_logprobs(self.model, rollout, micro_batches[first:])  # (N, T)
        else:
            old_logp = engine_logp
        ref_logp = self._frozen_logprobs(self.ref_model, rollout, micro_batches) if self.ref_model is not None else None
        t_logprobs = time.perf_counter() - t0
        extra = dict(batch.metrics)
        extra["time/logprobs"] = t_logprobs

        adv = batch.advantages.to(dev)
        self._batch_rows: list[dict[str, Any]] = []
        self.model.train()
        for k in range(t.minibatches if steps is None else steps):
            t_step = time.perf_counter()
            rows = order[k * mb_size:(k + 1) * mb_size]
            # Denominators of the whole minibatch, so micro-batches sum to its exact loss; rows left entirely out
            # of the loss (DAPO overlong filtering) do not count as sequences (the sequence-level TRL #6369).
            num_tokens = float(mask[rows].sum())
            num_seqs = float(mask[rows].any(-1).sum())
            loss_kw = dict(level=cfg.loss.level, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
                           aggregation=cfg.loss.aggregation, beta=cfg.loss.beta, max_length=cfg.rollout.max_new_tokens)
            mb_logp, mb_ent = torch.zeros_like(old_logp[rows]), torch.zeros_like(old_logp[rows])  # (mb, T) detached
            loss_total = 0.0
            self._zero_grad()
            for j in range(0, mb_size, micro):
                sub = rows[j:j + micro]
                logp, ent = self._logprobs(self.model, rollout, sub, with_entropy=True)  # (n, T)
                if recompute and k == 0:
                    old_logp[sub.to(dev)] = logp.detach()
                loss, _ = policy_loss(logp, old_logp[sub], adv[sub], mask[sub], ref_logp=None if ref_logp is None else ref_logp[sub],
                                      num_seqs=num_seqs, num_tokens=num_tokens, **loss_kw)
                with attention_context():
                    loss.backward()
                loss_total += float(loss.detach())
                mb_logp[j:j + micro], mb_ent[j:j + micro] = logp.detach(), ent
            if recompute and k == 0:  # every row's old log-probs exist from here on
                extra.update(_engine_gap(engine_logp, old_logp, rollout.completion_mask.to(dev)))
            with torch.no_grad():  # diagnostics over the whole minibatch at once (exact whatever the micro-batching)
                _, metric_sums = policy_loss(mb_logp, old_logp[rows], adv[rows], mask[rows],
                                             ref_logp=None if ref_logp is None else ref_logp[rows], **loss_kw)
            cm = rollout.completion_mask[rows.cpu()].to(dev)
            trained_tokens = float(cm.sum())
            self._diagnostics(rollout, rows, mb_logp, old_logp[rows], mask[rows], adv[rows], k)
            grad_norm = self._optimizer_step(loss_total)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            dt = time.perf_counter() - t_step
            row = {"step": self.step, "rollout_batch": self.rollout_batch, "minibatch": k, **extra,
                   "loss": loss_total, **metric_sums, "entropy": float(mb_ent[cm].mean()) if cm.any() else 0.0,
                   "grad_norm": grad_norm, "lr": lr, "nonfinite_steps": float(self.nonfinite_steps),
                   "time/update": dt, "throughput/train_tok_s": trained_tokens / max(dt, 1e-9),
                   "time/elapsed": time.time() - self.t_start}
            writer.write(row)
            self.sinks.log(row)
            self._batch_rows.append(row)
            console.update(self.step, row, end_of_batch=(k == t.minibatches - 1))
        self.model.eval()

    def _diagnostics(self, rollout: Rollout, rows: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                     mask: torch.Tensor, adv: torch.Tensor, k: int) -> None:
        """Ratio histograms of this optimizer step and, every ``trace_every`` rollout batches on the last minibatch,
        per-token traces of a few responses (``gspo report`` draws both)."""
        log_cfg, step = self.cfg.log, self.step + 1
        if self.hist_writer is not None and log_cfg.histograms:
            self.hist_writer.write({"step": step, "rollout_batch": self.rollout_batch, "minibatch": k,
                                    "edges": LOG_RATIO_EDGES, **ratio_histograms(logp, old_logp, mask)})
        due = log_cfg.trace_every and self.rollout_batch % log_cfg.trace_every == 0 and k == self.cfg.train.minibatches - 1
        if self.trace_writer is not None and due:
            for i in pick_trace_rows(logp, old_logp, mask, log_cfg.trace_samples):
                row = int(rows[i])
                self.trace_writer.write({"step": step, "rollout_batch": self.rollout_batch, "minibatch": k, "row": row,
                                         **token_trace(self.tokenizer, rollout.completion_ids[row], logp[i].cpu(),
                                                       old_logp[i].cpu(), mask[i].cpu(), float(adv[i].mean()))})

    def _optimizer_step(self, loss: float) -> float:
        """Clip and apply the accumulated gradient, or skip the step (counted) when the loss or gradient is not finite."""
        t = self.cfg.train
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm if t.max_grad_norm > 0 else float("inf")))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.nonfinite_in_row = 0
            return grad_norm
        self.nonfinite_steps += 1
        self.nonfinite_in_row += 1
        self._zero_grad()
        log.warning("non-finite loss or gradient at step %d: optimizer step skipped", self.step + 1)
        if self.nonfinite_in_row >= t.max_nonfinite_steps:
            raise UserError(f"{self.nonfinite_in_row} optimizer steps in a row had a non-finite loss or gradient "
                            f"(last at step {self.step + 1}); lower train.lr or try model.precision = 'fp32'. "
                            "The last checkpoint is intact.")
        return grad_norm

    # ------------------------------------------------------------------------------------------ loop

    def _write_samples(self, writer: JsonlWriter, batch: Batch) -> None:
        G = self.cfg.rollout.group_size
        for i in list(range(0, len(batch.examples), G))[: self.cfg.log.samples_per_batch]:  # one completion per prompt
            ex = batch.examples[i]
            writer.write({"step": self.step, "rollout_batch": self.rollout_batch, "prompt": ex.prompt, "answer": ex.answer,
                          "completion": batch.rollout.texts[i], "reward": float(batch.rewards[i]),
                          "advantage": float(batch.advantages[i]), "finish_reason": batch.rollout.finish_reasons[i],
                          "length": int(batch.rollout.lengths[i])})

    def _newest_checkpoint(self) -> str | None:
        """Name of the newest complete checkpoint (for messages that say what is intact), or None."""
        done = complete_checkpoints(self.run_dir / "checkpoints")
        return done[-1].name if done else None

    def _open_sinks(self) -> tuple[JsonlWriter, JsonlWriter]:
        """The run's JSONL files, without the lines written after the current step by a run that died or was rolled
        back (they are replayed)."""
        step, batch_no = self.step, self.rollout_batch
        metrics = JsonlWriter(self.run_dir / "metrics.jsonl", keep=lambda row: row["step"] <= step)
        samples = JsonlWriter(self.run_dir / "samples.jsonl", keep=lambda row: row["rollout_batch"] < batch_no)
        self.hist_writer = JsonlWriter(self.run_dir / "histograms.jsonl", keep=lambda row: row["step"] <= step)
        self.trace_writer = JsonlWriter(self.run_dir / "traces.jsonl", keep=lambda row: row["step"] <= step)
        return metrics, samples

    def _check_collapse(self) -> None:
        """The collapse sentinel (``sentinel.*``) on the rollout batch just trained: warn, or stop the run."""
        sc, rows = self.cfg.sentinel, self._batch_rows
        self._rewards_seen[self.rollout_batch - 1] = rows[0].get("reward/mean")
        found = []
        entropy = rows[0].get("entropy")
        if sc.entropy_min > 0 and entropy is not None and entropy < sc.entropy_min:
            found.append(f"entropy {entropy:.4f} < sentinel.entropy_min = {sc.entropy_min}")
        rewards = [r for _, r in sorted(self._rewards_seen.items()) if r is not None]
        if sc.reward_drop > 0 and len(rewards) >= 2 * sc.window:
            means = [sum(rewards[i - sc.window:i]) / sc.window for i in range(sc.window, len(rewards) + 1)]
            if max(means[:-1]) - means[-1] > sc.reward_drop:
                found.append(f"mean reward of the last {sc.window} batches {means[-1]:.3f} is {max(means[:-1]) - means[-1]:.3f} "
                             f"below its best {max(means[:-1]):.3f} (sentinel.reward_drop = {sc.reward_drop})")
        if sc.seq_ratio_log_max > 0:
            values = [r.get(k) for r in rows for k in ("ratio/seq_min", "ratio/seq_max") if r.get(k) is not None]
            spread = max((abs(math.log(v)) if v > 0 and math.isfinite(v) else math.inf for v in values), default=0.0)
            if spread > sc.seq_ratio_log_max:
                found.append(f"|log sequence ratio| reached {spread:.3g} > sentinel.seq_ratio_log_max = {sc.seq_ratio_log_max}")
        if not found:
            return
        self.collapse = "; ".join(found)
        done = complete_checkpoints(self.run_dir / "checkpoints")
        newest = self._newest_checkpoint()
        last = f"the last checkpoint is {newest}" if newest else "no checkpoint was written yet"
        if sc.action == "warn":
            log.warning("collapse sentinel at step %d: %s", self.step, self.collapse)
            return
        earlier = [c for c in done if _checkpoint_batch(c) < self.rollout_batch - 1]
        if sc.action == "rollback" and earlier and self.rollbacks < sc.max_rollbacks:
            done = earlier
            self.rollbacks += 1
            log.warning("collapse sentinel at step %d: %s; rolling back to %s with the learning rate x %g (rollback %d "
                        "of %d)", self.step, self.collapse, done[-1].name, sc.lr_factor, self.rollbacks, sc.max_rollbacks)
            self.lr_scale *= sc.lr_factor
            self._rollback_pending = True
            return
        if sc.action == "rollback":
            last += (f" ({self.rollbacks} rollbacks done, sentinel.max_rollbacks = {sc.max_rollbacks})" if earlier else
                     " (no checkpoint older than the batch before the trigger to roll back to; it would replay the same "
                     "rollouts: raise log.keep_checkpoints)")
        raise UserError(f"Collapse sentinel stopped the run at step {self.step}: {self.collapse}; {last}. Resume from it "
                        "with a lower train.lr, or loosen the sentinel.* thresholds.")

    @contextlib.contextmanager
    def _out_of_memory(self, phase: str):
        """GPU out-of-memory in a phase of the loop ends in one line naming the knobs of that phase."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            knobs = ("rollout.prompts_per_batch x rollout.group_size or rollout.max_new_tokens" if phase == "the rollout"
                     else "train.micro_batch_size (or turn on model.gradient_checkpointing)")
            newest = self._newest_checkpoint()
            last = f"the last checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"
            raise UserError(f"The GPU ran out of memory in {phase} at step {self.step}; lower {knobs}; {last}.") from e

    def _catch_stop_signals(self):
        """SIGINT / SIGTERM finish the rollout batch being trained (its remaining minibatch steps), then the loop writes
        a checkpoint and returns; a second signal stops at once. Returns the function that restores the old handlers.
        Checkpoints sit at rollout-batch boundaries, so that is where a resumed run continues bit for bit."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {}

        def handler(signum, frame):
            if self.stop_signal is not None:  # the second one: the user really means it
                signal.signal(signum, previous[signum])
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            log.warning("%s: finishing rollout batch %d, then writing a checkpoint (again to stop now)",
                        self.stop_signal, self.rollout_batch)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)

        def restore():
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore

    def train(self) -> Path:
        """Run until ``train.steps`` optimizer steps; returns the run directory."""
        cfg = self.cfg
        self.t_start = time.time() - self.elapsed_before
        metrics, samples = self._open_sinks()
        console = Console(cfg.train.steps, self.step, enabled=cfg.log.progress)
        self.model.eval()
        self.stop_signal = None
        restore = self._catch_stop_signals()
        try:
            self.sinks = open_sinks(cfg.to_dict(), self.run_dir, self.step)
            while self.step < cfg.train.steps and self.stop_signal is None:
                with self._out_of_memory("the rollout"):
                    batch = self.collect()
                self._write_samples(samples, batch)
                with self._out_of_memory("the update"):
                    self.update(batch, metrics, console)
                self.sinks.flush()
                self.rollout_batch += 1
                self._check_collapse()
                if self._rollback_pending:
                    self._rollback_pending = False
                    for sink in (metrics, samples, self.hist_writer, self.trace_writer):
                        sink.close()
                    # The newest checkpoint written before the batch that tripped the sentinel: the one right before it
                    # would replay the same rollouts (weights, RNG and data are restored exactly) and trip it again.
                    self._resume(before_batch=self.rollout_batch - 1)
                    metrics, samples = self._open_sinks()  # drops the lines written after that checkpoint
                    self.sinks.rewind(self.step)
                    continue
                every = cfg.log.checkpoint_every
                if every and self.rollout_batch % every == 0 and self.step < cfg.train.steps and self.stop_signal is None:
                    self.checkpoint()
            self.checkpoint()
            if self.stop_signal is not None:
                log.warning("%s received: stopped after step %d with a checkpoint; continue with --resume",
                            self.stop_signal, self.step)
        finally:
            restore()
            console.close()
            metrics.close()
            samples.close()
            self.hist_writer.close()
            self.trace_writer.close()
            self.hist_writer = self.trace_writer = None
            self.sinks.close(failed=sys.exc_info()[0] is not None)
            self.rewards.close()
        return self.run_dir


def _checkpoint_batch(ckpt: Path) -> int:
    """The rollout batch a checkpoint resumes at (from its state.json)."""
    import json

    try:
        return int(json.loads((ckpt / "state.json").read_text())["rollout_batch"])
    except (OSError, ValueError, KeyError):
        return 1 << 30  # unreadable: never a rollback target


def _engine_gap(engine_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's: per token, and per sequence (the GSPO log-ratio)."""
    if not mask.any():
        return {k: 0.0 for k in ("logprob/engine_diff_mean", "logprob/engine_diff_max",
                                 "logprob/engine_seq_diff_mean", "logprob/engine_seq_diff_max")}
    diff = (engine_logp - old_logp).abs()[mask]
    seq = (torch.where(mask, engine_logp - old_logp, 0).sum(-1) / mask.sum(-1).clamp(min=1)).abs()  # (N,)
    return {"logprob/engine_diff_mean": float(diff.mean()), "logprob/engine_diff_max": float(diff.max()),
            "logprob/engine_seq_diff_mean": float(seq.mean()), "logprob/engine_seq_diff_max": float(seq.max())}


def _select_groups(part, groups: list[int], G: int):
    rollout, examples, rewards, extra = part
    rows = [g * G + j for g in groups for j in range(G)]
    return rollout.select(rows), [examples[i] for i in rows], rewards[rows], {
        "per_function": {k: v[rows] for k, v in extra["per_function"].items()}}


def _nanmean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.std(unbiased=False)) if x.numel() else float("nan")
