"""Reward functions for the end-to-end tests: a random tiny model never answers right, so these give variance."""


def text_length(completion, example):
    """Longer completions score higher: a dense, deterministic signal for a random model."""
    return len(completion) / 100.0
