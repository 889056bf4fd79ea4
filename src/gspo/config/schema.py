"""Run configuration: dataclasses with a docstring per field, algorithm presets, TOML + dotted overrides, guards.

A config is built in three layers: the dataclass defaults, the TOML file, then ``key=value`` overrides from the
command line (``loss.eps_high=5e-4``). Fields left at ``None`` are filled by the algorithm preset, so choosing
``algorithm = "grpo"`` changes every knob GRPO needs while anything the user set explicitly wins. A TOML table
``[overrides.cpu]`` (or ``[overrides.cuda]``) of dotted keys applies only on that device, which is how the
quickstart runs a small CPU version and the full reference settings on a GPU with one file.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import logging
import math
import re
import string
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.algorithms.advantages import SCALES
from gspo.algorithms.losses import AGGREGATIONS, LEVELS
from gspo.errors import UserError

log = logging.getLogger("gspo")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """HF hub id, local HF directory, path to a .gguf file, or the embedded alias ``smollm2-135m-instruct``."""
    tokenizer: str | None = None
    """Tokenizer directory or id when it differs from the model's (e.g. for a bare GGUF)."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    precision: str = "auto"
    """``auto``: fp32 master weights with bf16 autocast on CUDA and on a CPU with native bf16 (AVX512-BF16, AMX, Arm
    BF16; ~4x faster than fp32 there), plain fp32 on any other CPU (where bf16 is emulated, many times slower);
    ``fp32``; ``bf16-autocast`` (fp32 master weights, bf16 matmuls, on any device). ``GSPO_CPU_BF16=0`` / ``1``
    overrides what is read off the CPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more time per update."""


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """``arithmetic`` (generated ``a op b``), ``running_sum`` (generated: add ``terms`` numbers with every running
    total written out), ``numbered_words`` (generated: number ``terms`` words one per line, then count them; both
    long-response tasks), ``gsm8k`` (JSONL with ``#### answer``), ``math`` (JSONL with ``\\boxed{}``),
    ``jsonl`` (any JSONL with ``prompt_field`` / ``answer_field``) or ``hf`` (a HF dataset, needs ``datasets``)."""
    path: str | None = None
    """Data file (or HF dataset name for ``task = "hf"``)."""
    split: str = "train"
    """Split for ``task = "hf"``."""
    ops: list[str] = field(default_factory=lambda: ["+"])
    """Arithmetic operations to draw from: any of ``+``, ``-``, ``*``."""
    a_range: list[int] = field(default_factory=lambda: [1, 20])
    """Inclusive range of the first arithmetic operand (``running_sum``: of every number added)."""
    b_range: list[int] = field(default_factory=lambda: [1, 20])
    """Inclusive range of the second arithmetic operand."""
    terms: list[int] | None = None
    """``running_sum`` / ``numbered_words``: inclusive range of how many numbers a prompt adds / words it numbers
    (each a line of a correct response); ``None``: the task's default, ``[16, 48]`` / ``[20, 40]``."""
    prompt_field: str | None = None
    """Row field holding the question (``example.prompt``); unset: ``question`` for ``jsonl`` and ``hf``, ``problem``
    for ``math``. ``gsm8k`` always reads ``question``."""
    answer_field: str | None = None
    """Row field holding the reference answer (``example.answer``); unset: ``answer`` for ``jsonl`` and ``hf``; for
    ``math`` ``answer`` when the first row has one, else ``solution``. ``gsm8k`` always reads ``answer``."""
    answer_format: str | None = None
    """How the answer field is read (``jsonl`` and ``hf``): ``raw`` (the default: the field as written, stripped),
    ``gsm8k`` (the number after ``####``) or ``boxed`` (the last ``\\boxed{}``). ``gsm8k`` reads ``gsm8k``; ``math``
    reads ``answer`` raw and ``solution`` boxed."""
    template: str | None = None
    """Prompt template with ``{question}`` and any other field of the row as ``{name}``; unset: ``{question}`` for
    ``jsonl`` and ``hf``, the question with a step-by-step instruction for ``gsm8k`` and ``math``."""
    system_prompt: str | None = None
    """Optional system message; ``None`` keeps the chat template's own default."""
    max_prompt_tokens: int = 512
    """Longest prompt in tokens, after the chat template; longer ones are handled as ``long_prompts`` says."""
    long_prompts: str = "skip"
    """A prompt longer than ``max_prompt_tokens``: ``skip`` it (counted in ``data/skipped_prompts``) or ``fail``."""


