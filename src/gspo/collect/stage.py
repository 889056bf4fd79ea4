"""The collect stage: prompts -> engine -> rewards -> [DAPO refill] -> advantages -> a :class:`~gspo.types.Batch`.

Shapes: ``P`` prompts per batch, ``G`` completions per prompt, ``N = P x G`` rows (groups contiguous), ``T``
completion positions.

1. the next prompts whose encoded length fits ``data.max_prompt_tokens``;
2. ``G`` completions each from the engine, scored by the reward functions (failures -> NaN, left out of the group
   baseline);
3. [DAPO dynamic sampling] groups whose task rewards are all equal carry no signal: they are dropped and new prompts
   sampled until ``P`` groups have variance or ``dapo.max_resample_rounds`` extra rounds are spent;
4. [DAPO] the soft overlong punishment is added to the reward, then group-relative advantages;
5. the loss mask: completion tokens, without truncated completions under ``loss.mask_truncated``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from gspo.algorithms import estimate_advantages, overlong_penalty, zero_variance_groups
from gspo.config import Config
from gspo.data import DataStream
from gspo.parallel.comm import active, barrier, gather_objects, rank_world, split_work
from gspo.errors import UserError
from gspo.runlog.profiler import stage
from gspo.prompts import encode_prompts
from gspo.envs.episodes import COUNTS as env_counts, Episodes, batch_metrics as env_metrics
from gspo.rewards.runner import RewardRunner
from gspo.algorithms.ppo import process_token_rewards
from gspo.rewards.steps import task_steps, turn_steps
from gspo.types import FINISH_LENGTH, Batch, Example, Groups, Rollout, SamplingParams

log = logging.getLogger("gspo")


@dataclass
class Scores:
    """The rewards of one sampling round (what the reward metrics and the failure check read of it): sent to every
    process without the round's completions, which the kept groups already carry."""

    rewards: torch.Tensor  # (n,) weighted total, NaN where a reward function failed
    per_function: dict[str, torch.Tensor]  # name -> (n,)


