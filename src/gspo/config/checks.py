"""Which values a config may take: one ``check_<section>(cfg)`` per section of the schema, the guards on settings of
different sections that are fine alone but not together, and the warnings about legal but surprising settings, all
run by :func:`validate` once the preset has filled the config.

Every refusal is one UserError naming the key, its value and the fix. Where the module that acts on a key lists the
values it takes (the loss levels and aggregations, the advantage scales, the engines, the precisions), the check reads
that list, so the two cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import string
from typing import Any

from gspo.algorithms.advantages import BASELINES, SCALES
from gspo.algorithms.corrections import CORRECTIONS
from gspo.algorithms.losses import AGGREGATIONS, LEVELS, OBJECTIVE_LEVELS, OBJECTIVES
from gspo.config.presets import TASK_STEP_CREDIT
from gspo.config.schema import Config
from gspo.envs.tools import FORMATS as TOOL_FORMATS
from gspo.errors import UserError
from gspo.parallel.strategy import STRATEGIES
from gspo.runtime import PRECISIONS
from gspo.types import ENGINES, FUSED_STEPS

log = logging.getLogger("gspo")


def _one_of(value: Any, valid: tuple[str, ...], key: str) -> None:
    if value not in valid:
        raise UserError(f"{key} = {value!r} is not one of {', '.join(valid)}; pick one of those.")


def _each_valid(rows: tuple[tuple[bool, str, Any, str], ...]) -> None:
    """``(ok, key, value, fix)`` rows: the first that is not ok is refused."""
    for ok, key, value, fix in rows:
        if not ok:
            raise UserError(f"{key} = {value} is invalid; {fix}.")


def _at_least_one(*pairs: tuple[str, int]) -> None:
    for key, value in pairs:
        if value < 1:
            raise UserError(f"{key} = {value} must be at least 1.")


def _installed(package: str) -> bool:
    """Whether ``package`` is importable, found without importing it (a stray ``./wandb`` folder of W&B runs is a
    namespace package without an origin, not the package)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


# --------------------------------------------------------------------------------------------- one section each


def check_sentinel(cfg: Config) -> None:
    sc = cfg.sentinel
    _each_valid(((sc.window >= 1, "sentinel.window", sc.window, "use 1 or more rollout batches"),
                 (0 < sc.lr_factor <= 1, "sentinel.lr_factor", sc.lr_factor, "use a factor in (0, 1]"),
                 (sc.max_rollbacks >= 0, "sentinel.max_rollbacks", sc.max_rollbacks, "use 0 or more"),
                 (min(sc.entropy_min, sc.reward_drop, sc.seq_ratio_log_max) >= 0, "sentinel thresholds",
                  (sc.entropy_min, sc.reward_drop, sc.seq_ratio_log_max), "use 0 (off) or a positive value"),
                 (0 <= sc.truncated_max < 1, "sentinel.truncated_max", sc.truncated_max,
                  "use 0 (off) or a fraction below 1")))
    _one_of(sc.action, ("warn", "stop", "rollback"), "sentinel.action")
    if sc.action in ("stop", "rollback") and not (sc.entropy_min or sc.reward_drop or sc.seq_ratio_log_max
                                                 or sc.truncated_max):
        raise UserError(f"sentinel.action = {sc.action!r} with every detector off (sentinel.reward_drop, entropy_min, "
                        "seq_ratio_log_max and truncated_max are 0) never acts; turn one on, e.g. "
                        "sentinel.reward_drop = 0.3.")


def check_log(cfg: Config) -> None:
    lg = cfg.log
    _each_valid(((lg.trace_every >= 0 and lg.trace_samples >= 0, "log.trace_every / log.trace_samples",
                  (lg.trace_every, lg.trace_samples), "use 0 (off) or a positive count"),
                 (lg.profile_batch >= 0, "log.profile_batch", lg.profile_batch,
                  "use 0 (off) or the 1-based index of a rollout batch")))
    for key, on, package in (("log.tensorboard", lg.tensorboard, "tensorboard"), ("log.wandb", lg.wandb, "wandb")):
        if on and not _installed(package):
            raise UserError(f"{key} = true but the {package} package is not installed; pip install 'gspo[{package}]', "
                            f"or set {key} = false.")
    _check_run_dir(cfg)
    if lg.checkpoint_every < 0 or lg.samples_per_batch < 0 or lg.keep_checkpoints < 0:
        raise UserError("log.checkpoint_every, log.samples_per_batch and log.keep_checkpoints must be >= 0 (0 turns the "
                        "first two off and keeps every checkpoint).")
    if lg.wandb and not lg.wandb_project:
        raise UserError("log.wandb_project is empty; name the W&B project, e.g. log.wandb_project = 'gspo'.")