@dataclass
class RolloutConfig:
    prompts_per_batch: int = 32
    """P: prompts per rollout batch."""
    group_size: int = 8
    """G: completions sampled per prompt (the group of the group-relative advantage)."""
    max_new_tokens: int = 128
    """Completion length limit; completions that hit it end with finish reason ``length``."""
    temperature: float = 1.0
    """Sampling temperature; log-probabilities are those of softmax(logits / temperature) on both sides."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables it)."""
    top_k: int = 0
    """Top-k sampling (0 disables it)."""
    engine: str = "auto"
    """``graph`` (static KV cache + CUDA graphs), ``hf`` (simple, any model), ``vllm`` (vLLM in this process; ``pip
    install 'gspo[vllm]'``) or ``auto`` (graph on CUDA if supported)."""
    vllm_gpu_memory: float = 0.3
    """With ``engine = "vllm"`` on a GPU: the share of its memory vLLM takes for its weights and KV cache (the rest is
    the trainer's)."""
    fused_step: str = "auto"
    """The graph engine's decode step: ``auto`` (fused Triton kernels on CUDA for Llama / Mistral / Qwen2 / Qwen3 with a
    16-bit cache, and for their MoE relatives Mixtral / Qwen2-MoE / Qwen3-MoE the same kernels around the family's
    sparse block; else the HF modules) or ``off`` (always the HF modules)."""
    compact_rows: str = "auto"
    """The graph engine's decode under CUDA graphs: ``auto`` moves the rows still sampling to a step captured for fewer
    rows (the next power of two, at least 8) when its check every 4 steps finds at most half of the step's rows live (a
    small model's step for 8 rows costs over half of one for 256, which a full step would keep paying for the few
    rows left; the same distribution, another random stream than ``off``), ``off`` runs every step on the whole
    batch."""
    engine_weight_bits: int = 0
    """For experiments on the engine-trainer gap: the rollout engine samples from its copy of the weights with every
    weight matrix rounded to signed integers of this many bits (symmetric, one scale per output row, as weight-only
    int8 inference does); norms and biases are kept. The trainer's weights are untouched; the gap shows in
    ``logprob/engine_diff_*``. 0 (default) = off; 2-16."""


@dataclass
class LossConfig:
    level: str | None = None
    """Importance-ratio level: ``token`` (GRPO), ``sequence`` (GSPO) or ``sequence_token`` (GSPO-token)."""
    eps_low: float | None = None
    """Lower clip range: ratios below 1 - eps_low with negative advantage get no gradient."""
    eps_high: float | None = None
    """Upper clip range: ratios above 1 + eps_high with positive advantage get no gradient."""
    aggregation: str | None = None
    """``seq-mean-token-mean`` (GSPO/GRPO papers), ``token-mean`` (DAPO), ``seq-mean-token-sum-norm`` (Dr. GRPO)."""
    advantage_scale: str | None = None
    """Advantage normalisation after subtracting the group mean: divide by the ``group`` std (GRPO, GSPO), by the std of
    the whole ``batch``'s raw rewards (Lite PPO, TRL's ``scale_rewards="batch"``), or ``none`` (Dr. GRPO)."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial model (0 loads no reference model)."""
    mask_truncated: bool | None = None
    """Leave completions that hit ``max_new_tokens`` out of the loss (DAPO overlong filtering)."""
    allow_length_weighted_sequence: bool = False
    """Allow a sequence-level ratio with a token-summing aggregation, which weights each sequence by its length."""
    step_credit: str | None = None
    """Per-token advantages from process credit: ``module:function`` splitting a completion into scored steps
    (``gspo.rewards.builtin:running_sum_step_spans`` / ``numbered_words_line_spans`` for the long tasks; ``task``
    picks the one of ``data.task``). Each token
    gets the outcome advantage plus the normalised credit of its step and every later one (DeepSeekMath's process
    supervision; centred on the group's steps and scaled as ``loss.advantage_scale`` says). Token-level ratios only:
    GSPO-token (``gspo_token``) or GRPO-family presets."""
    step_credit_weight: float = 1.0
    """Weight of the process-credit term against the outcome advantage (with ``loss.step_credit``)."""


@dataclass
class DapoConfig:
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal and sample more prompts until the batch is full (DAPO)."""
    max_resample_rounds: int = 4
    """Extra rounds of sampling dynamic sampling may spend to refill a batch before training on what it has."""
    overlong_penalty: bool | None = None
    """Add DAPO's soft overlong punishment to the reward."""
    overlong_cache: int = 32
    """L_cache: the punishment ramps from 0 to -1 over the last this-many tokens before ``max_new_tokens``."""


@dataclass
class MoEConfig:
    routing_replay: str = "off"
    """Routing Replay for Mixture-of-Experts models: ``off``; ``old`` (R2: each token's top-k experts recorded in the
    old-policy pass are forced in every update forward of that rollout batch; needs ``train.old_logprobs =
    "recompute"``); ``rollout`` (R3: recorded by the rollout engine while sampling, forced in the old-policy pass and
    the update). Only the choice is forced: gate weights come from the current router, which keeps learning."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing auxiliary loss (transformers' Switch-Transformer loss) added to the policy loss;
    0 (off) for RL, where the reward, not the pre-training balance, should drive the router."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank through peft (``pip install 'gspo[lora]'``): only the adapters train, the engine samples from the
    merged weights W + (alpha / rank) B A; 0 = full fine-tuning. Peers use ~10x the full fine-tuning learning rate."""
    alpha: float = 32.0
    """LoRA scaling numerator: the adapter's update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """LoRA dropout; must stay 0 in RL (the update has to see the policy that computed the old log-probs)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: ``["all-linear"]`` (every Linear but the LM head) or module names (``q_proj``...)."""
    target_parameters: list[str] = field(default_factory=list)
    """Parameters (not modules) that get adapters, through peft's ``target_parameters``: an MoE's stacked expert
    weights, e.g. ``["experts.gate_up_proj", "experts.down_proj"]`` (Mixtral, Qwen-MoE, OLMoE in transformers 5)."""


@dataclass
class DistConfig:
    timeout_s: float = 600.0
    """Under ``torchrun``: how long a collective between the processes may wait before the run ends with one message
    (a process that crashed, was killed or hangs), instead of waiting forever."""
    strategy: str = "auto"
    """Under ``torchrun``: ``fsdp`` shards weights, gradients and AdamW state over the processes (FSDP2; for models
    whose training state does not fit one device), ``ddp`` keeps a whole copy in every process and sums the gradients
    with one all-reduce per bucket before each optimizer step (the update keeps its CUDA graphs and fused AdamW),
    ``auto``: ``ddp`` when the training state (18 bytes a parameter, 22 with a reference model) takes at most half
    of one device's memory, else ``fsdp``."""


