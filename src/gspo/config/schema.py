"""The run configuration's schema: one dataclass per section, a docstring per field (``gspo config`` and the README's
reference are read from them), and the dotted keys (``loss.eps_high``) that name its fields.

Fields left at ``None`` are filled by the algorithm preset (:mod:`gspo.config.presets`); how a config is read from TOML
and overrides is :mod:`gspo.config.load`, which values it may take :mod:`gspo.config.checks`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from gspo.errors import UserError


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
    BF16; its bf16 matmuls ~3.6x fp32's there), plain fp32 on any other CPU (where bf16 is emulated, many times slower);
    ``fp32``; ``bf16-autocast`` (fp32 master weights, bf16 matmuls, on any device). ``GSPO_CPU_BF16=0`` / ``1``
    overrides what is read off the CPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more time per update."""
    gpu_memory: float | None = None
    """The share of the GPU's memory this process may take, in (0, 1]: PyTorch's allocator is capped there, and the
    engine's batch and the update's CUDA graphs size themselves within it. Unset: the whole GPU, except under
    ``gspo compare --jobs N`` with more runs than GPUs, which gives each run an equal share of 90% of its GPU."""


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """``arithmetic`` (generated ``a op b``), ``running_sum`` (generated: add ``terms`` numbers with every running
    total written out), ``numbered_words`` (generated: number ``terms`` words one per line, then count them; both
    long-response tasks), ``guess_number`` (generated: a number from 1 to ``terms`` to guess, for the ``GuessNumber``
    environment), ``gsm8k`` (JSONL with ``#### answer``), ``math`` (JSONL with ``\\boxed{}``),
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
    exact: bool = False
    """Engine and trainer agree bit for bit: the graph engine's decode step, its prefill and the trainer's log-prob
    pass run one forward of batch-invariant Triton kernels (``gspo.kernels.exact_kernels``), so the engine's log-prob
    of every sampled token equals the trainer's recomputation for the same weights, whatever the batch, the lengths or
    the row compaction, with CUDA graphs on; ``logprob/engine_diff_max`` shows 0.0. With ``train.old_logprobs =
    "rollout"`` the recompute pass disappears and the first update's ratio is exactly 1. A dense model's update
    differentiates the exact pass itself (its backward: torch matmuls and fused Triton kernels); an MoE model's update,
    or one under ``model.gradient_checkpointing``, takes the ordinary pass's gradient at the same weights (an extra
    forward per micro-batch). Llama / Mistral / Qwen2 /
    Qwen3 and Mixtral / Qwen2-MoE / Qwen3-MoE on a GPU, single- or multi-turn, without LoRA, FSDP or routing replay;
    anything else is refused in one line. See docs/experiments/engine."""
    engine_weight_bits: int = 0
    """For experiments on the engine-trainer gap: the rollout engine samples from its copy of the weights with every
    weight matrix rounded to signed integers of this many bits (symmetric, one scale per output row, as weight-only
    int8 inference does); norms and biases are kept. The trainer's weights are untouched; the gap shows in
    ``logprob/engine_diff_*``. 0 (default) = off; 2-16."""
    max_staleness: int = 0
    """Asynchronous training: eta > 0 collects the next rollout batches while the actor trains on the current one, each
    sampled by the policy exactly eta rollout batches older than the one that trains it (fewer in the first eta
    batches; at most eta collected batches wait, none is thrown away). 0 (default): the synchronous loop. Counted in
    rollout batches, the unit the engine's weights change by (eta batches = eta x train.minibatches optimizer steps).
    A fixed lag, so a run is the same whatever the timing, and resumes exactly. See docs/async.md."""
    overlap: str = "thread"
    """With ``rollout.max_staleness`` > 0: ``thread`` collects in a background thread (on its own CUDA stream) while
    the actor trains; ``off`` collects in turn with the update (no speed-up, the same numbers bit for bit: the
    reference the threaded run is checked against)."""
    in_flight: str = "off"
    """With ``rollout.max_staleness`` > 0 and ``rollout.overlap = "thread"``: ``keep`` or ``recompute`` loads each
    policy version into the engine between two decode steps as soon as the actor publishes it (an in-flight update,
    PipelineRL's): a batch starts with the newest version there is (never older than the lag allows) and its later
    tokens are sampled by newer ones; every token records the version that sampled it. After a swap the rows' KV cache,
    written by older weights, is kept (``keep``: no extra work; the next tokens are sampled from the new weights over
    the old keys and values, a distribution no single version defines) or recomputed by the new weights in one forward
    over every live row (``recompute``: each token is sampled by exactly one version). ``off`` (default): one version
    samples a whole batch, the fixed lag. In-flight runs depend on timing, so they are not reproducible bit for bit.
    The graph engine only, single-turn, without decode processes. See docs/async.md."""
    decode_processes: int = 0
    """Under torchrun, with ``rollout.max_staleness`` > 0: the job's last k processes (GPUs) only sample rollout
    batches (each its share, as k processes of a synchronous job would) and the others only train; trainer 0 sends
    them the weights after every update (NCCL on GPUs). The same fixed lag, so 1 trainer + 1 decode process computes
    the one-process run bit for bit. 0 (default): every process samples and trains. See docs/async.md."""
    decode_gpu: str = "own"
    """With ``rollout.decode_processes``: ``own`` (default) gives each decode process a GPU of its own (launch one
    process per GPU); ``shared`` puts the decode processes on the trainer's GPU, so one GPU holds a trainer and a
    decode process (``gspo train --nproc 2`` on one GPU), and the weights reach them through shared memory (CUDA IPC
    on GPUs, mapped files on CPUs) instead of a broadcast; trainer 0 keeps eta + 1 copies of the weights for it. One
    machine, and on GPUs one trainer; without ``model.gpu_memory`` each process on the GPU is capped at an equal
    share. Start NVIDIA's MPS daemon (``nvidia-cuda-mps-control -d``) first, so that the processes' kernels run at
    once instead of taking turns. See docs/async.md."""


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
    """Advantage normalisation after the baseline: divide by the ``group`` std (GRPO, GSPO), by the std of the whole
    ``batch``'s raw rewards (Lite PPO, TRL's ``scale_rewards="batch"``), centre and divide by the std over every loss
    token of the batch (``tokens``: REINFORCE++), or ``none`` (Dr. GRPO, RLOO)."""
    advantage_baseline: str | None = None
    """What each reward is compared with: the ``group_mean`` (GRPO, GSPO), the mean of the group's other rewards
    (``leave_one_out``: RLOO), nothing (``none``: REINFORCE++, whose ``tokens`` scale then centres over the batch), or
    a value model's estimate at each token (``critic``: PPO's GAE, with the ``ppo.*`` keys)."""
    objective: str | None = None
    """The surrogate each token's ratio enters: ``clip`` (PPO's clipped ratio: GSPO, GRPO, DAPO...), ``cispo`` (the
    ratio truncated to [1 - eps_low, 1 + eps_high] and held constant, every token keeping its gradient: MiniMax-M1),
    ``gmpo`` (the geometric mean of token ratios each clipped to [e^-eps_low, e^eps_high]: sequence level) or ``sapo``
    (a soft sigmoid gate instead of a clip, with ``loss.sapo_tau``)."""
    sapo_tau: list[float] | None = None
    """``[tau_pos, tau_neg]``: the SAPO gate's temperatures for positive and negative advantages (larger damps
    off-policy gradients faster). Unset with ``loss.objective = "sapo"``: [1.0, 1.05], the SAPO paper's."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial model (0 loads no reference model)."""
    mask_truncated: bool | None = None
    """Leave completions that hit ``max_new_tokens`` out of the loss (DAPO overlong filtering)."""
    allow_length_weighted_sequence: bool = False
    """Allow a sequence-level ratio with a token-summing aggregation, which weights each sequence by its length."""
    step_credit: str | None = None
    """Per-token advantages from process credit: ``module:function`` splitting a completion into scored steps
    (``gspo.rewards.builtin:running_sum_step_spans`` / ``numbered_words_line_spans`` for the long tasks; ``task``
    picks the one of ``data.task``; ``env``: with ``env.path``, each turn is a step credited with the reward its
    ``step`` returned). Each token
    gets the outcome advantage plus the normalised credit of its step and every later one (DeepSeekMath's process
    supervision; centred on the group's steps and scaled as ``loss.advantage_scale`` says). With PPO
    (``algorithm = "ppo"``) each step's credit is instead a token reward at the step's last token, which GAE and the
    value model take in. Token-level ratios only: GSPO-token (``gspo_token``), GRPO-family presets or PPO."""
    step_credit_weight: float = 1.0
    """Weight of the process-credit term against the outcome advantage (with ``loss.step_credit``)."""
    mismatch_correction: str = "off"
    """Correct for the engine sampling from other numbers than the trainer's (vLLM, ``rollout.engine_weight_bits``,
    bf16 kernels): each term weighted by w = pi_old / pi_engine, the recomputed old policy over the engine's
    log-probs. ``off``; ``tis``: w truncated at the upper bound, per token for GRPO, per sequence (geometric mean) for
    GSPO; ``sequence_mask``: sequences whose geometric-mean w leaves the bounds are left out; ``icepop``: tokens whose
    w leaves the bounds are left out, the others weighted by w. Needs ``train.old_logprobs = "recompute"``; left-out
    tokens leave every denominator."""
    mismatch_bounds: list[float] | None = None
    """``[low, high]`` of ``loss.mismatch_correction`` (``tis`` uses only high). Unset: ``tis`` [0, 2],
    ``sequence_mask`` [0.99, 1.01], ``icepop`` [0.5, 5]."""


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
class PPOConfig:
    """PPO's value model (``algorithm = "ppo"``, i.e. ``loss.advantage_baseline = "critic"``); unused otherwise."""

    critic_model: str = ""
    """The value model: unset, a copy of the policy's starting weights with a scalar head (zero at first); or any
    ``model.name`` of the same tokenizer (e.g. a smaller model), its LM head replaced by the scalar head."""
    critic_lr: float = 1e-5
    """The value model's AdamW learning rate (constant; ``train.adam_betas``, ``weight_decay`` and
    ``max_grad_norm`` as the policy's)."""
    critic_warmup: int = 0
    """Rollout batches at the start that train only the value model (the policy's updates are skipped; its
    learning-rate schedule counts these batches all the same, so ``train.warmup_steps`` may end during them)."""
    value_clip: float = 0.5
    """PPO's value clipping: each value moves at most this far from the value model's estimate before the rollout
    batch's updates (0: no clipping)."""
    gamma: float = 1.0
    """GAE's discount over the response tokens (1: every token's return is the outcome reward)."""
    lam: float = 1.0
    """GAE's lambda (1: Monte-Carlo returns less the value; smaller leans on the value model's estimates)."""


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
class EnvConfig:
    path: str | None = None
    """Multi-turn: the environment class, ``module:Class`` with ``reset(example)`` (the first messages, or ``None`` for
    the example's prompt) and ``step(reply) -> (observation, reward, done)``; one object per trajectory, run in the
    environment workers. Built in: ``gspo.envs.builtin:GuessNumber``, ``gspo.envs.builtin:RunningTotal``. Unset: single-turn (or tools only)."""
    tools: list[str] = field(default_factory=list)
    """Tool functions (``module:function``, type hints and a Google-style docstring), described to the model through
    its chat template and called when a turn holds tool calls; their results come back as ``tool`` messages. Built
    in: ``gspo.envs.builtin:calculator``."""
    tool_format: str = "auto"
    """How the model writes tool calls: ``hermes`` (``<tool_call>{json}</tool_call>``), ``llama3`` (a bare JSON
    object), ``mistral`` (``[TOOL_CALLS][...]``), or ``auto`` (what the chat template uses; ``hermes`` where none)."""
    renderer: str | None = None
    """The chat format, when it is not the tokenizer's Jinja template: ``module:factory``, ``factory(tokenizer)``
    returning a renderer (``render(messages, tools, generation_prompt) -> ids``, ``tokenize``, ``decode``). Built in:
    ``gspo.envs.renderers:llama3`` (``llama-models``), ``:mistral_tekken`` and ``:mistral_v7``
    (``mistral-common``). Checked at start-up: its ids must be the model tokenizer's, and it must keep earlier turns."""
    max_turns: int = 4
    """Assistant turns per trajectory; the trajectory ends after this many (its reward is what it earned)."""
    max_turn_tokens: int = 0
    """Tokens one assistant turn may sample; 0: ``rollout.max_new_tokens``, which bounds the whole trajectory's
    completion (every turn and every appended message)."""
    workers: int = 2
    """Worker processes that hold the environments and run the tools (0: in this process, without time limits)."""
    timeout_s: float = 10.0
    """Time limit of one ``reset``, ``step`` or tool call; past it the worker is killed and the trajectories it held
    end with NaN reward (left out of their group's baseline, counted in ``env/failures``)."""

    @property
    def on(self) -> bool:
        return bool(self.path or self.tools)


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
    """Write a checkpoint every this many rollout batches (and at the end, unless ``log.final_checkpoint = false``);
    0 = only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (and, with ``sentinel.action = "rollback"`` and a reward-drop
    detector, the one a reward drop would roll back to)."""
    final_checkpoint: bool = True
    """Write a checkpoint when the run finishes. ``false``: none at its end (a smoke test's 2 steps need no 1.6 GB of
    weights), only the periodic ones of ``checkpoint_every``; a run stopped by a signal still writes one, to resume
    from."""
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
    """Preset: ``gspo``, ``gspo_token``, ``grpo``, ``dapo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``cispo``, ``gmpo``,
    ``sapo`` or ``ppo``; explicit fields override it."""
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
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)

    @property
    def rollout_batches(self) -> int:
        return self.train.steps // self.train.minibatches

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict (``Config.to_dict()``, a TOML table) as ``{dotted key: value}``."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def unknown_key(key: str, valid: list[str], where: str) -> UserError:
    """The error for a key (or preset name) that is not one of ``valid``, suggesting the closest."""
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}."
    return UserError(f"Unknown config key {where}{key!r}; {hint}")
