"""Which way a run holds its policy (``dist.strategy``), and the layouts the processes of a job cannot share.
"""
from __future__ import annotations

import os

import torch

from gspo.errors import UserError

STRATEGIES = ("auto", "fsdp", "ddp")  # dist.strategy's values (the config checks import them)


# Training state a parameter costs: fp32 weight, gradient and two AdamW moments (16 bytes) and the rollout engine's
# bf16 copy (2); a reference model (KL) adds its fp32 copy (4).
STATE_BYTES, REF_BYTES = 18, 4


def choose_strategy(setting: str, model: torch.nn.Module, device: torch.device, *, reference: bool,
                    lora: bool = False) -> str:
    """``fsdp`` or ``ddp`` for ``dist.strategy = setting``: ``auto`` replicates a model whose training state takes at
    most half of one device's memory (the rest is for activations, the KV cache and CUDA graphs), and shards a
    larger one. LoRA always replicates (``check_layout`` refuses it with ``fsdp``): its frozen base has no gradients
    or optimizer state to shard."""
    if lora:
        return "ddp"
    if setting != "auto":
        return setting
    params = sum(p.numel() for p in model.parameters())
    need = params * (STATE_BYTES + (REF_BYTES if reference else 0))
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:  # the host's memory, shared by the processes on it
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "ddp" if need <= have // 2 else "fsdp"


def check_layout(cfg, world: int) -> None:
    """Refuse a device that ``world`` processes would share, and a batch shape that they cannot share evenly (every group on one rank, every minibatch cut
    into equal slices, so that every rank runs the same number of forwards and collectives)."""
    if world <= 1:
        return
    if cfg.model.device.startswith("cuda:"):
        raise UserError(f"model.device = {cfg.model.device!r} would put all {world} processes on one GPU; use 'cuda' or "
                        "'auto' under torchrun (each process takes its own GPU, cuda:LOCAL_RANK).")
    if cfg.rollout.engine == "vllm":
        raise UserError("rollout.engine = 'vllm' under torchrun is not built (each process would need vLLM's "
                        "external-launcher executor); use rollout.engine = 'auto' with several processes, or vLLM in "
                        "one process.")
    if cfg.lora.rank and cfg.dist.strategy == "fsdp":
        raise UserError(f"lora.rank = {cfg.lora.rank} with dist.strategy = 'fsdp': LoRA trains with every process "
                        "holding the whole frozen base (it needs no gradients or optimizer state), so adapters are not "
                        "built for FSDP2; set dist.strategy = 'ddp' or 'auto'.")
    r, t = cfg.rollout, cfg.train
    mb = r.prompts_per_batch * r.group_size // t.minibatches
    if r.prompts_per_batch % world:
        raise UserError(f"rollout.prompts_per_batch = {r.prompts_per_batch} cannot be shared by {world} processes (each "
                        f"keeps whole groups); use a multiple of {world}.")
    if mb % world:
        raise UserError(f"A minibatch of {mb} sequences (prompts_per_batch x group_size / train.minibatches) cannot be "
                        f"cut into {world} equal slices; change train.minibatches or the batch so it is a multiple "
                        f"of {world}.")
    if t.micro_batch_size and (mb // world) % t.micro_batch_size:
        raise UserError(f"train.micro_batch_size = {t.micro_batch_size} must divide each process's slice of a minibatch "
                        f"({mb // world} sequences on {world} processes), or be 0.")


def choose(cfg, model: torch.nn.Module, device: torch.device, world: int) -> str:
    """The holding a run gets: ``single`` in one process, else ``ddp`` or ``fsdp`` as :func:`choose_strategy` picks."""
    if world <= 1:
        return "single"
    return choose_strategy(cfg.dist.strategy, model, device, reference=cfg.loss.beta > 0, lora=cfg.lora.rank > 0)
