"""The fixed lag of asynchronous training, pure: which policy version samples which rollout batch.

The policy's version is the number of rollout batches it has been trained on, so rollout batch ``j`` is trained by
version ``j``. Under staleness η (``rollout.max_staleness``) it is sampled by version

    g(j) = max(j − η, v0)          v0: the version the timeline started from (0 for a new run)

so its staleness ``j − g(j)`` is η once the feed is full (less in a timeline's first η batches). g depends on ``j``
alone, never on timing: that is what makes an asynchronous run reproducible bit for bit, whether the batches are
collected in a thread, in turn with the update or by decode processes (:mod:`gspo.feed`).

Every side of a feed asks the same three questions of it: which version samples batch ``j`` (:meth:`Lag.version_of`),
whether a batch still to collect needs version ``v`` (:meth:`Lag.needed`: only then are its weights copied or sent),
and how far a collector that holds version ``v`` goes before it must wait for a newer one (:meth:`Lag.runs_until`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lag:
    """g(j) = max(j − eta, v0) over the rollout batches ``[v0, total)`` of one timeline."""

    eta: int  # rollout.max_staleness
    v0: int  # the version the timeline started from
    total: int  # one past the timeline's last rollout batch

    def version_of(self, j: int) -> int:
        """g(j): the policy version that samples rollout batch ``j``."""
        return max(j - self.eta, self.v0)

    def needed(self, v: int, first: int) -> bool:
        """Whether a batch from ``first`` on (the next one still to collect) is sampled by version ``v``. Only
        batches ``j <= v + eta`` can be: g(j) = v needs j = v + eta, or j <= v0 + eta when v = v0."""
        return any(self.version_of(j) == v for j in range(first, min(self.total, v + self.eta + 1)))

    def runs_until(self, v: int, first: int) -> int:
        """One past the last batch a collector holding version ``v`` collects from batch ``first`` on without a newer
        version: every batch ``j < v + eta + 1`` (g(j) <= v), never past the timeline's end, never before ``first``."""
        return max(first, min(self.total, v + self.eta + 1))
