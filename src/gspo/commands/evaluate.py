"""Evaluation: greedy accuracy and pass@1 averaged over k samples on a dataset split."""
from __future__ import annotations

import time
from typing import Any

import torch

from gspo.config import Config
from gspo.data import build_dataset, dataset_args
from gspo.envs.episodes import Episodes
from gspo.models import load_model, stop_token_ids
from gspo.prompts import encode_prompts
from gspo.rewards.runner import RewardRunner, config_specs
from gspo.rollout import make_engine
from gspo.runtime import Runtime
from gspo.types import SamplingParams


def evaluate(cfg: Config, *, model_name: str | None = None, n: int = 200, samples: int = 4, batch_size: int = 64) -> dict[str, Any]:
    """Score the first ``n`` examples of the configured data: greedy accuracy and pass@1 over ``samples`` draws.

    A completion counts as correct when the first reward function gives it >= 1. The greedy responses' lengths (in
    tokens: 10th, 50th and 90th percentiles, longest, share that hit ``rollout.max_new_tokens``) come with it.

    With an ``[env]`` the trajectories are multi-turn, sampled as in training: the score is the first reward function's
    (if any) plus the environment's reward, and the mean rewards and turns are reported too, since an environment's
    reward need not be 0 or 1 (the number game's is 1 less 0.1 per extra guess). A trajectory whose environment failed
    counts as wrong.
    """
    runtime = Runtime.from_config(cfg.model)  # the same device and precision rule as training
    device = runtime.device
    model, tok = load_model(model_name or cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(device))
    model.to(device).eval()
    engine = make_engine(cfg.rollout.engine, model, tok, stop_ids=stop_token_ids(tok, model), device=device,
                         autocast_dtype=runtime.autocast, fused_step=cfg.rollout.fused_step,
                         vllm_gpu_memory=cfg.rollout.vllm_gpu_memory)
    dataset = build_dataset(dataset_args(cfg.data, cfg.seed + 10_000))  # generated tasks: other items than training saw
    examples = [dataset[i] for i in range(min(n, len(dataset)))]
    spec = config_specs(cfg)[:1]  # the first reward function, as in training (none beside an environment's reward)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    greedy, sampled = _Scores(), _Scores()
    lengths, t0 = [], time.time()
    greedy_params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    with RewardRunner(spec, workers=cfg.rewards.workers, timeout_s=cfg.rewards.timeout_s,
                      allow_empty=bool(cfg.env.path)) as runner:
        episodes = Episodes(cfg.env, tok, engine.stop_ids, cfg.data.system_prompt) if cfg.env.on else None
        try:
            for i in range(0, len(examples), batch_size):
                chunk = examples[i:i + batch_size]
                if episodes is None:
                    ids = encode_prompts(tok, chunk, cfg.data.system_prompt)
                else:
                    ids = episodes.encode(chunk)
                lengths += greedy.add(_sample(engine, episodes, runner, chunk, ids, 1, greedy_params, None)).tolist()
                if samples > 0:
                    sampled.add(_sample(engine, episodes, runner, chunk, ids, samples, params, gen), per=samples)
        finally:
            if episodes is not None:
                episodes.close()
    out = {"model": model_name or cfg.model.name, "task": cfg.data.task, "n": len(examples),
           "greedy_accuracy": greedy.accuracy(), "samples": samples, "wall_s": round(time.time() - t0, 1)}
    if episodes is not None:
        out.update(greedy_reward=greedy.reward(), greedy_turns=greedy.turns())
    if lengths:  # completion tokens of the greedy responses (the stop token included)
        q = torch.tensor(lengths, dtype=torch.float).quantile(torch.tensor([0.1, 0.5, 0.9])).tolist()
        out.update(greedy_len_p10=q[0], greedy_len_median=q[1], greedy_len_p90=q[2], greedy_len_max=max(lengths),
                   greedy_truncated=sum(n >= cfg.rollout.max_new_tokens for n in lengths) / len(lengths))
    if samples > 0:
        out["pass@1"] = sampled.accuracy()
        if episodes is not None:
            out.update(reward=sampled.reward(), turns=sampled.turns())
    return out


class _Scores:
    """The scores of an evaluation's rows so far: correct (>= 1), reward (NaN: the environment failed) and turns."""

    def __init__(self):
        self.correct: list[float] = []
        self.rewards: list[float] = []
        self.n_turns: list[float] = []

    def add(self, scored: tuple[torch.Tensor, list[int], torch.Tensor], per: int = 1) -> torch.Tensor:
        """Rows' ``(total, turns, lengths)``; ``per`` samples of an example make one pass@1 value. Gives the lengths."""
        total, turns, lengths = scored
        self.correct += (total >= 1).float().view(-1, per).mean(-1).tolist()  # NaN >= 1 is False: a failure is wrong
        self.rewards += total.tolist()
        self.n_turns += turns
        return lengths

    def accuracy(self) -> float:
        return sum(self.correct) / max(len(self.correct), 1)

    def reward(self) -> float:
        """The mean reward over the rows whose environment did not fail."""
        ok = [r for r in self.rewards if r == r]
        return sum(ok) / max(len(ok), 1)

    def turns(self) -> float:
        return sum(self.n_turns) / max(len(self.n_turns), 1)


def _sample(engine, episodes: Episodes | None, runner: RewardRunner, chunk: list, ids: list[list[int]], n: int,
            params: SamplingParams, gen: torch.Generator | None) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """``n`` completions (or trajectories) of each prompt, scored: their totals, assistant turns and lengths."""
    rows = [ex for ex in chunk for _ in range(n)]
    if episodes is None:
        rollout = engine.generate(ids, n, params, generator=gen)
        return runner.score(rollout.texts, rows).total.float(), [1] * len(rows), rollout.lengths
    rollout, episode = episodes.run(engine, chunk, ids, n, params, gen)
    total = episode.rewards
    if runner.specs:
        total = total + runner.score(rollout.texts, rows).total.float()
    return total, [t.turns for t in episode.trajectories], rollout.lengths
