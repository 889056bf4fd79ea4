"""Training: the loop (only the stages), the parts it sequences (built in parts), the actor and its log-prob passes,
checkpoints, the run directory, the sentinel and guards. The sampling side is :mod:`gspo.collect`, and how its batches
reach the update is :mod:`gspo.feed`."""
from gspo.parallel.plan import Plan
from gspo.train.actor import Actor, StepOutput
from gspo.collect import Collector
from gspo.train.loop import Trainer
from gspo.train.parts import Parts, build
from gspo.train.checkpoint import TrainState

__all__ = ["Actor", "Collector", "Parts", "Plan", "StepOutput", "TrainState", "Trainer", "build"]
