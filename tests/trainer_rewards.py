"""Reward functions for the end-to-end tests: a random tiny model never answers right, so these give variance."""


def text_length(completion, example):
    """Longer completions score higher: a dense, deterministic signal for a random model."""
    return len(completion) / 100.0


def flaky(completion, example):
    """Raises for every third completion length, like a verifier that chokes on some outputs."""
    if len(completion) % 3 == 0:
        raise ValueError("cannot parse this completion")
    return len(completion) / 100.0


def even_a_constant(completion, example):
    """1.0 for every completion of a prompt whose first operand is even (a zero-variance group), else length."""
    return 1.0 if example.meta["a"] % 2 == 0 else len(completion) / 100.0
