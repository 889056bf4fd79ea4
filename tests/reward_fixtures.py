"""Reward functions that misbehave on purpose, imported by path (``reward_fixtures:hang``) in test_rewards.py."""
import os
import time


def hang(completion, example):
    """Never returns for a completion containing HANG; 1.0 otherwise."""
    if "HANG" in completion:
        time.sleep(1e6)
    return 1.0


def boom(completion, example):
    """Raises for a completion containing BOOM; 0.5 otherwise."""
    if "BOOM" in completion:
        raise RuntimeError("boom on purpose")
    return 0.5


def die(completion, example):
    """Kills its own process for a completion containing DIE (as a segfaulting verifier would); 1.0 otherwise."""
    if "DIE" in completion:
        os._exit(3)
    return 1.0


def nan_reward(completion, example):
    """Returns NaN: a bug the runner must refuse rather than average over."""
    return float("nan")


def none_reward(completion, example):
    """Returns None: a bug the runner must refuse."""
    return None


def is_true(completion, example):
    """Returns a bool, which the runner reads as 0/1."""
    return completion == "yes"


NOT_A_FUNCTION = 3


def huge_int(completion, example):
    """An int no float can hold."""
    return 10**400


def always_fails(completion, example):
    """Raises on every call: a broken verifier."""
    raise KeyError("no 'answer' here")
