"""What ``--resume`` may change: the keys a resumed run may take new values for, and the fingerprints that let a file
the run reads (model, data, tokenizer) be pointed elsewhere when what is there is the same."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gspo.config.schema import flatten

# What --resume may change. Everything else defines the run -- the objective, the data and its order, the sampling,
# the optimizer's hyper-parameters and schedule shape, the model -- and changing it would make the resumed run neither
# the old one nor a new one (the optimizer state and the data position belong to the old settings).
RESUMABLE = (
    "train.steps",  # train longer (or stop earlier)
    "train.lr",  # the usual reaction to instability; the metrics log the learning rate of every step
    "train.micro_batch_size", "train.logprob_chunk", "train.packing", "train.cuda_graphs",  # memory / speed only
    "train.max_nonfinite_steps",
    # where and how memory is spent, not what is computed
    "model.device", "model.gradient_checkpointing", "model.gpu_memory",
    "rollout.engine", "rollout.fused_step", "rollout.compact_rows", "rollout.vllm_gpu_memory", "rollout.overlap",
    "rollout.decode_processes",  # which processes sample: the same lag, checkpoints either way
    "rollout.decode_gpu",  # where the decode processes run and how the weights reach them: the same numbers
    "rollout.in_flight",  # fresher weights within the lag's bound; the checkpoints hold the same keys either way
    "rewards.workers", "rewards.timeout_s", "env.workers", "env.timeout_s",
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
    flat = flatten(cfg_dict)
    found = {k: source_fingerprint(flat.get(k)) for k in SOURCE_KEYS}
    return {k: v for k, v in found.items() if v is not None}


def resume_changes(old: dict[str, Any], new: dict[str, Any],
                   old_sources: dict[str, str] | None = None) -> tuple[dict[str, list], list[str]]:
    """The keys whose values differ between two resolved configs (``Config.to_dict()``), as ``{key: [old, new]}``, and
    those of them that ``--resume`` may not change. Keys only one side has (another gspo version) are not compared. A
    SOURCE_KEYS path that changed is allowed when what it names now has the fingerprint in ``old_sources``."""
    a, b = flatten(old), flatten(new)
    changed = {k: [a[k], b[k]] for k in a if k in b and a[k] != b[k]}
    old_sources = old_sources or {}

    def allowed(k: str) -> bool:
        if k in SOURCE_KEYS and k in old_sources:
            return source_fingerprint(b[k]) == old_sources[k]
        return any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)

    return changed, [k for k in changed if not allowed(k)]

