"""The components of a run, built from its config in the order the weights require: the model loaded and prepared,
the rollout engine's copy of it, then the holding (which may shard or adapt the policy in place), the actor, the
reward workers (started first, in the background) and the collect stage. The loop sequences them; the probe builds
them too.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from gspo.collect import Collector
from gspo.collect.sampler import collector as build_collector, cuda_init, engine_for, reward_runner
from gspo.config import Config
from gspo.models import load_model
from gspo.parallel.holding import hold
from gspo.parallel.strategy import choose as choose_strategy
from gspo.rewards.runner import RewardRunner
from gspo.rollout import RolloutEngine
from gspo.runtime import Runtime, precision_name, seed_everything
from gspo.train.actor import Actor, prepare_model
from gspo.train.passes import as_fsdp_forward

log = logging.getLogger("gspo")


@dataclass
class Parts:
    """The components of a run, built from its config: what the loop sequences (the probe uses them too)."""

    runtime: Runtime
    actor: Actor
    tokenizer: object
    engine: RolloutEngine
    collector: Collector
    rewards: RewardRunner


def build(cfg: Config, runtime: Runtime, timings: dict[str, float] | None = None, *, sampling: bool = True) -> Parts:
    """Model, actor, engine, reward workers and collect stage for ``cfg``; ``timings`` gets the seconds of each.
    ``sampling=False``: a trainer of a job with decode processes, which sample for it (no engine, reward workers,
    data or collect stage here: ``engine``, ``collector`` and ``rewards`` are None)."""
    timings = {} if timings is None else timings
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 3)
        clock = now

    seed_everything(cfg.seed)
    rewards = reward_runner(cfg) if sampling else None  # starts in the background
    lap("reward_functions")
    try:
        cuda_init(runtime)
        lap("cuda_init")
        model, tokenizer = load_model(cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(runtime.device))
        lap("model_load")
        ref_model, routing = prepare_model(cfg, runtime, model)
        strategy = choose_strategy(cfg, model, runtime.device, runtime.world_size)
        lap("actor")
        # Under FSDP, with LoRA, and with rounded engine weights, the engine takes its own copy of the plain weights
        # before the holding shards or adapts the policy; it is fed the gathered, merged or rounded weights after every
        # optimizer step.
        engine = None
        if sampling:
            engine = engine_for(cfg, model, tokenizer, runtime,
                                # (and with asynchronous rollouts, which sample while the update changes the policy)
                                replica=(strategy == "fsdp" or cfg.lora.rank > 0 or cfg.rollout.engine_weight_bits > 0
                                         or cfg.rollout.max_staleness > 0),
                                # R3 replays the experts that sampled each token: the engine records them
                                routing=routing if cfg.moe.routing_replay == "rollout" else None)
        holding = hold(strategy, model, runtime, cfg, ref_model=ref_model, prepare_forward=as_fsdp_forward)
        lap("engine")
        critic = None
        if cfg.loss.advantage_baseline == "critic":
            critic = _critic(cfg, runtime, tokenizer, strategy)
            lap("critic")
        actor = Actor(cfg, runtime, model, holding, ref_model=ref_model, routing=routing, critic=critic)
        collector = build_collector(cfg, runtime, tokenizer, engine, rewards, runtime.rank) if sampling else None
        lap("data")
    except BaseException:
        if rewards is not None:
            rewards.close()
        raise
    return Parts(runtime, actor, tokenizer, engine, collector, rewards)


def _critic(cfg: Config, runtime: Runtime, tokenizer, strategy: str):
    """PPO's value model, held as the policy is: ``ppo.critic_model``, else a copy of the policy's starting weights
    (see :func:`gspo.train.critic.hold_value_model`)."""
    from gspo.models.value import load_value_model
    from gspo.train.critic import hold_value_model

    model = load_value_model(cfg.ppo.critic_model or cfg.model.name, runtime.device, tokenizer,
                             tokenizer_name=None if cfg.ppo.critic_model else cfg.model.tokenizer)
    return hold_value_model(cfg, runtime, model, strategy)


def describe_run(cfg: Config, runtime: Runtime, run_dir: Path, resume: bool) -> str:
    """The start-up line: algorithm, task, model, device, precision (and why, on a CPU), batch shape and length."""
    r, t = cfg.rollout, cfg.train
    where = runtime.device.type if runtime.world_size == 1 else f"{runtime.world_size} x {runtime.device.type}"
    if r.decode_processes:
        where += f" + {r.decode_processes} decode process{'es' if r.decode_processes > 1 else ''}"
        where += " on the trainer's GPU" if r.decode_gpu == "shared" and runtime.device.type == "cuda" else ""
    precision = precision_name(runtime.autocast)
    if runtime.device.type == "cpu" and cfg.model.precision == "auto":
        precision += " (this CPU has native bf16)" if runtime.autocast else " (this CPU has no native bf16)"
    batches = -(-t.steps // t.minibatches)
    return (f"{'resuming' if resume else 'training'} {cfg.algorithm} on {cfg.data.task} with {cfg.model.name} on "
            f"{where}, {precision}; {r.prompts_per_batch} prompts x {r.group_size} completions "
            f"of up to {r.max_new_tokens} tokens a rollout batch, {t.steps} optimizer steps ({batches} rollout "
            f"batch{'es' if batches != 1 else ''} x {t.minibatches} minibatches); run directory {run_dir}")
