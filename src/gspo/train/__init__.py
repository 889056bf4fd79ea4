"""Training: the loop (only the stages), the collect stage, the actor, checkpoint state, the sentinel and guards."""
from gspo.train.actor import Actor, Plan, StepOutput
from gspo.train.collect import Collector
from gspo.train.loop import Parts, Trainer, build
from gspo.train.state import TrainState

__all__ = ["Actor", "Collector", "Parts", "Plan", "StepOutput", "TrainState", "Trainer", "build"]
