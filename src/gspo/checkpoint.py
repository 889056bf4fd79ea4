"""Checkpoints of a run: model (as a loadable HF directory), optimizer, scheduler, every RNG and the data position.
This module owns the files and their format; the RNG states in them are captured and restored by :mod:`gspo.runtime`.

A checkpoint is written into ``step-NNNNNN.tmp``, fsynced, renamed to ``step-NNNNNN`` and marked complete by a
``COMPLETE`` file written last, so a crash mid-write never leaves something that looks like a checkpoint; old
checkpoints are deleted only after the new one is complete, and a checkpoint being deleted is first renamed out of
the ``step-NNNNNN`` namespace, so a crash mid-delete never leaves a marked checkpoint without its weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
_NAME = re.compile(r"step-\d{6,}")
_DISCARDED = ".discarded"


def _discard(path: Path) -> None:
    """Delete the checkpoint directory ``path``: renamed first (one atomic step, after which nothing takes it for a
    checkpoint), then removed. ``shutil.rmtree`` alone, killed halfway, could leave ``COMPLETE`` beside missing weights
    (seen in CI: a SIGKILL while pruning an old checkpoint)."""
    gone = path.with_name(path.name + _DISCARDED)
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def fsync_tree(path: Path) -> None:
    """Every file under ``path``, then ``path`` itself, flushed to disk (before a rename makes the tree visible)."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts, lists, tuples and dataclasses of tensors) whose tensors are on the CPU and
    detached: a snapshot that later optimizer steps cannot change, for a checkpoint written in the background. Views
    of the same memory (tied embeddings) stay one tensor, so the writer sees them tied as the model does. GPU tensors
    are copied into pinned host memory without blocking, then waited for once
    (on an H100 machine the 1.6 GB of a 135M-parameter model and its AdamW state took 1.5 s pageable, 1.2 s pinned with
    the allocation; later snapshots reuse the pinned blocks through torch's caching host allocator)."""
    seen: dict = {}
    on_gpu = []

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()),
                   x.dtype)
            if key not in seen:
                if x.is_cuda:
                    seen[key] = torch.empty_like(x, device="cpu", pin_memory=True).copy_(x.detach(), non_blocking=True)
                    on_gpu.append(x.device)
                else:
                    seen[key] = x.detach().to("cpu", copy=True)
            return seen[key]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):  # the typed containers (a Rollout, Groups)
            return type(x)(**{f.name: copy(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    out = copy(obj)
    for device in set(on_gpu):
        torch.cuda.synchronize(device)
    return out


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any], keep: int,
                    model_state: dict[str, torch.Tensor] | None = None, seconds: dict[str, float] | None = None,
                    prepared: bool = False, pinned: int | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune all but the ``keep`` newest complete ones and checkpoint
    ``pinned`` (a step: the collapse sentinel's rollback target from before a reward drop, whatever its age). ``model_state``
    (a snapshot of ``model.state_dict()``) is written instead of the live weights when given; ``seconds`` gets the
    time of the writes and of the fsync. ``prepared``: the ``.tmp`` directory exists and holds files of this
    checkpoint already (a sharded one's)."""
    t0 = time.perf_counter()
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f"step-{step:06d}.tmp"
    # What a crash left (one run writes one checkpoint at a time): a half-written checkpoint, an interrupted delete.
    for left in [*ckpt_root.glob("step-*.tmp"), *ckpt_root.glob(f"step-*{_DISCARDED}")]:
        if not (prepared and left == tmp):
            shutil.rmtree(left, ignore_errors=True)
    if not prepared:
        tmp.mkdir()
    # The optimizer state (twice the model's size) is written beside the model, in a second thread: both writes are
    # bound by copying and the disk, and each releases the GIL while it writes.
    with ThreadPoolExecutor(max_workers=1) as pool:
        optimizer_file = pool.submit(torch.save, state, tmp / "trainer_state.pt")
        # A LoRA policy (a PeftModel) writes its adapter; "auto" embedding-layer saving would look the base model up
        # on the hub at every checkpoint.
        extra = {"save_embedding_layers": False} if hasattr(model, "peft_config") else {}
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state, **extra)
        tokenizer.save_pretrained(tmp)
        optimizer_file.result()
    _plain_architecture(tmp)
    (tmp / "state.json").write_text(json.dumps({k: state[k] for k in ("step", "rollout_batch") if k in state}))
    t1 = time.perf_counter()
    fsync_tree(tmp)
    if final.exists():
        _discard(final)
    os.replace(tmp, final)
    with open(final / MARKER, "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    if seconds is not None:
        seconds.update(write_s=round(t1 - t0, 3), fsync_s=round(time.perf_counter() - t1, 3))
    for old in complete_checkpoints(ckpt_root)[:-keep] if keep > 0 else []:
        if checkpoint_step(old) != pinned:
            _discard(old)
    return final


def checkpoint_step(ckpt: Path) -> int:
    """The optimizer step of a checkpoint, from its name (``step-NNNNNN``)."""
    return int(ckpt.name.split("-", 1)[1])


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.glob("step-*") if _NAME.fullmatch(p.name) and p.is_dir() and (p / MARKER).exists())


def read_full_weights(model, ckpt: Path) -> dict[str, torch.Tensor]:
    """The full weights of checkpoint ``ckpt``'s HF model files, named as ``model`` names them."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    own = set(model.state_dict())
    if set(sd) - own:
        # save_pretrained wrote some weights in the family's on-disk layout (an MoE's fused experts go out per expert):
        # transformers' loader converts them back.
        from transformers import AutoModelForCausalLM

        dtype = next(model.parameters()).dtype
        sd = AutoModelForCausalLM.from_pretrained(ckpt, config=model.config, dtype=dtype).state_dict()
    return sd


def load_model_weights(model, ckpt: Path) -> None:
    """Load the weights of a checkpoint written by :func:`save_checkpoint` into ``model`` in place."""
    sd = read_full_weights(model, ckpt)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()


# ---------------------------------------------------------------------------------------------- several processes

DCP_DIR = "dcp"  # a sharded checkpoint's model and optimizer, in torch's distributed checkpoint format
RANK_FILE = "rank-{:05d}.pt"  # each process's own RNG and sampler state


def _open_collective(ckpt_root: Path, step: int) -> Path:
    """Rank 0 makes checkpoint ``step``'s ``.tmp`` directory; every process returns it once it exists."""
    import torch.distributed as dist

    tmp = ckpt_root / f"step-{step:06d}.tmp"
    if dist.get_rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    return tmp


def _close_collective(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any], keep: int,
                      model_state: dict[str, torch.Tensor] | None, pinned: int | None) -> Path:
    """After every process has written its files: rank 0 completes the checkpoint (``save_checkpoint`` on the
    prepared directory), and nobody goes on, or reads it back, before it is complete."""
    import torch.distributed as dist

    dist.barrier()  # every process's files are written (each fsyncs its own; rank 0 fsyncs the tree again)
    if dist.get_rank() == 0:
        save_checkpoint(ckpt_root, step, model, tokenizer, state, keep, model_state=model_state, prepared=True,
                        pinned=pinned)
    dist.barrier()
    return ckpt_root / f"step-{step:06d}"


def save_sharded(ckpt_root: Path, step: int, model, optimizer, tokenizer, state: dict[str, Any],
                 rank_state: dict[str, Any], keep: int, pinned: int | None = None) -> Path:
    """A checkpoint written by every process of a ``torchrun`` job, in the layout of :func:`save_checkpoint` plus:
    ``dcp/`` (the sharded model and optimizer, reshardable to any number of processes, written by all), and one
    ``rank-NNNNN.pt`` per process (its RNGs). Rank 0 then exports the full model as the checkpoint's HF files (for
    ``gspo eval`` and any other tool), writes ``trainer_state.pt`` (the run's own counters, shuffle and data
    position), and renames and marks the directory complete only after every process has finished its part."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    tmp = _open_collective(ckpt_root, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    torch.save(rank_state, tmp / RANK_FILE.format(dist.get_rank()))
    # The HF export: every process gives its shards, rank 0 receives the full tensors on the CPU.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _close_collective(ckpt_root, step, model, tokenizer, state, keep, full, pinned)


def save_replicated(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any], rank_state: dict[str, Any],
                    keep: int, pinned: int | None = None) -> Path:
    """A checkpoint of a policy every process of a ``torchrun`` job holds whole and alike (LoRA: the adapter and its
    optimizer state): rank 0 writes it as one process would (:func:`save_checkpoint`; ``trainer_state.pt`` holds the
    optimizer), every process its own ``rank-NNNNN.pt`` (its RNGs), and it is complete only once all have written. It
    resumes at any number of processes, one included."""
    import torch.distributed as dist

    tmp = _open_collective(ckpt_root, step)
    torch.save(rank_state, tmp / RANK_FILE.format(dist.get_rank()))
    return _close_collective(ckpt_root, step, model, tokenizer, state, keep, None, pinned)


def _plain_architecture(ckpt: Path) -> None:
    """FSDP2 renames the model's class (``FSDPLlamaForCausalLM``), and save_pretrained records that name: restore the
    family's own so that transformers and other tools load the export."""
    path = ckpt / "config.json"
    if not path.exists():  # a LoRA checkpoint holds the adapter alone
        return
    config = json.loads(path.read_text())
    names = config.get("architectures") or []
    fixed = [n[len("FSDP"):] if n.startswith("FSDP") else n for n in names]
    if fixed != names:
        config["architectures"] = fixed
        path.write_text(json.dumps(config, indent=2))


def load_sharded(ckpt: Path, model, optimizer) -> None:
    """Model and optimizer from a sharded checkpoint's DCP files, resharded to this job (any number of processes,
    one included) in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def by_name(model, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A one-process ``optimizer.state_dict()`` (parameters numbered in ``model.parameters()`` order) keyed by
    parameter name instead, the form torch's distributed state-dict helpers take."""
    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    return {"state": {names[i]: v for i, v in optimizer_state["state"].items()}, "param_groups": groups}
