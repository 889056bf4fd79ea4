"""How rollout batches reach the update: one :class:`Feed`, chosen once per run by :func:`make_feed`.

- ``base.py``: the interface (reset, take, publish, pause / resume around a checkpoint, drop, close, state_dict) and
  :class:`Queued`, a collected batch waiting for the update;
- ``lag.py``: the fixed lag g(j) = max(j − η, v0), pure: which version samples which batch;
- ``inline.py``: synchronous (η = 0): the batch is collected when the update asks for it;
- ``ahead.py``: η > 0 in this process: the engine collects ahead, in a thread of its own or in turn with the update;
- ``remote.py``: η > 0 with decode processes: the trainers' side of the conversation with them;
- ``transport.py``: the weights' way to the decode processes (packing, broadcast, shared slots).

It never imports the trainer (``gspo.train``) or the sampling side (``gspo.collect``): the collect stage and the
engine come in as objects.
"""
from __future__ import annotations

import torch

from gspo.feed.ahead import Ahead
from gspo.feed.base import Feed, Queued, Weights
from gspo.feed.inline import Inline
from gspo.feed.remote import Remote, RemoteCollector
from gspo.parallel import comm

__all__ = ["Feed", "Queued", "RemoteCollector", "make_feed"]


def make_feed(rollout, *, collector, engine, weights: Weights,
              device: torch.device, roles=None) -> Feed:
    """The feed for ``rollout`` (the run's ``RolloutConfig``): :class:`Inline` at ``max_staleness = 0``, else
    :class:`Remote` when the job has decode processes (``roles``), else :class:`Ahead`. ``collector``: the collect
    stage (a :class:`RemoteCollector` with decode processes); ``weights``: the policy's ``(name, tensor)`` pairs as
    the engine takes them."""
    eta = rollout.max_staleness
    if not eta:
        return Inline(collector.collect, engine, weights)
    if roles is not None:
        return Remote(eta, roles, weights, device, collector, shared=rollout.decode_gpu == "shared")
    threaded = rollout.overlap == "thread"
    # under torchrun the engine thread's gathers go through a group of their own
    group = comm.new_gloo_group() if threaded and comm.active() else None
    return Ahead(eta, threaded, collector.collect, engine, weights, device, group, rollout.in_flight)