@dataclass
class RewardConfig:
    path: str = ""
    """``module:function`` taking ``(completion: str, example: gspo.types.Example) -> float``."""
    weight: float = 1.0
    """Weight of this reward in the total."""
    name: str | None = None
    """Name in the metrics (``reward/<name>``); defaults to the function's name."""


@dataclass
class RewardsConfig:
    functions: list[RewardConfig] = field(default_factory=list)
    """Reward functions and weights; empty means the task's default verifier."""
    workers: int = 2
    """Worker processes that run reward functions (0 runs them in-process, without a hard time limit)."""
    timeout_s: float = 10.0
    """Per-call time limit; a call past it is killed and its completion left out of the group baseline."""


@dataclass
class TrainConfig:
    steps: int = 160
    """Optimizer steps in the run (rollout batches = steps / minibatches)."""
    minibatches: int = 4
    """Optimizer steps per rollout batch; only the first is on-policy (the paper uses 4)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward inside a minibatch (gradient accumulation); 0 = the whole minibatch."""
    lr: float = 5e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    schedule: str = "constant"
    """After warm-up: ``constant``, ``linear`` (to 0) or ``cosine`` (to 0)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables it)."""
    old_logprobs: str = "recompute"
    """``recompute`` old-policy log-probs with the trainer, or reuse the ``rollout`` engine's."""
    logprob_chunk: int = 1024
    """Positions per chunk of the log-prob pass (bounds the fp32 logits held at once: chunk x vocabulary x 4 bytes,
    0.2 GB for 1024 x 49152; 4096 measured 1% faster for 1.4 GB more peak memory on an H200)."""
    packing: str = "auto"
    """Log-prob and update passes on packed sequences (no padding): ``on``, ``off``, or ``auto`` (on with CUDA flash
    attention and bf16/fp16, off elsewhere, where the packed attention is a slow per-sequence reference)."""
    cuda_graphs: str = "auto"
    """Replay the decoder's forward and backward of packed passes as CUDA graphs, one per token bucket (``auto``: on
    when packing on CUDA without gradient checkpointing; ``off``)."""
    max_nonfinite_steps: int = 8
    """Stop the run after this many optimizer steps in a row with a non-finite loss or gradient (each is skipped)."""


@dataclass
class SentinelConfig:
    """Collapse detectors, checked after every rollout batch (each is off at 0)."""

    entropy_min: float = 0.0
    """Trigger when the on-policy step's mean token entropy falls below this (entropy collapse)."""
    reward_drop: float = 0.0
    """Trigger when the mean reward of the last ``window`` rollout batches is this much below the best such mean so far."""
    window: int = 5
    """Rollout batches averaged by ``reward_drop``."""
    seq_ratio_log_max: float = 0.0
    """Trigger when a step's sequence ratio leaves exp(+-this) (exploding spread of the sequence log-ratios)."""
    truncated_max: float = 0.0
    """Trigger when more than this fraction of a rollout batch's completions are cut at ``rollout.max_new_tokens``
    (responses growing to the limit: in the int8 engine-log-prob collapses this came ~100 steps before the reward fell)."""
    action: str = "warn"
    """On a trigger: ``warn`` (log and go on), ``stop`` (end the run without writing a checkpoint, so the last one
    written before the collapse stays the newest) or ``rollback`` (reload a checkpoint from before the collapse: after
    a reward drop the one holding the policy that sampled the best window's last batch, else the newest before the
    batch before the trigger; multiply the learning rate by ``lr_factor`` and go on; after ``max_rollbacks`` of them,
    stop)."""
    lr_factor: float = 0.5
    """Learning-rate multiplier applied at each rollback."""
    max_rollbacks: int = 2
    """Rollbacks allowed in one run before the sentinel stops it."""