class Collector:
    """Samples, scores and filters rollout batches for one run."""

    def __init__(self, cfg: Config, tokenizer, stream: DataStream, rewards: RewardRunner, engine,
                 generator: torch.Generator, episodes: Episodes | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.stream = stream
        self.rewards = rewards
        self.engine = engine
        self.generator = generator
        self.episodes = episodes  # multi-turn: the environment and tools between the engine's turns
        self.sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        self.skipped_prompts = 0  # prompts over data.max_prompt_tokens, run-wide (saved in checkpoints)
        self._skips_in_row = 0
        self._shortest_skipped = 1 << 62
        self._warned_failures = False
        self._warned_cut = False  # every completion of a batch cut off at rollout.max_new_tokens: said once
        self._first_error: str | None = None  # of the rollout batch being collected

    def close(self) -> None:
        """Stop the reward workers and the environment workers (idempotent)."""
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()

    def state_dict(self) -> dict:
        """What a checkpoint holds of the collect stage: the sampling stream, the data position, the prompts skipped."""
        return {"generator": self.generator.get_state(), "data": self.stream.state_dict(),
                "skipped_prompts": self.skipped_prompts}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.stream.load_state_dict(state["data"])
        self.skipped_prompts = state.get("skipped_prompts", 0)

    # ------------------------------------------------------------------------------------------ stages

    def prompts(self, k: int) -> tuple[list[Example], list[list[int]]]:
        """The next ``k`` examples whose encoded prompt fits ``data.max_prompt_tokens``. A whole pass over the data
        (at most 1,000 prompts) without one that fits ends in one line, instead of sampling forever."""
        data = self.cfg.data
        limit = min(len(self.stream.dataset), 1000)
        examples, ids = [], []
        while len(examples) < k:
            batch = self.stream.next_batch(k - len(examples))
            # Under torchrun every process needs every prompt's ids (which ones fit decides each one's share) and each
            # encodes 1/W of them
            encoded = split_work(batch, self.encode)
            for ex, p in zip(batch, encoded):
                if len(p) <= data.max_prompt_tokens:
                    examples.append(ex)
                    ids.append(p)
                    self._skips_in_row = 0
                    continue
                if data.long_prompts == "fail":
                    raise UserError(f"A prompt of {len(p)} tokens ({str(ex.prompt)[:60]!r}...) exceeds "
                                    f"data.max_prompt_tokens = {data.max_prompt_tokens}; raise it, or set "
                                    "data.long_prompts = 'skip'.")
                self.skipped_prompts += 1
                self._skips_in_row += 1
                self._shortest_skipped = min(self._shortest_skipped, len(p))
                if self.skipped_prompts in (1, 100, 10_000):
                    log.warning("skipped %d prompt(s) longer than data.max_prompt_tokens = %d so far",
                                self.skipped_prompts, data.max_prompt_tokens)
                if self._skips_in_row >= limit:
                    raise UserError(f"The last {self._skips_in_row} prompts in a row (a whole pass over the data, or "
                                    f"1,000) are longer than data.max_prompt_tokens = {data.max_prompt_tokens} (the "
                                    f"shortest had {self._shortest_skipped} tokens); raise it, or use shorter prompts.")
        return examples, ids

    def encode(self, examples: list[Example]) -> list[list[int]]:
        """The prompt ids of these examples (with the tools' system message under an environment)."""
        if self.episodes is not None:
            return self.episodes.encode(examples)
        return encode_prompts(self.tokenizer, examples, self.cfg.data.system_prompt)

    def sample_groups(self, examples: list[Example], prompt_ids: list[list[int]], timing: dict[str, float]) -> Groups:
        """``G`` completions of each of these prompts, scored."""
        G = self.cfg.rollout.group_size
        t0 = time.perf_counter()
        episode = None
        with stage("rollout"):
            if self.episodes is None:
                rollout = self.engine.generate(prompt_ids, G, self.sampling, generator=self.generator)
            else:
                rollout, episode = self.episodes.run(self.engine, examples, prompt_ids, G, self.sampling,
                                                     self.generator)
        timing["rollout"] += time.perf_counter() - t0
        timing["gen_tokens"] += float(rollout.sampled.sum())
        row_examples = [ex for ex in examples for _ in range(G)]
        t0 = time.perf_counter()
        with stage("reward"):
            result = self.rewards.score(rollout.texts, row_examples)
        timing["reward"] += time.perf_counter() - t0
        timing["failures"] += float(sum(result.failures.values()))
        if result.errors and self._first_error is None:
            self._first_error = result.errors[0]
        self.warn_failures(result)
        total, per_function = result.total.float(), result.per_function
        if episode is not None:  # the environment's rewards, added to the reward functions' (if any)
            total = total + episode.rewards
            per_function = {**per_function, "env": episode.rewards}
            timing["failures"] += episode.metrics["env/failures"]
            for key, value in episode.metrics.items():
                timing[key] += value
            if episode.first_error and self._first_error is None:
                self._first_error = episode.first_error
        return Groups(rollout, row_examples, total, per_function)

    def check_failures(self, rounds: list[Scores]) -> None:
        """A reward function that failed (NaN) on every completion of a rollout batch, all its sampling rounds, is
        broken, not unlucky: one line naming it and its first error."""
        for name in rounds[0].per_function:
            values = torch.cat([r.per_function[name] for r in rounds])
            if values.numel() and not torch.isfinite(values).any() and name == "env":
                raise UserError(f"Every trajectory of a rollout batch failed in env.path = {self.cfg.env.path!r} "
                                f"(first error: {self._first_error or 'no message'}); fix the environment (set "
                                "env.workers = 0 to debug it in-process).")
            if values.numel() and not torch.isfinite(values).any():
                raise UserError(f"The reward function {name!r} failed on all {values.numel()} completions of a rollout "
                                f"batch (first error: {self._first_error or 'no message'}); fix it (set "
                                "rewards.workers = 0 to debug it in-process).")

    def warn_failures(self, result) -> None:
        """Occasional failures are warned about once (the metrics count every one)."""
        first = result.errors[0] if result.errors else "no message"
        if any(result.failures.values()) and not self._warned_failures:
            self._warned_failures = True
            log.warning("reward calls failed (%s; first error: %s): those completions are left out of their group's "
                        "baseline; reward/failures counts them", ", ".join(f"{k}: {v}" for k, v in
                                                                            result.failures.items() if v), first)

    def warn_if_all_cut(self, truncated: torch.Tensor) -> None:
        """Once a run: every completion of a batch reached the token limit without ending, so an answer longer than
        that was never scored (a reward of 0 that may say nothing about the reward function)."""
        if bool(truncated.all()) and not self._warned_cut:
            self._warned_cut = True
            log.warning("every completion of this rollout batch reached rollout.max_new_tokens = %d without ending: "
                        "what comes after is never scored (a reward of 0 may be only that); raise "
                        "rollout.max_new_tokens if answers need more", self.cfg.rollout.max_new_tokens)

    def fill(self, timing: dict[str, float]) -> tuple[Groups, list[Groups], dict[str, Any]]:
        """This process's groups for the update (all ``P`` in one process, ``P / W`` of a ``torchrun`` job); with DAPO
        dynamic sampling, zero-variance groups are dropped and refilled. Sampling rounds are taken by all processes
        together (see :mod:`gspo.parallel`): each round every one says how many groups it lacks (under dynamic sampling; else
        each lacks P / W, then none), all draw that many prompts from the one data stream, and each samples its own
        share.

        Returns the kept groups, every sampled round (for the reward metrics) and the sampling counts."""
        cfg = self.cfg
        rank, world = rank_world()
        P, G = cfg.rollout.prompts_per_batch // world, cfg.rollout.group_size
        kept_parts: list[Groups] = []
        rounds_seen: list[Groups] = []
        kept = dropped = rounds = padded = 0
        zero_flags = []
        while True:
            if cfg.dapo.dynamic_sampling:
                with stage("needs"):
                    needs = gather_objects(P - kept)  # [groups each process still lacks]
            else:  # every process lacks the same count (all P, then none): nothing to exchange
                needs = [P - kept] * world
            if not any(needs):
                break
            with stage("prompts"):
                examples, prompt_ids = self.prompts(sum(needs))
            rounds += 1
            if not needs[rank]:
                continue
            mine = slice(sum(needs[:rank]), sum(needs[:rank + 1]))
            part = self.sample_groups(examples[mine], prompt_ids[mine], timing)
            rounds_seen.append(part)
            zero_var = zero_variance_groups(part.rewards, G)  # (groups,) on the task reward, not the length-shaped one
            zero_flags.append(zero_var)
            if not cfg.dapo.dynamic_sampling:
                kept_parts.append(part)
                kept = P
                continue
            good = [g for g in range(len(zero_var)) if not zero_var[g]]
            dropped += len(zero_var) - len(good)
            if good:
                kept_parts.append(part.groups(good, G))
                kept += len(good)
            if kept < P and rounds > cfg.dapo.max_resample_rounds:
                # Out of retries: fill with dropped groups so the minibatch schedule keeps its shape.
                bad = [g for g in range(len(zero_var)) if zero_var[g]][: P - kept]
                kept_parts.append(part.groups(bad, G))
                padded, kept, dropped = len(bad), kept + len(bad), dropped - len(bad)
                shaped = ("trained on the overlong punishment alone (their task rewards are equal)"
                          if cfg.dapo.overlong_penalty else "with advantage 0 (no gradient)")
                log.warning("dynamic sampling: only %d of %d groups had reward variance after %d rounds; %d groups "
                            "without it fill the batch, %s; raise dapo.max_resample_rounds", P - padded, P, rounds,
                            padded, shaped)
        counts = {"dropped": dropped, "padded": padded, "rounds": rounds, "zero_flags": torch.cat(zero_flags)}
        return Groups.concat(kept_parts), rounds_seen, counts

    def gather(self, groups: Groups, rounds: list[Groups], counts: dict[str, Any],
               timing: dict[str, float]) -> tuple[Groups, list[Scores], dict[str, float]]:
        """Every process's groups, the rewards of every sampling round and counts, in rank order (a no-op in one
        process), and the sampling counters of the whole batch."""
        t0 = time.perf_counter()
        wait = 0.0
        scores = [Scores(r.rewards, r.per_function) for r in rounds]
        if active():
            with stage("gather_wait"):
                barrier()  # the wait for the slowest process's rollout, timed apart from the transfer
            wait = time.perf_counter() - t0
            with stage("gather_objects"):  # tensors travel as their CPU values (comm.dumps): no copy made here first
                parts = gather_objects((groups, scores, counts, dict(timing), self._first_error))
            with stage("gather_merge"):
                groups = Groups.concat([p[0] for p in parts])
            scores = [r for p in parts for r in p[1]]
            counts = {"dropped": sum(p[2]["dropped"] for p in parts), "padded": sum(p[2]["padded"] for p in parts),
                      "rounds": max(p[2]["rounds"] for p in parts),
                      "zero_flags": torch.cat([p[2]["zero_flags"] for p in parts])}
            # The stage's wall-clock time is the slowest process's; tokens and failures add up.
            for key in timing:
                timing[key] = (max if key in ("rollout", "reward") else sum)(p[3][key] for p in parts)
            self._first_error = next((p[4] for p in parts if p[4]), None)
        timing["gather"] = time.perf_counter() - t0
        timing["gather_wait"] = wait  # after the merge above: this process's own
        counters = {"dynamic/dropped_groups": float(counts["dropped"]), "dynamic/padded_groups": float(counts["padded"]),
                    "dynamic/rounds": float(counts["rounds"]),
                    "zero_variance_frac": float(counts["zero_flags"].float().mean())}
        return groups, scores, counters

    def collect(self) -> Batch:
        """Sample, score and (DAPO) filter one rollout batch, and compute its advantages."""
        cfg = self.cfg
        timing = {"rollout": 0.0, "reward": 0.0, "gen_tokens": 0.0, "failures": 0.0,
                  **({key: 0.0 for key in env_counts} if self.episodes is not None else {})}
        t0 = time.perf_counter()
        self._first_error = None
        groups, rounds, counters = self.gather(*self.fill(timing), timing)
        self.check_failures(rounds)
        rollout = groups.rollout
        shaped = groups.rewards + self.overlong(rollout) if cfg.dapo.overlong_penalty else groups.rewards
        steps = None  # (token ends, credits) of each row's steps, with loss.step_credit
        if self.rewards.steps is not None:
            steps = task_steps(self.rewards.step_spans(rollout.texts, groups.examples), self.tokenizer, rollout)
        elif cfg.loss.step_credit == "env":  # each turn a step credited with its environment reward
            steps = turn_steps(rollout, groups.rewards)
        loss_mask = rollout.sampled.clone()  # (N, T): the tokens the policy chose
        truncated = torch.tensor([r == FINISH_LENGTH for r in rollout.finish_reasons])  # (N,)
        if cfg.loss.mask_truncated:
            loss_mask &= ~truncated[:, None]
        lc = cfg.loss
        if lc.advantage_baseline == "critic":  # PPO: the rewards, which the actor's value model's GAE turns into
            loss_mask &= torch.isfinite(shaped)[:, None]  # advantages; a failed reward is no return to learn from
            adv = torch.where(torch.isfinite(shaped), shaped, torch.zeros_like(shaped)).float()  # (N,)
            if steps is not None:  # (N, T) token rewards for GAE: the outcome at the last step, the steps' credit
                adv = process_token_rewards(adv, loss_mask, *steps, lc.step_credit_weight,
                                            paid_in_outcome=lc.step_credit == "env").float()
        else:
            adv, _ = estimate_advantages(shaped, loss_mask, baseline=lc.advantage_baseline, scale=lc.advantage_scale,
                                         group_size=cfg.rollout.group_size, steps=steps,
                                         step_weight=lc.step_credit_weight)  # (N,), or (N, T)
        m = self.reward_metrics(groups, rounds, timing)
        if cfg.dapo.overlong_penalty:
            m["reward/overlong_penalty_mean"] = float(self.overlong(rollout).mean())
        lengths = rollout.lengths.float()
        m["completion/len_mean"] = float(lengths.mean())
        m["completion/len_max"] = float(lengths.max())
        m["completion/truncated_frac"] = float(truncated.float().mean())
        self.warn_if_all_cut(truncated)
        m.update(counters)
        if self.episodes is not None:
            m.update(env_metrics({key: timing[key] for key in env_counts}))
        m["data/skipped_prompts"] = float(self.skipped_prompts)
        m["data/position"] = float(self.stream.position)
        m["time/rollout"] = timing["rollout"]
        m["time/reward"] = timing["reward"]
        # Under torchrun: sending the scored groups to every process, with the wait for the slowest one's rollout
        m["time/gather"] = timing["gather"]
        m["time/gather_wait"] = timing["gather_wait"]  # of it: waiting for the slowest process (mean over processes)
        m["time/collect"] = time.perf_counter() - t0  # the whole stage: rollout, rewards, refills, gather, advantages
        m["throughput/rollout_tok_s"] = timing["gen_tokens"] / max(timing["rollout"], 1e-9)
        return Batch(rollout, groups.examples, groups.rewards, adv, loss_mask, m)

    # ------------------------------------------------------------------------------------------ pieces

    def overlong(self, rollout: Rollout) -> torch.Tensor:
        # the tokens the policy wrote: a multi-turn row's tool results and observations are not its length
        return overlong_penalty(rollout.sampled.sum(-1), self.cfg.rollout.max_new_tokens, self.cfg.dapo.overlong_cache)

    @staticmethod
    def reward_metrics(groups: Groups, rounds: list[Scores], timing: dict[str, float]) -> dict[str, float]:
        """Reward statistics over every sampled round (what the policy produced), and over the rows trained."""
        raw = torch.cat([r.rewards for r in rounds])
        m = {"reward/mean": _nanmean(raw), "reward/std": _nanstd(raw), "reward/trained_mean": _nanmean(groups.rewards)}
        names = list(rounds[0].per_function)
        for name in names:
            vals = torch.cat([r.per_function[name] for r in rounds])
            m[f"reward/{name}/mean"] = _nanmean(vals)
            m[f"reward/{name}/std"] = _nanstd(vals)
        prim = torch.cat([r.per_function[names[0]] for r in rounds])
        m["accuracy"] = _nanmean((prim >= 1.0).float().masked_fill(~torch.isfinite(prim), float("nan")))
        m["reward/failures"] = timing["failures"]
        m["reward/failed_frac"] = float((~torch.isfinite(groups.rewards)).float().mean())
        return m


def _nanmean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.std(unbiased=False)) if x.numel() else float("nan")