def _check_run_dir(cfg: Config) -> None:
    """``log.run_dir`` is formatted with the algorithm and seed: any other placeholder (or a stray brace) would fail
    only when the run starts."""
    run_dir = cfg.log.run_dir
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(run_dir) if f is not None]
        run_dir.format(algorithm=cfg.algorithm, seed=cfg.seed)
        bad = [f for f in fields if f not in ("algorithm", "seed")]
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        bad = [str(e)]
    if bad:
        raise UserError(f"log.run_dir = {run_dir!r} has a placeholder gspo does not fill ({', '.join(bad)}); use "
                        "{algorithm} and {seed} only (double a brace to write one).")


def check_device(device: str) -> None:
    """``model.device`` names a device gspo runs on (checked before the device is looked up: see load_config)."""
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise UserError(f"model.device = {device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'.")


def check_model(cfg: Config) -> None:
    m = cfg.model
    check_device(m.device)
    _one_of(m.precision, PRECISIONS, "model.precision")
    if m.gpu_memory is not None and not 0 < m.gpu_memory <= 1:
        raise UserError(f"model.gpu_memory = {m.gpu_memory} must be a share of the GPU in (0, 1], e.g. 0.25, or unset "
                        "for the whole GPU.")


def check_run(cfg: Config) -> None:
    """The keys outside every section: the seed (the algorithm is checked where its preset is applied)."""
    if not 0 <= cfg.seed < 2**63:
        raise UserError(f"seed = {cfg.seed} must be in 0 .. 2**63 - 1.")


def check_train(cfg: Config) -> None:
    """The optimizer and the passes; how the batch divides into steps is :func:`check_batch_shape`."""
    t = cfg.train
    _at_least_one(("train.logprob_chunk", t.logprob_chunk), ("train.max_nonfinite_steps", t.max_nonfinite_steps))
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise UserError(f"train.adam_betas = {t.adam_betas} must be two numbers in [0, 1), e.g. [0.9, 0.99].")
    if not t.lr > 0 or t.weight_decay < 0 or t.max_grad_norm < 0 or t.warmup_steps < 0:
        raise UserError("train.lr must be > 0, and train.weight_decay, train.max_grad_norm and train.warmup_steps >= 0 "
                        f"(got {t.lr}, {t.weight_decay}, {t.max_grad_norm}, {t.warmup_steps}).")
    _one_of(t.old_logprobs, ("recompute", "rollout"), "train.old_logprobs")
    _one_of(t.packing, ("auto", "on", "off"), "train.packing")
    _one_of(t.cuda_graphs, ("auto", "off"), "train.cuda_graphs")
    _one_of(t.schedule, ("constant", "linear", "cosine"), "train.schedule")


def check_data(cfg: Config) -> None:
    _at_least_one(("data.max_prompt_tokens", cfg.data.max_prompt_tokens))
    _one_of(cfg.data.long_prompts, ("skip", "fail"), "data.long_prompts")


def check_rewards(cfg: Config) -> None:
    rw = cfg.rewards
    if not rw.timeout_s > 0 or rw.workers < 0:
        raise UserError(f"rewards.timeout_s = {rw.timeout_s} must be > 0 and rewards.workers = {rw.workers} >= 0.")
    for fn in rw.functions:
        if ":" not in fn.path:
            raise UserError(f"Reward path {fn.path!r} must be 'module:function', e.g. "
                            "'gspo.rewards.builtin:last_number'.")


