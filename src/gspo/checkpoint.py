"""Checkpoints of a run: model (as a loadable HF directory), optimizer, scheduler, every RNG and the data position.

A checkpoint is written into ``step-NNNNNN.tmp``, fsynced, renamed to ``step-NNNNNN`` and marked complete by a
``COMPLETE`` file written last, so a crash mid-write never leaves something that looks like a checkpoint; old
checkpoints are deleted only after the new one is complete, and a checkpoint being deleted is first renamed out of
the ``step-NNNNNN`` namespace, so a crash mid-delete never leaves a marked checkpoint without its weights.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
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


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fsync_tree(path: Path) -> None:
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
    """A copy of ``obj`` (nested dicts, lists and tuples of tensors) whose tensors are on the CPU and detached: a
    snapshot that later optimizer steps cannot change, for a checkpoint written in the background. Views of the same
    memory (tied embeddings) stay one tensor, so the writer sees them tied as the model does. GPU tensors are copied
    into pinned host memory without blocking, then waited for once (on an H100 machine the 1.6 GB of a 135M-parameter
    model and its AdamW state took 1.5 s pageable, 1.2 s pinned with the allocation; later snapshots reuse the pinned
    blocks through torch's caching host allocator)."""
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
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    out = copy(obj)
    for device in set(on_gpu):
        torch.cuda.synchronize(device)
    return out


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any], keep: int,
                    model_state: dict[str, torch.Tensor] | None = None, seconds: dict[str, float] | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune all but the ``keep`` newest complete ones. ``model_state``
    (a snapshot of ``model.state_dict()``) is written instead of the live weights when given; ``seconds`` gets the
    time of the writes and of the fsync."""
    t0 = time.perf_counter()
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f"step-{step:06d}.tmp"
    # What a crash left (one run writes one checkpoint at a time): a half-written checkpoint, an interrupted delete.
    for left in [*ckpt_root.glob("step-*.tmp"), *ckpt_root.glob(f"step-*{_DISCARDED}")]:
        shutil.rmtree(left, ignore_errors=True)
    tmp.mkdir()
    # The optimizer state (twice the model's size) is written beside the model, in a second thread: both writes are
    # bound by copying and the disk, and each releases the GIL while it writes.
    with ThreadPoolExecutor(max_workers=1) as pool:
        optimizer_file = pool.submit(torch.save, state, tmp / "trainer_state.pt")
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
        optimizer_file.result()
    (tmp / "state.json").write_text(json.dumps({k: state[k] for k in ("step", "rollout_batch") if k in state}))
    t1 = time.perf_counter()
    _fsync_tree(tmp)
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
        _discard(old)
    return final


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.glob("step-*") if _NAME.fullmatch(p.name) and p.is_dir() and (p / MARKER).exists())


def load_model_weights(model, ckpt: Path) -> None:
    """Load the weights of a checkpoint written by :func:`save_checkpoint` into ``model`` in place."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    own = model.state_dict()
    if set(sd) - set(own):
        # save_pretrained wrote some weights in the family's on-disk layout (an MoE's fused experts go out per expert):
        # transformers' loader converts them back.
        from transformers import AutoModelForCausalLM

        dtype = next(model.parameters()).dtype
        sd = AutoModelForCausalLM.from_pretrained(ckpt, config=model.config, dtype=dtype).state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
