"""The sampling side: prompts -> engine -> rewards -> advantages, as a rollout batch.

- ``stage.py``: the collect stage (:class:`Collector`), one rollout batch per call;
- ``sampler.py``: the sampling side's parts built from a config (engine, reward workers, data, collect stage);
- ``decoder.py``: a decode process (``rollout.decode_processes``), which runs only this side.

It never imports the trainer (``gspo.train``) or the feed that carries its batches to it (``gspo.feed``) beyond the
feed's pure lag and weight transport.
"""
from gspo.collect.stage import Collector

__all__ = ["Collector"]
