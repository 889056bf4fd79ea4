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
    drop = reward_drop(sc, rewards)
    if drop:
        found.append(drop)
    truncated = rows[0].get("completion/truncated_frac")  # the rollout batch's, on each of its lines
    if sc.truncated_max > 0 and truncated is not None and truncated > sc.truncated_max:
        found.append(f"{truncated:.1%} of the batch's completions were cut at rollout.max_new_tokens > "
                     f"sentinel.truncated_max = {sc.truncated_max}")
    if sc.seq_ratio_log_max > 0:
        # None (null in metrics.jsonl) or NaN: not measurable that step (no loss token in the minibatch), not a spread.
        values = [r.get(k) for r in rows for k in ("ratio/seq_min", "ratio/seq_max")
                  if r.get(k) is not None and not math.isnan(r[k])]
        spread = max((abs(math.log(v)) if v > 0 and math.isfinite(v) else math.inf for v in values), default=0.0)
        if spread > sc.seq_ratio_log_max:
            found.append(f"|log sequence ratio| reached {spread:.3g} > sentinel.seq_ratio_log_max = {sc.seq_ratio_log_max}")
    return found


def reward_drop(sc, rewards: dict[int, float | None]) -> str | None:
    """What the reward-drop detector saw: the mean reward of the last ``window`` batches more than
    ``sc.reward_drop`` below the best earlier such mean (once ``2 * window`` batches have a reward), else None."""
    means = [mean for mean, _ in _window_means(sc, rewards)]
    if len(means) <= sc.window or max(means[:-1]) - means[-1] <= sc.reward_drop:
        return None
    return (f"mean reward of the last {sc.window} batches {means[-1]:.3f} is {max(means[:-1]) - means[-1]:.3f} "
            f"below its best {max(means[:-1]):.3f} (sentinel.reward_drop = {sc.reward_drop})")


def _window_means(sc, rewards: dict[int, float | None]) -> list[tuple[float, int]]:
    """(mean reward of ``sc.window`` consecutive batches, the last of them) for every window of ``rewards``, oldest
    first (batches without a finite reward are skipped: None, or NaN where every reward call of the batch failed);
    none while the reward-drop detector is off."""
    if sc.reward_drop <= 0:
        return []
    seen = [(b, r) for b, r in sorted(rewards.items()) if r is not None and math.isfinite(r)]
    return [(sum(r for _, r in seen[i - sc.window:i]) / sc.window, seen[i - 1][0])
            for i in range(sc.window, len(seen) + 1)]


def best_window_end(sc, rewards: dict[int, float | None], before_newest: bool = False) -> int | None:
    """The rollout batch ending the best ``window``-batch mean reward (the latest of equal ones), before the newest
    window with ``before_newest``: the peak a reward drop is measured from. None without a reward-drop detector or
    such a window."""
    means = _window_means(sc, rewards)[:-1 if before_newest else None]
    if not means:
        return None
    best = max(mean for mean, _ in means)
    return max(batch for mean, batch in means if mean == best)


def rollback_limit(trigger: int, peak: int | None) -> int:
    """The latest rollout batch a rollback's checkpoint may resume at, after batch ``trigger`` (0-based) tripped the
    sentinel: one written before the batch before the trigger (the one right before it would replay the same rollouts
    and trip it again) and, after a reward drop whose best window ended at batch ``peak``, one holding the policy that
    sampled batch ``peak`` (a checkpoint resuming at batch b holds the weights that sample batch b): replaying from
    there repeats batch ``peak``'s rollouts, then redoes its update at the lower learning rate. A checkpoint from inside
    the decline resumes with the window's mean still low and trips the sentinel again within a batch or two, before
    the lower learning rate can act (measured: docs/experiments/collapse/)."""
    return trigger - 1 if peak is None else min(trigger - 1, peak)


def response(sc, rollbacks: int, has_older_checkpoint: bool) -> str:
    """What to do about a collapse: ``warn``, ``rollback`` (to a checkpoint :func:`rollback_limit` allows) or
    ``stop``."""
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