@dataclass
class LogConfig:
    run_dir: str = "runs/{algorithm}-seed{seed}"
    """Run directory; ``{algorithm}`` and ``{seed}`` are filled in."""
    samples_per_batch: int = 4
    """Completions per rollout batch written to samples.jsonl."""
    checkpoint_every: int = 10
    """Write a checkpoint every this many rollout batches (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (and, with ``sentinel.action = "rollback"`` and a reward-drop
    detector, the one a reward drop would roll back to)."""
    progress: bool = True
    """Show the console progress bar."""
    histograms: bool = True
    """Write binned token and sequence log-ratio counts of every optimizer step to histograms.jsonl."""
    trace_every: int = 5
    """Every this many rollout batches, write per-token ratio traces of a few responses of the last (most off-policy)
    minibatch to traces.jsonl; 0 = never."""
    trace_samples: int = 2
    """Responses per trace: the one with the most extreme token ratio, then others spread over the minibatch."""
    profile_batch: int = 0
    """Profile this rollout batch (1-based; 0 = none) with torch.profiler on every process: ``<run_dir>/profile/``
    gets ``rank<r>.txt`` (gspo's stages, then operators by host and device time) and ``rank<r>.trace.json.gz`` (for
    ui.perfetto.dev). That batch's ``time/*`` metrics include the profiler's overhead; pick one after the first."""
    tensorboard: bool = False
    """Also write every metric to TensorBoard event files in ``<run_dir>/tensorboard/`` (``pip install
    'gspo[tensorboard]'``)."""
    wandb: bool = False
    """Also log every metric to a Weights & Biases run (``pip install 'gspo[wandb]'``), continued on ``--resume`` (its
    id is kept in ``<run_dir>/wandb_id.txt``); ``WANDB_MODE=offline`` logs without a network."""
    wandb_project: str = "gspo"
    """W&B project of the run."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty = your default one."""
    label: str = ""
    """The run's arm in reports (``gspo compare`` sets it to the arm, e.g. ``grpo+mb8``); empty = the algorithm and
    the arm suffixes its settings switch on."""


