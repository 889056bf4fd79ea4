"""Trainers and decode processes (``rollout.decode_processes = k``): the last ``k`` processes of a ``torchrun`` job
only sample rollout batches, the others only train.

Processes ``0 .. T-1`` (``T = W - k``) are the trainers: they hold the policy (DDP or FSDP2 among themselves), write
the run's files (process 0) and checkpoints, exactly as a job of ``T`` processes would. Processes ``T .. W-1`` are the
decode processes: each has an engine, reward workers and the data stream, and together they sample every rollout
batch as ``k`` processes of a synchronous job would (each its share of the prompts, the groups gathered among them).

The groups (every process creates every one, in this order: torch's rule for new groups):

* ``own``: this process's role (the trainers' on the default backend, the decode processes' on gloo): the group of
  :mod:`gspo.parallel.comm`'s collectives in this process (:func:`comm.set_role_group`);
* ``link`` (gloo): trainer 0 and the decode processes: what to do next (start at a version, a new version, stop);
* ``weights`` (NCCL on GPUs, gloo on CPUs): trainer 0 and the decode processes: the policy's weights, one broadcast of
  a flat buffer per dtype (unused with ``rollout.decode_gpu = 'shared'``, where they travel through shared memory, and
  then gloo: NCCL refuses two processes of one group on one GPU);
* ``batches`` (gloo): decode process 0 and the trainers: each collected batch, as it is done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo.errors import UserError
from gspo.parallel import comm


@dataclass
class Roles:
    """This process's place in a job of trainers and decode processes, and the groups between them."""

    trainers: int  # T: processes 0 .. T-1
    decoders: int  # k: processes T .. T+k-1
    rank: int  # this process's rank in the job
    own: object  # this process's role's group
    link: object  # gloo: trainer 0 + the decode processes (None on the other trainers)
    weights: object  # NCCL / gloo: trainer 0 + the decode processes (None on the other trainers)
    batches: object  # gloo: decode process 0 + the trainers (None on the other decode processes)

    @property
    def decoding(self) -> bool:
        """Whether this process is a decode process."""
        return self.rank >= self.trainers

    @property
    def index(self) -> int:
        """This process's place among its role's processes."""
        return self.rank - self.trainers if self.decoding else self.rank

    @property
    def first_decoder(self) -> int:
        return self.trainers


def check(cfg, world: int) -> int:
    """The trainers a job of ``world`` processes has under ``rollout.decode_processes`` (refused in one line where it
    cannot work); ``world`` without decode processes."""
    k = cfg.rollout.decode_processes
    if not k:
        return world
    if world <= k:
        raise UserError(f"rollout.decode_processes = {k} needs more processes than that, at least one to train; this "
                        f"job has {world} (launch with gspo train --nproc {k + 1} or more, or torchrun).")
    return world - k


def placement(cfg) -> tuple[int, float] | None:
    """Under ``rollout.decode_gpu = 'shared'``: this process's GPU (trainer ``t`` on GPU ``t``, decode process ``i`` on
    trainer ``i mod T``'s) and the share of its memory each process on that GPU gets; None otherwise (one process per
    GPU, ``LOCAL_RANK``'s). Refused in one line on more than one machine (shared memory does not cross machines), with
    more than one trainer on GPUs (every decode process would map trainer 0's GPU: a CUDA context there that no share
    counts, and copies across GPUs) and with PyTorch's expandable segments (CUDA IPC cannot share them between
    unrelated processes)."""
    import os

    k = cfg.rollout.decode_processes
    world, rank = (int(os.environ.get(key, d)) for key, d in (("WORLD_SIZE", 1), ("RANK", 0)))
    if not k or cfg.rollout.decode_gpu != "shared" or world <= k:
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise UserError(f"rollout.decode_gpu = 'shared' needs the whole job on one machine (the weights travel through "
                        f"its shared memory), and this job spans {world // int(os.environ['LOCAL_WORLD_SIZE'])}; set "
                        "rollout.decode_gpu = 'own', or launch on one machine.")
    trainers = world - k
    on_gpus = cfg.model.device != "cpu" and torch.cuda.is_available()
    if on_gpus and trainers > 1:
        raise UserError(f"rollout.decode_gpu = 'shared' is built for one trainer on one GPU, and this job has {trainers} "
                        "(every decode process would map trainer 0's GPU memory); launch "
                        f"--nproc {1 + k} for 1 trainer + {k} decode process{'es' if k > 1 else ''}, or set "
                        "rollout.decode_gpu = 'own' with a GPU per process.")
    if on_gpus and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower().replace(" ", ""):
        raise UserError("rollout.decode_gpu = 'shared' hands the weights over by CUDA IPC, which PyTorch's expandable "
                        "segments cannot do between the job's processes; unset expandable_segments in "
                        "PYTORCH_CUDA_ALLOC_CONF, or set rollout.decode_gpu = 'own'.")
    gpu = rank if rank < trainers else (rank - trainers) % trainers
    return gpu, 1.0 / (1 + sum(1 for i in range(k) if i % trainers == gpu))


def join(cfg, runtime=None):
    """This process's start in a job, the same for a trainer and a decode process: its runtime (``runtime``, or the
    one the config and :func:`placement` give), the job's layout checked, the model's files prepared before the job
    is joined (a GGUF converted: transformers writes them from the job's first process only), the job joined
    (:func:`comm.init`) and the roles split (:func:`split`). Returns ``(runtime, roles)``."""
    from gspo.models.load import prepare as prepare_model_files
    from gspo.parallel.strategy import check_layout
    from gspo.runtime import Runtime

    runtime = runtime or Runtime.from_config(cfg.model, placement(cfg))
    check_layout(cfg, check(cfg, runtime.world_size))
    if runtime.world_size > 1:
        prepare_model_files(cfg.model.name)
    comm.init(runtime.device, cfg.dist.timeout_s, subgroups=cfg.rollout.decode_processes > 0,
              shared_gpus=cfg.rollout.decode_gpu == "shared")
    return runtime, split(cfg, runtime.device)


_ROLES: Roles | None = None


def split(cfg, device: torch.device) -> Roles | None:
    """Give this process its role and make the groups (a collective: every process of the job calls it once, after
    :func:`comm.init`); None without decode processes. Sets the role's group as this process's (comm)."""
    global _ROLES
    k = cfg.rollout.decode_processes
    dist = torch.distributed
    if not k or not comm.in_job():
        return None
    if _ROLES is not None and comm.group() is _ROLES.own:  # (made by this job: comm.close forgets them)
        return _ROLES
    world, rank = dist.get_world_size(), dist.get_rank()
    trainers = check(cfg, world)
    decoders = list(range(trainers, world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    train_group = comm.new_group(list(range(trainers)), backend)
    decode_group = comm.new_gloo_group(decoders)
    link = comm.new_gloo_group([0, *decoders])
    weights = comm.new_group([0, *decoders], "gloo" if cfg.rollout.decode_gpu == "shared" else backend)
    batches = comm.new_gloo_group([trainers, *range(trainers)])  # (torch sorts a group's ranks: the order is for us)
    talks, hands = [0, *decoders], [trainers, *range(trainers)]  # trainer 0 + decoders; decoder 0 + trainers
    _ROLES = Roles(trainers, k, rank, decode_group if rank >= trainers else train_group,
                   link if rank in talks else None, weights if rank in talks else None,
                   batches if rank in hands else None)
    comm.set_role_group(_ROLES.own)
    return _ROLES


def current() -> Roles | None:
    """This process's roles, once :func:`split` gave them (None in a job without decode processes)."""
    return _ROLES