def check_env(cfg: Config) -> None:
    """``[env]``: the multi-turn settings, and what multi-turn rows cannot run with yet (each refusal names why)."""
    env = cfg.env
    _one_of(env.tool_format, TOOL_FORMATS, "env.tool_format")
    _each_valid(((env.max_turns >= 1, "env.max_turns", env.max_turns, "use 1 or more"),
                 (env.max_turn_tokens >= 0, "env.max_turn_tokens", env.max_turn_tokens,
                  "use 0 (rollout.max_new_tokens) or a positive count"),
                 (env.workers >= 0, "env.workers", env.workers, "use 0 (in-process) or more"),
                 (env.timeout_s > 0, "env.timeout_s", env.timeout_s, "use a positive number of seconds")))
    named = [("env.path", env.path)] * bool(env.path) + [("env.renderer", env.renderer)] * bool(env.renderer)
    for key, path in named + [("env.tools", p) for p in env.tools]:
        if not isinstance(path, str) or ":" not in path:
            raise UserError(f"{key} entry {path!r} must be 'module:name', e.g. 'gspo.envs.builtin:calculator'.")
    if not env.on:
        if env.renderer:
            raise UserError("env.renderer sets the chat format of multi-turn rows, and there are none; set env.path or "
                            "env.tools, or unset env.renderer.")
        return
    if cfg.loss.step_credit not in (None, "env"):
        raise UserError(f"loss.step_credit = {cfg.loss.step_credit!r} splits one reply into steps, not a multi-turn "
                        "row; with env.path use loss.step_credit = 'env' (each turn credited with its step reward), "
                        "or leave it unset.")


