"""The learning-rate schedule, a pure function of the optimizer step: nothing to save in a checkpoint but the step."""
from __future__ import annotations

import math


def lr_factor(train_cfg, step: int) -> float:
    """Multiplier of ``train.lr`` at optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps``, then
    ``constant``, ``linear`` to 0 or ``cosine`` to 0 at ``train.steps``."""
    t = train_cfg
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return 1.0 - progress if t.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
