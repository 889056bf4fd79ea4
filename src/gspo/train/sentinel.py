"""The collapse sentinel: pure functions over the metrics lines of the rollout batch just trained and the reward
history of the run. The loop acts on what they return (warn, roll back, stop)."""
from __future__ import annotations

import math
from typing import Any


def collapse_findings(sc, rows: list[dict[str, Any]], rewards: dict[int, float | None]) -> list[str]:
    """What each detector of ``sentinel.*`` (``sc``) saw in ``rows`` (the batch's metrics lines, minibatch 0 first)
    and ``rewards`` (rollout batch -> ``reward/mean``, this batch included); empty when the run looks healthy."""
    found = []
    entropy = rows[0].get("entropy")
    if sc.entropy_min > 0 and entropy is not None and entropy < sc.entropy_min:
        found.append(f"entropy {entropy:.4f} < sentinel.entropy_min = {sc.entropy_min}")
    history = [r for _, r in sorted(rewards.items()) if r is not None]
    if sc.reward_drop > 0 and len(history) >= 2 * sc.window:
        means = [sum(history[i - sc.window:i]) / sc.window for i in range(sc.window, len(history) + 1)]
        if max(means[:-1]) - means[-1] > sc.reward_drop:
            found.append(f"mean reward of the last {sc.window} batches {means[-1]:.3f} is {max(means[:-1]) - means[-1]:.3f} "
                         f"below its best {max(means[:-1]):.3f} (sentinel.reward_drop = {sc.reward_drop})")
    if sc.seq_ratio_log_max > 0:
        # None (null in metrics.jsonl) or NaN: not measurable that step (no loss token in the minibatch), not a spread.
        values = [r.get(k) for r in rows for k in ("ratio/seq_min", "ratio/seq_max")
                  if r.get(k) is not None and not math.isnan(r[k])]
        spread = max((abs(math.log(v)) if v > 0 and math.isfinite(v) else math.inf for v in values), default=0.0)
        if spread > sc.seq_ratio_log_max:
            found.append(f"|log sequence ratio| reached {spread:.3g} > sentinel.seq_ratio_log_max = {sc.seq_ratio_log_max}")
    return found


def response(sc, rollbacks: int, has_older_checkpoint: bool) -> str:
    """What to do about a collapse: ``warn``, ``rollback`` (to a checkpoint older than the batch before the trigger)
    or ``stop``."""
    if sc.action == "warn":
        return "warn"
    if sc.action == "rollback" and has_older_checkpoint and rollbacks < sc.max_rollbacks:
        return "rollback"
    return "stop"


def stop_reason(sc, rollbacks: int, has_older_checkpoint: bool) -> str:
    """Why a ``rollback`` sentinel stopped instead (empty for ``stop``)."""
    if sc.action != "rollback":
        return ""
    if has_older_checkpoint:
        return f" ({rollbacks} rollbacks done, sentinel.max_rollbacks = {sc.max_rollbacks})"
    return (" (no checkpoint older than the batch before the trigger to roll back to; it would replay the same "
            "rollouts: raise log.keep_checkpoints)")
