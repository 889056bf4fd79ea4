"""Checkpoints of a run: model (as a loadable HF directory), optimizer, scheduler, every RNG and the data position.
This module owns the files and their format; the RNG states in them are captured and restored by :mod:`gspo.runtime`.

A checkpoint is written into ``step-NNNNNN.tmp``, fsynced, renamed to ``step-NNNNNN`` and marked complete by a
``COMPLETE`` file written last, so a crash mid-write never leaves something that looks like a checkpoint; its
``manifest.json`` records every file's size and CRC-32 as written (each process records the files it wrote), so that
a file truncated, lost or changed afterwards is found (:func:`verify`) before anything is loaded from it; old
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
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from gspo.parallel import comm

MARKER = "COMPLETE"
MANIFEST = "manifest.json"  # {"files": {relative path: [size, crc32]}} of every file but MARKER
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


def aside(path: Path, name: str) -> Path:
    """Where to move ``path`` out of the way: its sibling ``name`` or, when an earlier move in the same second took
    that name, ``name-2``, ``name-3``...; a rename onto the earlier one would fail (or, for an empty directory,
    silently replace it)."""
    target, n = path.with_name(name), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{name}-{n}")
    return target


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


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written, with the reason in one line (under ``torchrun``: the same on every
    process, naming the one that failed)."""


def attempt(fn, *args) -> tuple[Any, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, the error)`` whatever ``fn`` raised -- a DCP ``CheckpointException`` is a
    BaseException, safetensors raises its own ``SafetensorError``, pickle its own -- but an interrupt or an exit: a
    checkpoint's read or write either works or fails with a reason, never with a surprise kind of error."""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        return None, e


def why(e: BaseException) -> str:
    """One line for a checkpoint's failed read or write: the OS's reason and its file, the first failing process's
    error inside a DCP ``CheckpointException`` (whose own text is a traceback per process), else the first line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items())
        return f"process {rank}: {why(inner)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def digests(root: Path, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of the files ``names`` under ``root``, read by several threads (zlib's CRC-32 runs
    at ~3 GB/s a core and releases the GIL; right after the write the files are still in the page cache)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        crcs = list(pool.map(lambda name: _crc32(root / name), names))
    return {name: [(root / name).stat().st_size, crc] for name, crc in zip(names, crcs)}


def verify(ckpt: Path, share: tuple[int, int] = (0, 1), contents: bool = True) -> str | None:
    """Why checkpoint ``ckpt`` is not as it was written (a file its manifest lists is missing, has another size or,
    with ``contents``, another CRC-32), or None. ``share`` = (rank, number of processes): every process checks every
    size, and reads the contents of its share of the files, every N-th one. A checkpoint without a manifest (written
    before gspo recorded one) cannot be checked: None."""
    path = ckpt / MANIFEST
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())["files"]
        files = {str(name): (int(size), int(crc)) for name, (size, crc) in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__})"
    for name, (size, _) in sorted(files.items()):
        try:
            actual = (ckpt / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, not the {size} written"
    if contents:
        rank, world = share
        for name, (_, crc) in digests(ckpt, sorted(files)[rank::world]).items():
            if crc != files[name][1]:
                return f"{name} is not what was written (another CRC-32)"
    return None


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
                    prepared: dict[str, list[int]] | None = None, pinned: int | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune all but the ``keep`` newest complete ones and checkpoint
    ``pinned`` (a step: the collapse sentinel's rollback target from before a reward drop, whatever its age). ``model_state``
    (a snapshot of ``model.state_dict()``) is written instead of the live weights when given; ``seconds`` gets the
    time of the writes and of the fsync. ``prepared``: the ``.tmp`` directory exists and holds these files of this
    checkpoint already, with their sizes and CRC-32s (those the processes of a ``torchrun`` job wrote)."""
    t0 = time.perf_counter()
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f"step-{step:06d}.tmp"
    # What a crash left (one run writes one checkpoint at a time): a half-written checkpoint, an interrupted delete.
    for left in [*ckpt_root.glob("step-*.tmp"), *ckpt_root.glob(f"step-*{_DISCARDED}")]:
        if not (prepared is not None and left == tmp):
            shutil.rmtree(left, ignore_errors=True)
    if prepared is None:
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
    _write_manifest(tmp, prepared or {})
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