@dataclass
class Config:
    algorithm: str = "gspo"
    """Preset: ``gspo``, ``gspo_token``, ``grpo``, ``dapo`` or ``dr_grpo``; explicit fields override it."""
    seed: int = 1
    """One seed for data order, sampling, and initialisation of anything random."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    dapo: DapoConfig = field(default_factory=DapoConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)

    @property
    def rollout_batches(self) -> int:
        return self.train.steps // self.train.minibatches

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    # GSPO paper: sequence ratio, tiny clip range (3e-4, 4e-4), no KL, per-sequence length normalisation.
    "gspo": {"loss.level": "sequence", "loss.eps_low": 3e-4, "loss.eps_high": 4e-4,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    "gspo_token": {"loss.level": "sequence_token", "loss.eps_low": 3e-4, "loss.eps_high": 4e-4,
                   "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    # GRPO as the GSPO paper ran it for its comparison: token ratio, clip range (0.2, 0.27) (the seed's "Clipping range
    # (left, right) 0.2, 0.27"), per-sequence length normalisation; so `gspo compare` is the paper's comparison.
    "grpo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.27,
             "loss.aggregation": "seq-mean-token-mean", "loss.advantage_scale": "group"},
    # DAPO (Yu et al. 2025), all four of its techniques on together: clip-higher (0.2, 0.28), token-level loss
    # (token-mean), dynamic sampling, and both halves of its overlong treatment -- filtering truncated completions out
    # of the loss (loss.mask_truncated) and the soft punishment (dapo.overlong_penalty). Each is switchable on its own.
    "dapo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.28, "loss.aggregation": "token-mean",
             "loss.advantage_scale": "group", "loss.mask_truncated": True, "dapo.dynamic_sampling": True,
             "dapo.overlong_penalty": True},
    # Dr. GRPO: no std normalisation, no per-sequence length normalisation.
    "dr_grpo": {"loss.level": "token", "loss.eps_low": 0.2, "loss.eps_high": 0.2,
                "loss.aggregation": "seq-mean-token-sum-norm", "loss.advantage_scale": "none"},
}


_PRESET_FALLBACK = {"loss.mask_truncated": False, "dapo.dynamic_sampling": False, "dapo.overlong_penalty": False}


# Arms of a comparison: a preset, then "+"-suffixes that switch a technique on (`gspo compare --algos grpo,grpo+r2`).
# Comparison arms (``gspo compare --algos``): a preset, then "+"-suffixes, each switching settings on.
ARM_SUFFIXES: dict[str, dict[str, Any]] = {
    "r2": {"moe.routing_replay": "old"},  # Routing Replay R2
    "r3": {"moe.routing_replay": "rollout"},  # Routing Replay R3
    "enginelp": {"train.old_logprobs": "rollout"},  # the engine's log-probs as the old policy's (no recomputation)
    "int8": {"rollout.engine_weight_bits": 8},  # the engine samples from int8-rounded weights
    "credit": {"loss.step_credit": "task"},  # per-token process credit of the task's steps
}
# Suffixes with a number: +mb8 (8 minibatches per rollout batch), +lr2e-5 (learning rate 2e-5)
ARM_NUMBERED: dict[str, tuple[str, type]] = {"mb": ("train.minibatches", int), "lr": ("train.lr", float)}
ARM_SUFFIX_NAMES = [*("+" + k for k in ARM_SUFFIXES), "+mb<minibatches>", "+lr<learning rate>"]
TASK_STEP_CREDIT = {"running_sum": "gspo.rewards.builtin:running_sum_step_spans",  # loss.step_credit = "task"
                    "numbered_words": "gspo.rewards.builtin:numbered_words_line_spans"}


def parse_arm(arm: str) -> tuple[str, dict[str, Any]]:
    """``"grpo+r2"`` -> ``("grpo", {"moe.routing_replay": "old"})``, ``"gspo+mb8"`` -> ``("gspo",
    {"train.minibatches": 8})``; a UserError for an unknown preset or suffix."""
    preset, *suffixes = [part.strip() for part in arm.split("+")]
    if preset not in PRESETS:
        raise _unknown_key(preset, list(PRESETS), "algorithm value ")
    extra: dict[str, Any] = {}
    for suffix in suffixes:
        if suffix in ARM_SUFFIXES:
            settings = ARM_SUFFIXES[suffix]
            _no_second_value(arm, extra, settings)
            extra.update(settings)
            continue
        numbered = next(((key, kind, suffix[len(p):]) for p, (key, kind) in ARM_NUMBERED.items()
                         if suffix.startswith(p)), None)
        try:
            if numbered is None:
                raise ValueError
            key, kind, text = numbered
            value = kind(text)
        except ValueError:
            raise UserError(f"{arm!r}: unknown suffix +{suffix}; known: {', '.join(ARM_SUFFIX_NAMES)}.") from None
        _no_second_value(arm, extra, {key: value})
        extra[key] = value
    return preset, extra


def _no_second_value(arm: str, extra: dict[str, Any], settings: dict[str, Any]) -> None:
    """Two suffixes of one arm may not set the same key (``grpo+r2+r3``: which replay?)."""
    for key in settings:
        if key in extra:
            raise UserError(f"{arm!r} sets {key} twice; keep one suffix for it.")


def arm_label(config: dict[str, Any]) -> str:
    """The arm a resolved config (``Config.to_dict()``) trains: ``log.label`` when set (``gspo compare`` sets it), else
    its algorithm and the suffixes its settings switch on."""
    flat = _flatten(config)
    if flat.get("log.label"):
        return str(flat["log.label"])
    label = str(config.get("algorithm", "?"))
    for suffix, keys in ARM_SUFFIXES.items():
        if all(flat.get(k) == v for k, v in keys.items()):
            label += "+" + suffix
    return label


# --------------------------------------------------------------------------------------------- building


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown_key(key: str, valid: list[str], where: str) -> UserError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}."
    return UserError(f"Unknown config key {where}{key!r}; {hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"Config key {key!r} must be a list, got {value!r}; write it as [a, b].")
        if dataclasses.is_dataclass(item_tp):
            return [_build(item_tp, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_tp, key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise UserError(f"Config key {key!r} = {value} is too large for a float; use a finite number.") from None
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise UserError(f"Config key {key!r} must be {tp.__name__}, got {value!r:.80} ({type(value).__name__}); "
                        "fix its value.")
    if tp is float and not math.isfinite(value):
        # NaN passes every comparison a range check makes; inf makes a limit or a rate meaningless.
        raise UserError(f"Config key {key!r} = {value} is not a finite number; give a finite value.")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise UserError(f"Config section {prefix.rstrip('.')!r} must be a table, got {data!r}.")
    hints = _hints(cls)
    names = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(key, names, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, prefix + key)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"Override {dotted!r} goes through {p!r}, which is not a table.")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as TOML (numbers, booleans, lists, quoted strings), else a bare string."""
    if "=" not in text:
        raise UserError(f"Override {text!r} is not key=value; write it as e.g. loss.eps_high=5e-4.")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise UserError(f"Override {text!r} has no key before '='; write it as e.g. loss.eps_high=5e-4.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw
    return key.strip(), value


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"Config file {str(p)!r} does not exist; pass the path of a TOML file (see configs/).")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"Config file {str(p)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8 TOML.") from None
    except OSError as e:
        raise UserError(f"Config file {str(p)!r} cannot be read ({e.strerror or e}); check its permissions.") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise UserError(f"Config file {str(p)!r} is not valid TOML ({why}); fix that line.") from None


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None, *, device: str | None = None) -> Config:
    """A validated :class:`Config` from a TOML-shaped dict, ``key=value`` overrides and the resolved device type."""
    tree = copy.deepcopy(data or {})
    device_overrides = tree.pop("overrides", {}) or {}
    if not isinstance(device_overrides, dict) or not all(isinstance(v, dict) for v in device_overrides.values()):
        raise UserError("The config's [overrides] must hold tables of dotted keys per device, like "
                        "[overrides.cpu] \"train.steps\" = 8; fix or remove it.")
    if device is not None and device in device_overrides:
        for k, v in _flatten(device_overrides[device]).items():
            _set_dotted(tree, k, v)
    for text in overrides or []:
        k, v = parse_override(text)
        _set_dotted(tree, k, v)
    cfg = _build(Config, tree)
    apply_preset(cfg)
    validate(cfg)
    return cfg


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Clip ranges belong to the ratio's level, not the algorithm: a sequence ratio lives within ~1e-3 of 1, where a
# token-level 0.2 clips nothing (TRL #3834), and a token ratio under 3e-4 would be clipped almost everywhere.
LEVEL_EPS = {"token": (0.2, 0.27), "sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4)}


def apply_preset(cfg: Config) -> None:
    """Fill every ``None`` field from the algorithm's preset; clip ranges follow an explicitly chosen level."""
    if cfg.algorithm not in PRESETS:
        raise _unknown_key(cfg.algorithm, list(PRESETS), "algorithm value ")
    lc = cfg.loss
    if lc.level is not None and lc.level != PRESETS[cfg.algorithm]["loss.level"] and lc.level in LEVEL_EPS:
        low, high = LEVEL_EPS[lc.level]
        lc.eps_low = low if lc.eps_low is None else lc.eps_low
        lc.eps_high = high if lc.eps_high is None else lc.eps_high
    for dotted, value in {**_PRESET_FALLBACK, **PRESETS[cfg.algorithm]}.items():
        section, name = dotted.split(".")
        obj = getattr(cfg, section)
        if getattr(obj, name) is None:
            setattr(obj, name, value)


def _installed(package: str) -> bool:
    """Whether ``package`` is importable, found without importing it (a stray ``./wandb`` folder of W&B runs is a
    namespace package without an origin, not the package)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def validate(cfg: Config) -> None:
    """Refuse invalid combinations with a message that names the fix; warn about legal but surprising ones."""
    lc, r, t = cfg.loss, cfg.rollout, cfg.train
    sc, lg = cfg.sentinel, cfg.log
    for ok, key, value, fix in ((sc.window >= 1, "sentinel.window", sc.window, "use 1 or more rollout batches"),
                                (0 < sc.lr_factor <= 1, "sentinel.lr_factor", sc.lr_factor, "use a factor in (0, 1]"),
                                (sc.max_rollbacks >= 0, "sentinel.max_rollbacks", sc.max_rollbacks, "use 0 or more"),
                                (min(sc.entropy_min, sc.reward_drop, sc.seq_ratio_log_max) >= 0, "sentinel thresholds",
                                 (sc.entropy_min, sc.reward_drop, sc.seq_ratio_log_max), "use 0 (off) or a positive value"),
                                (0 <= sc.truncated_max < 1, "sentinel.truncated_max", sc.truncated_max,
                                 "use 0 (off) or a fraction below 1"),
                                (lg.trace_every >= 0 and lg.trace_samples >= 0, "log.trace_every / log.trace_samples",
                                 (lg.trace_every, lg.trace_samples), "use 0 (off) or a positive count"),
                                (lg.profile_batch >= 0, "log.profile_batch", lg.profile_batch,
                                 "use 0 (off) or the 1-based index of a rollout batch")):
        if not ok:
            raise UserError(f"{key} = {value} is invalid; {fix}.")
    for key, on, package in (("log.tensorboard", lg.tensorboard, "tensorboard"), ("log.wandb", lg.wandb, "wandb")):
        if on and not _installed(package):
            raise UserError(f"{key} = true but the {package} package is not installed; pip install 'gspo[{package}]', "
                            f"or set {key} = false.")
    m = cfg.model
    if m.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", m.device):
        raise UserError(f"model.device = {m.device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(lg.run_dir) if f is not None]
        lg.run_dir.format(algorithm=cfg.algorithm, seed=cfg.seed)
        bad = [f for f in fields if f not in ("algorithm", "seed")]
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        bad = [str(e)]
    if bad:
        raise UserError(f"log.run_dir = {lg.run_dir!r} has a placeholder gspo does not fill ({', '.join(bad)}); use "
                        "{algorithm} and {seed} only (double a brace to write one).")
    if not 0 <= cfg.seed < 2**63:
        raise UserError(f"seed = {cfg.seed} must be in 0 .. 2**63 - 1.")
    for key, value in (("train.logprob_chunk", t.logprob_chunk), ("train.max_nonfinite_steps", t.max_nonfinite_steps),
                       ("data.max_prompt_tokens", cfg.data.max_prompt_tokens)):
        if value < 1:
            raise UserError(f"{key} = {value} must be at least 1.")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise UserError(f"train.adam_betas = {t.adam_betas} must be two numbers in [0, 1), e.g. [0.9, 0.99].")
    if not t.lr > 0 or t.weight_decay < 0 or t.max_grad_norm < 0 or t.warmup_steps < 0:
        raise UserError("train.lr must be > 0, and train.weight_decay, train.max_grad_norm and train.warmup_steps >= 0 "
                        f"(got {t.lr}, {t.weight_decay}, {t.max_grad_norm}, {t.warmup_steps}).")
    if not cfg.rewards.timeout_s > 0 or cfg.rewards.workers < 0:
        raise UserError(f"rewards.timeout_s = {cfg.rewards.timeout_s} must be > 0 and rewards.workers = "
                        f"{cfg.rewards.workers} >= 0.")
    if lg.checkpoint_every < 0 or lg.samples_per_batch < 0 or lg.keep_checkpoints < 0:
        raise UserError("log.checkpoint_every, log.samples_per_batch and log.keep_checkpoints must be >= 0 (0 turns the "
                        "first two off and keeps every checkpoint).")
    if lg.wandb and not lg.wandb_project:
        raise UserError("log.wandb_project is empty; name the W&B project, e.g. log.wandb_project = 'gspo'.")
    for value, valid, key in ((lc.level, LEVELS, "loss.level"), (lc.aggregation, AGGREGATIONS, "loss.aggregation"),
                              (lc.advantage_scale, SCALES, "loss.advantage_scale"),
                              (t.old_logprobs, ("recompute", "rollout"), "train.old_logprobs"),
                              (t.packing, ("auto", "on", "off"), "train.packing"),
                              (cfg.sentinel.action, ("warn", "stop", "rollback"), "sentinel.action"),
                              (cfg.data.long_prompts, ("skip", "fail"), "data.long_prompts"),
                              (t.cuda_graphs, ("auto", "off"), "train.cuda_graphs"),
                              (t.schedule, ("constant", "linear", "cosine"), "train.schedule"),
                              (cfg.model.precision, ("auto", "fp32", "bf16-autocast"), "model.precision"),
                              (r.engine, ("auto", "graph", "hf", "vllm"), "rollout.engine"),
                              (r.fused_step, ("auto", "off"), "rollout.fused_step"),
                              (r.compact_rows, ("auto", "off"), "rollout.compact_rows"),
                              (cfg.moe.routing_replay, ("off", "old", "rollout"), "moe.routing_replay"),
                              (cfg.dist.strategy, ("auto", "fsdp", "ddp"), "dist.strategy")):
        if value not in valid:
            raise UserError(f"{key} = {value!r} is not one of {', '.join(valid)}; pick one of those.")
    if sc.action in ("stop", "rollback") and not (sc.entropy_min or sc.reward_drop or sc.seq_ratio_log_max
                                                 or sc.truncated_max):
        raise UserError(f"sentinel.action = {sc.action!r} with every detector off (sentinel.reward_drop, entropy_min, "
                        "seq_ratio_log_max and truncated_max are 0) never acts; turn one on, e.g. "
                        "sentinel.reward_drop = 0.3.")
    lo = cfg.lora
    if lo.rank < 0 or (lo.rank and not lo.alpha > 0) or not lo.target_modules:
        raise UserError(f"lora.rank = {lo.rank}, lora.alpha = {lo.alpha}, lora.target_modules = {lo.target_modules}: the "
                        "rank must be >= 0 (0 = full fine-tuning), alpha > 0, and at least one target module named.")
    if lo.rank and lo.dropout != 0:
        raise UserError(f"lora.dropout = {lo.dropout}: dropout must stay off in RL (the update must see the policy "
                        "that computed the old log-probs, as gspo turns off the model's own dropout); set it to 0.")
    if not (r.engine_weight_bits == 0 or 2 <= r.engine_weight_bits <= 16):
        raise UserError(f"rollout.engine_weight_bits = {r.engine_weight_bits} must be 0 (off) or 2-16, e.g. 8.")
    if lc.step_credit == "task" and cfg.data.task not in TASK_STEP_CREDIT:
        raise UserError(f"loss.step_credit = 'task': data.task = {cfg.data.task!r} has no built-in step credit (only "
                        f"{', '.join(TASK_STEP_CREDIT)} do); name a 'module:function' instead.")
    if lc.step_credit is not None and lc.level == "sequence":
        raise UserError(f"loss.step_credit gives per-token advantages, which {cfg.algorithm}'s sequence-level ratio "
                        "cannot take (one advantage per sequence); use algorithm = 'gspo_token' (GSPO-token) or a "
                        "token-level preset such as 'grpo'.")
    if lc.level != "token" and lc.aggregation != "seq-mean-token-mean" and not lc.allow_length_weighted_sequence:
        raise UserError(
            f"loss.level = {lc.level!r} with loss.aggregation = {lc.aggregation!r} weights every sequence by its "
            "length (TRL #3823); use aggregation 'seq-mean-token-mean', or set loss.allow_length_weighted_sequence = true."
        )
    if not (0 <= lc.eps_low < 1) or lc.eps_high < 0:
        raise UserError(f"Clip ranges must satisfy 0 <= loss.eps_low < 1 and loss.eps_high >= 0 (got {lc.eps_low}, {lc.eps_high}).")
    if lc.level != "token" and max(lc.eps_low, lc.eps_high) >= 0.05:
        log.warning("loss.eps_* = (%g, %g) on a sequence-level ratio clips almost nothing (TRL #3834); the GSPO "
                    "paper uses (3e-4, 4e-4).", lc.eps_low, lc.eps_high)
    if cfg.moe.routing_replay == "old" and t.old_logprobs != "recompute":
        raise UserError("moe.routing_replay = 'old' records the experts in the old-policy pass, which "
                        "train.old_logprobs = 'rollout' skips; set train.old_logprobs = 'recompute'.")
    if not cfg.dist.timeout_s > 0:
        raise UserError(f"dist.timeout_s = {cfg.dist.timeout_s} must be > 0 seconds (e.g. 600).")
    if cfg.moe.router_aux_loss_coef < 0:
        raise UserError(f"moe.router_aux_loss_coef = {cfg.moe.router_aux_loss_coef} must be >= 0 (0 turns it off).")
    if r.group_size < 2:
        raise UserError(f"rollout.group_size = {r.group_size} leaves no group to compare against; use 2 or more (the paper uses 8+).")
    if r.prompts_per_batch < 1 or r.max_new_tokens < 1:
        raise UserError("rollout.prompts_per_batch and rollout.max_new_tokens must be at least 1.")
    if r.temperature <= 0:
        raise UserError(f"rollout.temperature = {r.temperature} must be > 0 for sampling; use e.g. 1.0.")
    if not 0 < r.top_p <= 1 or r.top_k < 0:
        raise UserError("rollout.top_p must be in (0, 1] and rollout.top_k >= 0 (0 disables it).")
    if not 0 < r.vllm_gpu_memory < 1:
        raise UserError(f"rollout.vllm_gpu_memory = {r.vllm_gpu_memory} must be a share of the GPU in (0, 1), e.g. 0.3.")
    if r.engine == "vllm" and t.old_logprobs == "rollout" and (r.top_p < 1 or r.top_k > 0):
        raise UserError(f"train.old_logprobs = 'rollout' with rollout.engine = 'vllm' and top_p = {r.top_p} / top_k = "
                        f"{r.top_k}: vLLM's log-probs are renormalised over the kept tokens, so the importance ratio "
                        "would be biased; set train.old_logprobs = 'recompute', or top_p = 1 and top_k = 0.")
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
    if cfg.dapo.overlong_penalty and not 0 < cfg.dapo.overlong_cache <= r.max_new_tokens:
        raise UserError(f"dapo.overlong_cache = {cfg.dapo.overlong_cache} must be in 1..rollout.max_new_tokens ({r.max_new_tokens}).")
    if lc.beta < 0:
        raise UserError(f"loss.beta = {lc.beta} must be >= 0.")
    if t.old_logprobs == "rollout" and r.engine_weight_bits:
        log.warning("train.old_logprobs = 'rollout' with rollout.engine_weight_bits = %d: the rounded engine's log-probs "
                    "become the old policy's; on the reference run this collapsed every GSPO run and one GRPO run in "
                    "three at 8 bits (docs/experiments/engine). Recompute them unless the gap is what you study.",
                    r.engine_weight_bits)
    if t.minibatches == 1:
        log.warning("train.minibatches = 1: every update is on-policy, so the importance ratio is always 1 and GSPO, "
                    "GRPO and REINFORCE with a group baseline coincide; use 2+ minibatches to exercise the ratio.")
    for rw in cfg.rewards.functions:
        if ":" not in rw.path:
            raise UserError(f"Reward path {rw.path!r} must be 'module:function', e.g. 'gspo.rewards.builtin:last_number'.")


# What --resume may change. Everything else defines the run -- the objective, the data and its order, the sampling,
# the optimizer's hyper-parameters and schedule shape, the model -- and changing it would make the resumed run neither
# the old one nor a new one (the optimizer state and the data position belong to the old settings).
RESUMABLE = (
    "train.steps",  # train longer (or stop earlier)
    "train.lr",  # the usual reaction to instability; the metrics log the learning rate of every step
    "train.micro_batch_size", "train.logprob_chunk", "train.packing", "train.cuda_graphs",  # memory / speed only
    "train.max_nonfinite_steps",
    "model.device", "model.gradient_checkpointing",  # where and how memory is spent, not what is computed
    "rollout.engine", "rollout.fused_step", "rollout.compact_rows", "rollout.vllm_gpu_memory",
    "rewards.workers", "rewards.timeout_s",
    "log.", "sentinel.",  # what is written and watched
    "dist.",  # how long to wait for other processes, and how they share the model (both write the same checkpoints)
)


# Keys that name files: --resume may point them elsewhere (a dataset moved to scratch, a model copied to local disk)
# when what is there now has the fingerprint recorded when the run started.
SOURCE_KEYS = ("model.name", "data.path", "model.tokenizer")
_SAMPLE = 4 << 20  # bytes hashed at each end of a large file


def source_fingerprint(value: Any) -> str | None:
    """A fingerprint of the file or directory ``value`` names, None when it names none (a hub id, an alias, unset).

    Files up to 16 MiB are hashed whole; larger ones by size and their first and last 4 MiB (a moved copy matches, an
    edited weight file almost surely not, and a start never pays for hashing gigabytes). A directory hashes its files'
    relative names and fingerprints."""
    import hashlib

    if not isinstance(value, str) or not value:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            h = hashlib.sha256()
            size = path.stat().st_size
            with open(path, "rb") as f:
                if size <= 4 * _SAMPLE:
                    h.update(f.read())
                else:
                    h.update(f.read(_SAMPLE))
                    f.seek(size - _SAMPLE)
                    h.update(f.read(_SAMPLE))
            return f"{size}:{h.hexdigest()}"
        if path.is_dir():
            h = hashlib.sha256()
            for child in sorted(p for p in path.rglob("*") if p.is_file()):
                h.update(f"{child.relative_to(path)}={source_fingerprint(str(child))};".encode())
            return "dir:" + h.hexdigest()
    except OSError:
        return None
    return None


def source_fingerprints(cfg_dict: dict[str, Any]) -> dict[str, str]:
    """``{key: fingerprint}`` for the SOURCE_KEYS of a resolved config that name files or directories."""
    flat = _flatten(cfg_dict)
    found = {k: source_fingerprint(flat.get(k)) for k in SOURCE_KEYS}
    return {k: v for k, v in found.items() if v is not None}


def resume_changes(old: dict[str, Any], new: dict[str, Any],
                   old_sources: dict[str, str] | None = None) -> tuple[dict[str, list], list[str]]:
    """The keys whose values differ between two resolved configs (``Config.to_dict()``), as ``{key: [old, new]}``, and
    those of them that ``--resume`` may not change. Keys only one side has (another gspo version) are not compared. A
    SOURCE_KEYS path that changed is allowed when what it names now has the fingerprint in ``old_sources``."""
    a, b = _flatten(old), _flatten(new)
    changed = {k: [a[k], b[k]] for k in a if k in b and a[k] != b[k]}
    old_sources = old_sources or {}

    def allowed(k: str) -> bool:
        if k in SOURCE_KEYS and k in old_sources:
            return source_fingerprint(b[k]) == old_sources[k]
        return any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)

    return changed, [k for k in changed if not allowed(k)]


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field, read from the source: the reference in the README."""
    import ast
    import inspect

    src = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = src.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
    rows = []
    hints = _hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_docs(tp, f"{prefix}{f.name}."))
        else:
            rows.append((prefix + f.name, repr(getattr(inst, f.name)), docs.get(f.name, "")))
    return rows
