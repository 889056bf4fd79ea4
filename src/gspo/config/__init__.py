"""The run configuration, one module per concern: :mod:`~gspo.config.schema` (the dataclasses, a docstring per field),
:mod:`~gspo.config.presets` (what each algorithm sets), :mod:`~gspo.config.load` (TOML, dotted overrides, device
tables), :mod:`~gspo.config.checks` (which values are allowed) and :mod:`~gspo.config.resume` (what ``--resume`` may
change). The names below are the package's public ones: import them from ``gspo.config``.
"""
from gspo.config.checks import validate
from gspo.config.load import build_config, field_docs, load_config, load_toml, parse_override
from gspo.config.presets import LEVEL_EPS, PRESETS, TASK_STEP_CREDIT, apply_preset
from gspo.config.resume import RESUMABLE, SOURCE_KEYS, resume_changes, source_fingerprint, source_fingerprints
from gspo.config.schema import (
    Config, DapoConfig, DataConfig, DistConfig, LogConfig, LoraConfig, LossConfig, ModelConfig, MoEConfig,
    PPOConfig, RewardConfig, RewardsConfig, RolloutConfig, SentinelConfig, TrainConfig, flatten, unknown_key,
)

__all__ = [
    "Config", "DapoConfig", "DataConfig", "DistConfig", "LEVEL_EPS", "LogConfig", "LoraConfig", "LossConfig",
    "ModelConfig", "MoEConfig", "PRESETS", "RESUMABLE", "RewardConfig", "RewardsConfig", "RolloutConfig",
    "PPOConfig", "SOURCE_KEYS", "SentinelConfig", "TASK_STEP_CREDIT", "TrainConfig", "apply_preset", "build_config", "field_docs",
    "flatten", "load_config", "load_toml", "parse_override", "resume_changes", "source_fingerprint",
    "source_fingerprints", "unknown_key", "validate",
]