def _write_manifest(tmp: Path, prepared: dict[str, list[int]]) -> None:
    """The manifest of the files in ``tmp``: those of ``prepared`` as their writers recorded them, the rest read here.
    Every recorded size is checked against the file as this process sees it (a file another process wrote may not
    have reached a shared file system), so that a checkpoint is only marked complete with all of its files whole."""
    names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    files = {**digests(tmp, [n for n in names if n not in prepared]), **prepared}
    (tmp / MANIFEST).write_text(json.dumps({"files": dict(sorted(files.items()))}))
    problem = verify(tmp, contents=False)
    if problem:
        raise CheckpointWriteError(f"checkpoint {tmp.name}: {problem}")


def checkpoint_step(ckpt: Path) -> int:
    """The optimizer step of a checkpoint, from its name (``step-NNNNNN``)."""
    return int(ckpt.name.split("-", 1)[1])


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.glob("step-*") if _NAME.fullmatch(p.name) and p.is_dir() and (p / MARKER).exists())


def what_is_kept(run_dir: Path) -> str:
    """What a stopped run's directory holds to go on from, in words: its newest complete checkpoint, or none yet."""
    ckpts = complete_checkpoints(Path(run_dir) / "checkpoints")
    return f"keeps its last checkpoint, {ckpts[-1].name}" if ckpts else "has no checkpoint yet (--resume starts it over)"


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


def _agreed(result: Any, error: BaseException | None) -> list[Any]:
    """Every process's ``result`` of a part of a collective write, once all know that every part worked; otherwise the
    first failure, raised on every process alike (so none waits in a collective another never reaches, and none
    marks a checkpoint complete that another failed to write its part of)."""
    reason = None
    if error is not None:  # a DCP error names the process that failed already (each gets it from DCP)
        reason = why(error) if getattr(error, "failures", None) else f"process {comm.rank_world()[0]}: {why(error)}"
    told = comm.gather_objects((result, reason))
    failed = [reason for _, reason in told if reason is not None]
    if failed:
        raise CheckpointWriteError(failed[0]) from error
    return [r for r, _ in told]


def _writer(name: str, world: int) -> int:
    """The process that records DCP file ``name``: the one that wrote it, as DCP names its files (``__R_N.distcp``),
    so it is read back from that process's page cache; rank 0 for any other (``.metadata``, another naming)."""
    found = re.match(r"__(\d+)_", Path(name).name)
    return int(found[1]) if found and int(found[1]) < world else 0


def _write_collectively(ckpt_root: Path, step: int, write_own, complete, model_state=lambda: None) -> Path:
    """Checkpoint ``step`` written by every process of a ``torchrun`` job: rank 0 opens its ``.tmp`` directory;
    every process writes its part there (``write_own(tmp)`` returns the names of the files whose sizes and CRC-32s
    it records: its own, and its share of those the processes wrote together) and they agree that all parts are
    written; every process takes part in ``model_state()`` (the weights rank 0 exports, gathered); then rank 0
    completes the checkpoint (``complete(prepared, weights)``: :func:`save_checkpoint` with the files recorded), and
    all agree on that before anyone goes on or reads it back. A failure at any point is raised on every process as
    the same :class:`CheckpointWriteError`; what was written stays a ``.tmp``, never marked complete."""
    tmp = ckpt_root / f"step-{step:06d}.tmp"
    is_main = comm.rank_world()[0] == 0

    def open_tmp() -> None:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    _agreed(*(attempt(open_tmp) if is_main else (None, None)))
    names, error = attempt(write_own, tmp)
    own, error = attempt(digests, tmp, names) if error is None else (None, error)
    prepared = {name: entry for part in _agreed(own, error) for name, entry in part.items()}
    weights = model_state()
    _agreed(*(attempt(complete, prepared, weights) if is_main else (None, None)))
    return ckpt_root / f"step-{step:06d}"


