"""The sampling side of a run, built from its config: the reward workers, the rollout engine (the one place training
calls :func:`gspo.rollout.make_engine`), the data stream and the collect stage. A one-process run builds it beside its
actor (:func:`gspo.train.parts.build`); a decode process builds only this (:func:`build_sampler`).
"""
from __future__ import annotations

import torch

from gspo.collect.stage import Collector
from gspo.config import TASK_STEP_CREDIT, Config
from gspo.data import DataStream, build_dataset, dataset_args
from gspo.envs.episodes import Episodes
from gspo.models import load_model, stop_token_ids
from gspo.rewards.runner import RewardRunner, config_specs
from gspo.rollout import RolloutEngine, make_engine
from gspo.runtime import Runtime, seed_everything


def engine_for(cfg: Config, model, tokenizer, runtime: Runtime, *, replica: bool, routing=None) -> RolloutEngine:
    """The rollout engine for ``cfg`` over ``model``. ``replica``: it takes a copy of the weights of its own (the
    policy is sharded, adapted or rounded for it, or changes while it samples); ``routing``: R3's recorder of the
    experts that sampled each token. An engine that cannot do what the config asks (R3, in-flight updates) is refused
    here, in one line, before it is built."""
    return make_engine(cfg.rollout.engine, model, tokenizer, stop_ids=stop_token_ids(tokenizer, model),
                       device=runtime.device, autocast_dtype=runtime.autocast, fused_step=cfg.rollout.fused_step,
                       compact_rows=cfg.rollout.compact_rows, replica=replica,
                       vllm_gpu_memory=cfg.rollout.vllm_gpu_memory, routing=routing,
                       in_flight=cfg.rollout.in_flight != "off", exact=cfg.rollout.exact)


def build_sampler(cfg: Config, runtime: Runtime, index: int) -> tuple[RolloutEngine, Collector]:
    """A decode process's parts (``rollout.decode_processes``): the policy's architecture and first weights in an
    engine of its own, the reward workers, the data stream and the collect stage, sampling with the stream of
    ``index`` (its place among the decode processes: the first one's is a one-process run's). No actor: the trainers
    send the weights. Returns the engine and the collect stage."""
    seed_everything(cfg.seed)
    rewards = reward_runner(cfg)
    try:
        cuda_init(runtime)
        model, tokenizer = load_model(cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(runtime.device))
        model.to(runtime.device)
        # the hf engine samples from a copy of its own, which the weights the trainers send are written into
        engine = engine_for(cfg, model, tokenizer, runtime, replica=True)
        return engine, collector(cfg, runtime, tokenizer, engine, rewards, index)
    except BaseException:
        rewards.close()
        raise


def reward_runner(cfg: Config) -> RewardRunner:
    """The reward workers (started in the background)."""
    # An environment's own rewards need no reward function; otherwise the task's verifier is the default one
    specs = config_specs(cfg)
    # loss.step_credit = "env": the turns' rewards come with the rollout, no function to run in the workers
    steps = {"task": TASK_STEP_CREDIT.get(cfg.data.task), "env": None}.get(cfg.loss.step_credit, cfg.loss.step_credit)
    return RewardRunner(specs, workers=cfg.rewards.workers if specs or steps else 0, timeout_s=cfg.rewards.timeout_s,
                        steps=steps, allow_empty=bool(cfg.env.path))


def cuda_init(runtime: Runtime) -> None:
    """The CUDA context, on its own line of the start-up timings."""
    if runtime.device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=runtime.device)


def collector(cfg: Config, runtime: Runtime, tokenizer, engine, rewards: RewardRunner, index: int) -> Collector:
    """The collect stage over the run's data stream; it samples with stream ``index`` (each process of a job its
    own: the first one's is the one-process run's). Closes the reward workers if it cannot be built."""
    try:
        stream = DataStream(build_dataset(dataset_args(cfg.data, cfg.seed)), seed=cfg.seed)
        generator = torch.Generator(device=runtime.device).manual_seed(cfg.seed + index)
        episodes = Episodes(cfg.env, tokenizer, engine.stop_ids, cfg.data.system_prompt) if cfg.env.on else None
    except BaseException:
        rewards.close()
        raise
    return Collector(cfg, tokenizer, stream, rewards, engine, generator, episodes)
