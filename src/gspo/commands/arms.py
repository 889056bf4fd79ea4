"""The arms of ``gspo compare`` and ``gspo report``: an arm is a preset followed by "+"-suffixes that each switch
settings on (``grpo+r2``: GRPO with Routing Replay R2; ``gspo+mb8``: GSPO with 8 minibatches per rollout batch).
:func:`parse_arm` reads an arm's name into its settings (what compare trains), :func:`arm_label` reads a run's
settings back into its arm's name (how the report groups runs).
"""
from __future__ import annotations

from typing import Any

from gspo.config import PRESETS, flatten, unknown_key
from gspo.errors import UserError

# Comparison arms (``gspo compare --algos``): a preset, then "+"-suffixes, each switching settings on.
ARM_SUFFIXES: dict[str, dict[str, Any]] = {
    "r2": {"moe.routing_replay": "old"},  # Routing Replay R2
    "r3": {"moe.routing_replay": "rollout"},  # Routing Replay R3
    "enginelp": {"train.old_logprobs": "rollout"},  # the engine's log-probs as the old policy's (no recomputation)
    "int8": {"rollout.engine_weight_bits": 8},  # the engine samples from int8-rounded weights
    "exact": {"rollout.exact": True},  # engine and trainer compute the same log-probs, bit for bit
    "credit": {"loss.step_credit": "task"},  # per-token process credit of the task's steps
    "envcredit": {"loss.step_credit": "env"},  # per-turn credit from an environment's step rewards
    "tis": {"loss.mismatch_correction": "tis"},  # engine-mismatch corrections (gspo.algorithms.corrections)
    "seqmask": {"loss.mismatch_correction": "sequence_mask"},
    "icepop": {"loss.mismatch_correction": "icepop"},
}
# Suffixes with a number: +mb8 (8 minibatches per rollout batch), +lr2e-5 (learning rate 2e-5)
ARM_NUMBERED: dict[str, tuple[str, type]] = {"mb": ("train.minibatches", int), "lr": ("train.lr", float),
                                             "stale": ("rollout.max_staleness", int)}
ARM_SUFFIX_NAMES = [*("+" + k for k in ARM_SUFFIXES), "+mb<minibatches>", "+lr<learning rate>",
                    "+stale<rollout batches>"]


def parse_arm(arm: str) -> tuple[str, dict[str, Any]]:
    """``"grpo+r2"`` -> ``("grpo", {"moe.routing_replay": "old"})``, ``"gspo+mb8"`` -> ``("gspo",
    {"train.minibatches": 8})``; a UserError for an unknown preset or suffix."""
    preset, *suffixes = [part.strip() for part in arm.split("+")]
    if preset not in PRESETS:
        raise unknown_key(preset, list(PRESETS), "algorithm value ")
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
    flat = flatten(config)
    if flat.get("log.label"):
        return str(flat["log.label"])
    label = str(config.get("algorithm", "?"))
    for suffix, keys in ARM_SUFFIXES.items():
        if all(flat.get(k) == v for k, v in keys.items()):
            label += "+" + suffix
    return label