def check_loss(cfg: Config) -> None:
    lc = cfg.loss
    _one_of(lc.level, LEVELS, "loss.level")
    _one_of(lc.aggregation, AGGREGATIONS, "loss.aggregation")
    _one_of(lc.advantage_scale, SCALES, "loss.advantage_scale")
    _one_of(lc.advantage_baseline, BASELINES, "loss.advantage_baseline")
    if lc.step_credit is not None and lc.advantage_baseline != "critic" and (
            lc.advantage_scale == "tokens" or lc.advantage_baseline != "group_mean"):
        raise UserError(f"loss.step_credit adds process credit to group-centred advantages (or, with PPO, token rewards "
                        f"to GAE), and loss.advantage_scale = {lc.advantage_scale!r} with loss.advantage_baseline = "
                        f"{lc.advantage_baseline!r} is neither (RLOO, REINFORCE++); use a GRPO-family preset or "
                        "algorithm = 'ppo', or unset loss.step_credit.")
    if lc.advantage_baseline == "critic":
        if lc.level == "sequence":
            raise UserError(f"loss.advantage_baseline = 'critic' (PPO's GAE) gives per-token advantages, which "
                            f"{'GMPO' if lc.objective == 'gmpo' else 'a sequence-level ratio'} cannot take; use "
                            "loss.level = 'token' or 'sequence_token'.")
        if lc.advantage_scale not in ("tokens", "none"):
            raise UserError(f"loss.advantage_baseline = 'critic' (PPO's GAE) gives per-token advantages, which "
                            f"loss.advantage_scale = {lc.advantage_scale!r} (a group's or batch's reward spread) does not "
                            "scale; use 'tokens' (whitened over the loss tokens, as verl) or 'none'.")
        p = cfg.ppo
        _each_valid(((0 <= p.gamma <= 1, "ppo.gamma", p.gamma, "use a discount in [0, 1]"),
                     (0 <= p.lam <= 1, "ppo.lam", p.lam, "use a lambda in [0, 1]"),
                     (p.value_clip >= 0, "ppo.value_clip", p.value_clip, "use 0 (no clipping) or a positive value"),
                     (p.critic_lr > 0, "ppo.critic_lr", p.critic_lr, "use a learning rate > 0"),
                     (p.critic_warmup >= 0, "ppo.critic_warmup", p.critic_warmup, "use 0 or more rollout batches")))
        if cfg.rollout.decode_processes:
            raise UserError("loss.advantage_baseline = 'critic' (PPO) with rollout.decode_processes is not built: the "
                            "trainers compute the values, the decode processes the batches; set "
                            "rollout.decode_processes = 0.")
        if cfg.dapo.dynamic_sampling:
            raise UserError("dapo.dynamic_sampling drops the groups whose rewards are all equal as carrying no signal, "
                            "but with a value model (PPO) they do: GAE gives their tokens advantages from the values, "
                            "and they train the value model; set dapo.dynamic_sampling = false.")
    if lc.level != "token" and lc.aggregation != "seq-mean-token-mean" and not lc.allow_length_weighted_sequence:
        raise UserError(
            f"loss.level = {lc.level!r} with loss.aggregation = {lc.aggregation!r} weights every sequence by its "
            "length (TRL #3823); use aggregation 'seq-mean-token-mean', or set loss.allow_length_weighted_sequence = true."
        )
    _one_of(lc.objective, OBJECTIVES, "loss.objective")
    if lc.level not in OBJECTIVE_LEVELS[lc.objective]:
        raise UserError(f"loss.objective = {lc.objective!r} is defined at loss.level = "
                        f"{' or '.join(repr(v) for v in OBJECTIVE_LEVELS[lc.objective])}, not {lc.level!r}; set that "
                        f"level, or use algorithm = {lc.objective!r}, which sets it.")
    # gmpo clips log-ratios (any eps_low >= 0 keeps e^-eps_low > 0); cispo's eps_low = 1 is "no lower bound" (w >= 0)
    low_ok, low_rule = {"gmpo": (lc.eps_low >= 0, ""), "cispo": (0 <= lc.eps_low <= 1, " <= 1")}.get(
        lc.objective, (0 <= lc.eps_low < 1, " < 1"))
    if not low_ok or lc.eps_high < 0:
        raise UserError(f"Clip ranges must satisfy 0 <= loss.eps_low{low_rule} and loss.eps_high >= 0 with "
                        f"loss.objective = {lc.objective!r} (got {lc.eps_low}, {lc.eps_high}).")
    if lc.sapo_tau is not None and (lc.objective != "sapo" or len(lc.sapo_tau) != 2
                                    or not all(t > 0 for t in lc.sapo_tau)):
        raise UserError(f"loss.sapo_tau = {lc.sapo_tau} must be two temperatures > 0, [tau_pos, tau_neg], and only with "
                        f"loss.objective = 'sapo' (it is {lc.objective!r}).")
    if lc.beta < 0:
        raise UserError(f"loss.beta = {lc.beta} must be >= 0.")
    _one_of(lc.mismatch_correction, CORRECTIONS, "loss.mismatch_correction")
    if lc.mismatch_correction == "off" and lc.mismatch_bounds is not None:
        raise UserError(f"loss.mismatch_bounds = {lc.mismatch_bounds} is set but loss.mismatch_correction = 'off'; pick "
                        "a correction ('tis', 'sequence_mask', 'icepop') or leave the bounds unset.")
    b = lc.mismatch_bounds
    if b is not None and (len(b) != 2 or not 0 <= b[0] < b[1]):
        raise UserError(f"loss.mismatch_bounds = {b} must be [low, high] with 0 <= low < high, e.g. [0.5, 5.0].")
    if lc.mismatch_correction != "off" and cfg.train.old_logprobs != "recompute":
        raise UserError(f"loss.mismatch_correction = {lc.mismatch_correction!r} weighs the recomputed old policy against "
                        "the engine's log-probs, but train.old_logprobs = 'rollout' makes them one and the same (every "
                        "weight 1); set train.old_logprobs = 'recompute'.")


def check_lora(cfg: Config) -> None:
    lo = cfg.lora
    if lo.rank < 0 or (lo.rank and not lo.alpha > 0) or not lo.target_modules:
        raise UserError(f"lora.rank = {lo.rank}, lora.alpha = {lo.alpha}, lora.target_modules = {lo.target_modules}: the "
                        "rank must be >= 0 (0 = full fine-tuning), alpha > 0, and at least one target module named.")
    if lo.rank and lo.dropout != 0:
        raise UserError(f"lora.dropout = {lo.dropout}: dropout must stay off in RL (the update must see the policy "
                        "that computed the old log-probs, as gspo turns off the model's own dropout); set it to 0.")


