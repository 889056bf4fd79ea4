"""Training: the loop (only the stages), the parts it sequences (built in parts), the collect stage, the actor and its
log-prob passes, checkpoints, the run directory, the sentinel and guards."""
from gspo.parallel.plan import Plan
from gspo.train.actor import Actor, StepOutput
from gspo.train.collect import Collector
from gspo.train.loop import Trainer
from gspo.train.parts import Parts, build
from gspo.train.checkpoint import TrainState

__all__ = ["Actor", "Collector", "Parts", "Plan", "StepOutput", "TrainState", "Trainer", "build"]