def _save_own(rank_state: dict[str, Any], tmp: Path, rank: int) -> str:
    """This process's ``rank-NNNNN.pt``, flushed to disk by the process that wrote it; returns its name."""
    name = RANK_FILE.format(rank)
    with open(tmp / name, "wb") as f:
        torch.save(rank_state, f)
        f.flush()
        os.fsync(f.fileno())
    return name


def save_sharded(ckpt_root: Path, step: int, model, optimizer, tokenizer, state: dict[str, Any],
                 rank_state: dict[str, Any], keep: int, pinned: int | None = None) -> Path:
    """A checkpoint written by every process of a ``torchrun`` job, in the layout of :func:`save_checkpoint` plus:
    ``dcp/`` (the sharded model and optimizer, reshardable to any number of processes, written by all), and one
    ``rank-NNNNN.pt`` per process (its RNGs). Rank 0 then exports the full model as the checkpoint's HF files (for
    ``gspo eval`` and any other tool), writes ``trainer_state.pt`` (the run's own counters, shuffle and data
    position), and renames and marks the directory complete only after every process has finished its part (see
    :func:`_write_collectively`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    rank, world = comm.rank_world()

    def write_own(tmp: Path) -> list[str]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / DCP_DIR),
                 process_group=comm.group())
        # Every process returns from the save once all files are written (its last step is collective), so each sees
        # them all and records those it wrote.
        shards = sorted(p.relative_to(tmp).as_posix() for p in (tmp / DCP_DIR).iterdir() if p.is_file())
        return [_save_own(rank_state, tmp, rank), *(n for n in shards if _writer(n, world) == rank)]

    def complete(prepared: dict[str, list[int]], full: dict[str, torch.Tensor]) -> None:
        save_checkpoint(ckpt_root, step, model, tokenizer, state, keep, model_state=full, prepared=prepared,
                        pinned=pinned)

    # The HF export: every process gives its shards, rank 0 receives the full tensors on the CPU.
    return _write_collectively(ckpt_root, step, write_own, complete, lambda: get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def save_replicated(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any], rank_state: dict[str, Any],
                    keep: int, pinned: int | None = None) -> Path:
    """A checkpoint of a policy every process of a ``torchrun`` job holds whole and alike (LoRA: the adapter and its
    optimizer state): rank 0 writes it as one process would (:func:`save_checkpoint`; ``trainer_state.pt`` holds the
    optimizer), every process its own ``rank-NNNNN.pt`` (its RNGs), and it is complete only once all have written. It
    resumes at any number of processes, one included."""
    rank = comm.rank_world()[0]
    return _write_collectively(ckpt_root, step, lambda tmp: [_save_own(rank_state, tmp, rank)],
                               lambda prepared, _: save_checkpoint(ckpt_root, step, model, tokenizer, state, keep,
                                                                   prepared=prepared, pinned=pinned))


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

    _initialise_optimizer(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt / DCP_DIR), process_group=comm.group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _initialise_optimizer(optimizer) -> None:
    """Give a fresh optimizer its state tensors (AdamW's moments and step count, zeros), which ``dcp.load`` fills:
    it loads only the keys of the state dict it is handed, and ``get_state_dict`` creates them itself only when no
    parameter has a gradient -- under DDP every gradient is a view of a flat buffer from the start, so a resumed run
    silently restarted AdamW from empty moments. One step with zero gradients at learning rate 0 (what torch's helper
    does), the gradients' values and storage left as they were."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    kept = [(p, p.grad.clone()) for p in params if p.grad is not None]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    held = {id(p) for p, _ in kept}
    for p in params:
        if id(p) not in held:
            p.grad = None
    for p, g in kept:
        p.grad.copy_(g)


def by_index(model, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """:func:`by_name`'s inverse: a state keyed by parameter name, numbered in ``model.parameters()`` order again (what
    ``optimizer.load_state_dict`` takes)."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]]
    return {"state": {index[n]: v for n, v in optimizer_state["state"].items()}, "param_groups": groups}


def by_name(model, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A one-process ``optimizer.state_dict()`` (parameters numbered in ``model.parameters()`` order) keyed by
    parameter name instead, the form torch's distributed state-dict helpers take."""
    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    return {"state": {names[i]: v for i, v in optimizer_state["state"].items()}, "param_groups": groups}