def check_rollout(cfg: Config) -> None:
    r = cfg.rollout
    _one_of(r.engine, ENGINES, "rollout.engine")
    _one_of(r.fused_step, FUSED_STEPS, "rollout.fused_step")
    _one_of(r.compact_rows, ("auto", "off"), "rollout.compact_rows")
    if not (r.engine_weight_bits == 0 or 2 <= r.engine_weight_bits <= 16):
        raise UserError(f"rollout.engine_weight_bits = {r.engine_weight_bits} must be 0 (off) or 2-16, e.g. 8.")
    if r.group_size < 2:
        if cfg.loss.advantage_baseline == "critic":  # the value model is the baseline: the reason is gspo's own
            raise UserError(f"rollout.group_size = {r.group_size} is not supported with a value model (PPO) yet: its "
                            "baseline needs no group, but gspo's collect stage samples and reports in groups; use 2 or "
                            "more.")
        raise UserError(f"rollout.group_size = {r.group_size} leaves no group to compare against; use 2 or more (the paper uses 8+).")
    if r.prompts_per_batch < 1 or r.max_new_tokens < 1:
        raise UserError("rollout.prompts_per_batch and rollout.max_new_tokens must be at least 1.")
    if r.temperature <= 0:
        raise UserError(f"rollout.temperature = {r.temperature} must be > 0 for sampling; use e.g. 1.0.")
    if not 0 < r.top_p <= 1 or r.top_k < 0:
        raise UserError("rollout.top_p must be in (0, 1] and rollout.top_k >= 0 (0 disables it).")
    if not 0 < r.vllm_gpu_memory < 1:
        raise UserError(f"rollout.vllm_gpu_memory = {r.vllm_gpu_memory} must be a share of the GPU in (0, 1), e.g. 0.3.")
    _one_of(r.overlap, ("thread", "off"), "rollout.overlap")
    if r.max_staleness < 0:
        raise UserError(f"rollout.max_staleness = {r.max_staleness!r} must be a whole number of rollout batches >= 0 "
                        "(0: synchronous; 1: the engine samples the next batch while the actor trains this one).")
    _one_of(r.in_flight, ("off", "keep", "recompute"), "rollout.in_flight")
    if r.in_flight != "off":
        why = ("rollout.max_staleness = 0 samples every batch with the newest policy already" if not r.max_staleness
               else "rollout.overlap = 'off' collects while the actor is idle, so no version is published mid-batch"
               if r.overlap != "thread"
               else "decode processes take new weights between batches only" if r.decode_processes
               else "multi-turn rows (env.path, env.tools) would mix versions across turns"
               if cfg.env.path or cfg.env.tools
               else "R3 would replay routes that a swap makes stale" if cfg.moe.routing_replay == "rollout"
               else None)
        if why:
            raise UserError(f"rollout.in_flight = {r.in_flight!r} is not built for this run: {why}; set "
                            "rollout.in_flight = 'off'.")
    if r.decode_processes < 0:
        raise UserError(f"rollout.decode_processes = {r.decode_processes!r} must be a whole number of processes >= 0 "
                        "(0: every process samples and trains).")
    if r.decode_processes and not r.max_staleness:
        raise UserError(f"rollout.decode_processes = {r.decode_processes} with rollout.max_staleness = 0: decode "
                        "processes sample ahead of the update, which needs a lag; set rollout.max_staleness = 1 (or "
                        "more).")
    _one_of(r.decode_gpu, ("own", "shared"), "rollout.decode_gpu")
    if r.decode_gpu == "shared" and not r.decode_processes:
        raise UserError("rollout.decode_gpu = 'shared' places decode processes, and this run has none; set "
                        "rollout.decode_processes = 1 (or more), or leave rollout.decode_gpu = 'own'.")
    if r.decode_processes and cfg.moe.routing_replay == "rollout":
        raise UserError("rollout.decode_processes with moe.routing_replay = 'rollout' (R3) is not built: the routes "
                        "the engine records would have to travel with the batch; use routing_replay = 'old' (R2) or "
                        "'off', or set rollout.decode_processes = 0.")
    if r.max_staleness and r.overlap == "thread" and r.engine == "vllm":
        raise UserError("rollout.max_staleness > 0 with rollout.overlap = 'thread' and rollout.engine = 'vllm': vLLM "
                        "is not run from a background thread here; set rollout.overlap = 'off', or rollout.engine = "
                        "'auto'.")
    share = cfg.model.gpu_memory
    if r.engine == "vllm" and share is not None and r.vllm_gpu_memory >= share:
        raise UserError(f"rollout.vllm_gpu_memory = {r.vllm_gpu_memory} is a share of the whole GPU and must be below "
                        f"model.gpu_memory = {share}, the run's own share (vLLM's part is taken from it); lower the first "
                        "or raise the second.")


