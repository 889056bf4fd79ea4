"""Evaluation: greedy accuracy and pass@1 averaged over k samples on a dataset split."""
from __future__ import annotations

import time
from typing import Any

import torch

from gspo.config import Config
from gspo.data import build_dataset, dataset_args, default_reward
from gspo.models import load_model, stop_token_ids
from gspo.prompts import encode_prompts
from gspo.rewards.runner import RewardRunner, RewardSpec
from gspo.rollout import make_engine
from gspo.runtime import Runtime
from gspo.types import SamplingParams


def evaluate(cfg: Config, *, model_name: str | None = None, n: int = 200, samples: int = 4, batch_size: int = 64) -> dict[str, Any]:
    """Score the first ``n`` examples of the configured data: greedy accuracy and pass@1 over ``samples`` draws.

    A completion counts as correct when the first reward function gives it >= 1. The greedy responses' lengths (in
    tokens: 10th, 50th and 90th percentiles, longest, share that hit ``rollout.max_new_tokens``) come with it.
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
    spec = [RewardSpec(r.path, r.weight, r.name) for r in cfg.rewards.functions[:1]] or [RewardSpec(default_reward(cfg.data.task))]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    greedy_ok, sampled_ok, lengths, t0 = [], [], [], time.time()
    with RewardRunner(spec, workers=cfg.rewards.workers, timeout_s=cfg.rewards.timeout_s) as runner:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            ids = encode_prompts(tok, chunk, cfg.data.system_prompt)
            greedy = engine.generate(ids, 1, SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True))
            greedy_ok += (runner.score(greedy.texts, chunk).total >= 1).tolist()
            lengths += greedy.lengths.tolist()
            if samples > 0:
                params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
                sampled = engine.generate(ids, samples, params, generator=gen)
                rows = [ex for ex in chunk for _ in range(samples)]
                sampled_ok += (runner.score(sampled.texts, rows).total >= 1).float().view(-1, samples).mean(-1).tolist()
    out = {"model": model_name or cfg.model.name, "task": cfg.data.task, "n": len(examples),
           "greedy_accuracy": sum(greedy_ok) / max(len(greedy_ok), 1), "samples": samples, "wall_s": round(time.time() - t0, 1)}
    if lengths:  # completion tokens of the greedy responses (the stop token included)
        q = torch.tensor(lengths, dtype=torch.float).quantile(torch.tensor([0.1, 0.5, 0.9])).tolist()
        out.update(greedy_len_p10=q[0], greedy_len_median=q[1], greedy_len_p90=q[2], greedy_len_max=max(lengths),
                   greedy_truncated=sum(n >= cfg.rollout.max_new_tokens for n in lengths) / len(lengths))
    if samples > 0:
        out["pass@1"] = sum(sampled_ok) / max(len(sampled_ok), 1)
    return out