def check_moe(cfg: Config) -> None:
    _one_of(cfg.moe.routing_replay, ("off", "old", "rollout"), "moe.routing_replay")
    if cfg.moe.router_aux_loss_coef < 0:
        raise UserError(f"moe.router_aux_loss_coef = {cfg.moe.router_aux_loss_coef} must be >= 0 (0 turns it off).")


def check_dist(cfg: Config) -> None:
    _one_of(cfg.dist.strategy, STRATEGIES, "dist.strategy")
    if not cfg.dist.timeout_s > 0:
        raise UserError(f"dist.timeout_s = {cfg.dist.timeout_s} must be > 0 seconds (e.g. 600).")


def check_dapo(cfg: Config) -> None:
    """The punishment ramp must fit in the completion (its bound is rollout.max_new_tokens)."""
    d, limit = cfg.dapo, cfg.rollout.max_new_tokens
    if d.overlong_penalty and not 0 < d.overlong_cache <= limit:
        raise UserError(f"dapo.overlong_cache = {d.overlong_cache} must be in 1..rollout.max_new_tokens ({limit}).")


# --------------------------------------------------------------------------------------------- across sections


def check_step_credit(cfg: Config) -> None:
    """``loss.step_credit = "task"`` needs a task that has steps, and any step credit a token-level ratio. The task
    is checked first: with both wrong, naming a function is the fix the user needs before choosing a ratio."""
    lc = cfg.loss
    if lc.step_credit == "env" and not cfg.env.path:
        raise UserError("loss.step_credit = 'env' credits each turn with the reward env.path's step() gives it; set "
                        "env.path, or name a 'module:function' step credit instead.")
    if lc.step_credit == "task" and cfg.data.task not in TASK_STEP_CREDIT:
        raise UserError(f"loss.step_credit = 'task': data.task = {cfg.data.task!r} has no built-in step credit (only "
                        f"{', '.join(TASK_STEP_CREDIT)} do); name a 'module:function' instead.")
    if lc.step_credit is not None and lc.level == "sequence":
        raise UserError(f"loss.step_credit gives per-token advantages, which {cfg.algorithm}'s sequence-level ratio "
                        "cannot take (one advantage per sequence); use algorithm = 'gspo_token' (GSPO-token) or a "
                        "token-level preset such as 'grpo'.")


def check_exact(cfg: Config) -> None:
    """``rollout.exact``: one forward shared by the graph engine and the trainer; what it is not built with is
    refused here, before anything loads (the model's own limits are checked when the engine is built)."""
    r = cfg.rollout
    if not r.exact:
        return
    refusals = (
        (r.engine not in ("graph", "auto"), f"rollout.engine = {r.engine!r} (its kernels are not the trainer's)",
         "set rollout.engine = 'graph'"),
        (r.fused_step == "off", "rollout.fused_step = 'off' (the module step is not batch-invariant)",
         "set rollout.fused_step = 'auto'"),
        (r.engine_weight_bits > 0, f"rollout.engine_weight_bits = {r.engine_weight_bits} (a deliberate gap)",
         "set rollout.engine_weight_bits = 0"),
        (cfg.lora.rank > 0, "LoRA (the exact pass reads plain weights, not adapters)", "set lora.rank = 0"),
        (cfg.dist.strategy == "fsdp", "dist.strategy = 'fsdp' (the exact pass needs whole weights)",
         "set dist.strategy = 'ddp'"),
        (r.in_flight == "recompute", "rollout.in_flight = 'recompute' (it rewrites caches on the module path)",
         "set rollout.in_flight = 'keep' or 'off'"),
        (cfg.moe.routing_replay != "off", f"moe.routing_replay = {cfg.moe.routing_replay!r} (under exact the "
         "gradient pass forces the exact pass's own routes)",
         "set moe.routing_replay = 'off'"),
    )
    for refused, what, fix in refusals:
        if refused:
            raise UserError(f"rollout.exact is not built for {what}; {fix}, or set rollout.exact = false.")


def check_old_logprobs(cfg: Config) -> None:
    """The old policy's log-probs must come from where the other settings need them."""
    r, t = cfg.rollout, cfg.train
    if cfg.moe.routing_replay == "old" and t.old_logprobs != "recompute":
        raise UserError("moe.routing_replay = 'old' records the experts in the old-policy pass, which "
                        "train.old_logprobs = 'rollout' skips; set train.old_logprobs = 'recompute'.")
    if r.engine == "vllm" and t.old_logprobs == "rollout" and (r.top_p < 1 or r.top_k > 0):
        raise UserError(f"train.old_logprobs = 'rollout' with rollout.engine = 'vllm' and top_p = {r.top_p} / top_k = "
                        f"{r.top_k}: vLLM's log-probs are renormalised over the kept tokens, so the importance ratio "
                        "would be biased; set train.old_logprobs = 'recompute', or top_p = 1 and top_k = 0.")


def check_batch_shape(cfg: Config) -> None:
    """A rollout batch (prompts x group size) splits evenly into minibatches and micro-batches, and the run into whole
    rollout batches. In this order: each check divides by what the one before it guarantees is at least 1."""
    r, t = cfg.rollout, cfg.train
    n = r.prompts_per_batch * r.group_size
    if t.minibatches < 1 or n % t.minibatches:
        raise UserError(
            f"train.minibatches = {t.minibatches} does not divide the {n} completions of a rollout batch "
            f"(prompts_per_batch {r.prompts_per_batch} x group_size {r.group_size}); pick a divisor of {n}."
        )
    if t.steps < t.minibatches or t.steps % t.minibatches:
        raise UserError(f"train.steps = {t.steps} must be a positive multiple of train.minibatches = {t.minibatches}.")
    if t.micro_batch_size < 0 or (t.micro_batch_size and (n // t.minibatches) % t.micro_batch_size):
        raise UserError(f"train.micro_batch_size = {t.micro_batch_size} must divide the minibatch of {n // t.minibatches} sequences (or be 0).")


def warn_surprises(cfg: Config) -> None:
    """Legal settings that do something other than what they seem to: logged, not refused."""
    lc, r, t = cfg.loss, cfg.rollout, cfg.train
    if lc.level != "token" and lc.objective == "clip" and max(lc.eps_low, lc.eps_high) >= 0.05:
        log.warning("loss.eps_* = (%g, %g) on a sequence-level ratio clips almost nothing (TRL #3834); the GSPO "
                    "paper uses (3e-4, 4e-4).", lc.eps_low, lc.eps_high)
    if t.old_logprobs == "rollout" and r.engine_weight_bits:
        log.warning("train.old_logprobs = 'rollout' with rollout.engine_weight_bits = %d: the rounded engine's log-probs "
                    "become the old policy's; on the reference run this collapsed every GSPO run and one GRPO run in "
                    "three at 8 bits (docs/experiments/engine). Recompute them unless the gap is what you study.",
                    r.engine_weight_bits)
    if t.minibatches == 1:
        log.warning("train.minibatches = 1: every update is on-policy, so the importance ratio is always 1 and GSPO, "
                    "GRPO and REINFORCE with a group baseline coincide; use 2+ minibatches to exercise the ratio.")
    if lc.advantage_baseline != "critic":  # (a config shared by gspo compare's arms may set them for its PPO arm)
        changed = [f.name for f in dataclasses.fields(cfg.ppo) if getattr(cfg.ppo, f.name) != f.default]
        if changed:
            log.warning("ppo.%s is set but loss.advantage_baseline = %r trains no value model, so it does nothing in "
                        "this run; algorithm = 'ppo' trains one.", changed[0], lc.advantage_baseline)


# Sections first, in the order their first check ran when this was one function (so a config with several faults
# still names the same first one in most cases), then the guards that need two sections each valid on its own.
CHECKS = (check_sentinel, check_log, check_model, check_run, check_train, check_data, check_rewards, check_loss,
          check_lora, check_rollout, check_moe, check_dist, check_dapo, check_env,
          check_step_credit, check_exact, check_old_logprobs, check_batch_shape)


def validate(cfg: Config) -> None:
    """Refuse invalid combinations with a message that names the fix; warn about legal but surprising ones."""
    for check in CHECKS:
        check(cfg)
    warn_surprises(cfg)
