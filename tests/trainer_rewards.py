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


_SENT = []


def sigterm_once(completion, example):
    """Sends SIGTERM to its own process on its first call (in-process rewards: the trainer's main thread)."""
    import os
    import signal

    if not _SENT:
        _SENT.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return len(completion) / 100.0


_CALLS = []


def declining(completion, example):
    """1.0 for the first 8 calls (one rollout batch of the tiny config), 0.0 after: a reward collapse on cue."""
    _CALLS.append(1)
    return 1.0 if len(_CALLS) <= 8 else 0.0


def declining_later(completion, example):
    """1.0 for the first 16 calls (two rollout batches of the tiny config), 0.0 after."""
    _CALLS.append(1)
    return 1.0 if len(_CALLS) <= 16 else 0.0


def declining_after_four(completion, example):
    """1.0 for the first 32 calls (four rollout batches of the tiny config), 0.0 after."""
    _CALLS.append(1)
    return 1.0 if len(_CALLS) <= 32 else 0.0


_RISE_FALL = [1.0, 1.0, 0.7, 0.6, 0.4]  # then 0.0


def peaks_then_declines(completion, example):
    """Per rollout batch of the tiny config (8 calls): 1.0, 1.0, then a gradual decline 0.7, 0.6, 0.4, then 0.0
    (every completion of a batch alike)."""
    _CALLS.append(1)
    batch = (len(_CALLS) - 1) // 8
    return _RISE_FALL[batch] if batch < len(_RISE_FALL) else 0.0


def dyadic_length(completion, example):
    """Length in units of 1/128: exact in binary floating point, so group statistics have no rounding to disagree on."""
    return len(completion) / 128.0


def even_a_dyadic(completion, example):
    """1.0 for every completion of a prompt whose first operand is even (a zero-variance group), else dyadic length."""
    return 1.0 if example.meta["a"] % 2 == 0 else len(completion) / 128.0


def slow_length(completion, example):
    """Length in 1/128 units after 0.3 s; the first call creates the file named by GSPO_TEST_MARKER (scoring began)."""
    import os
    import time

    marker = os.environ.get("GSPO_TEST_MARKER")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
    time.sleep(0.3)
    return len(completion) / 128.0


_BATCH_CALLS = []


def collapses_in_third_batch(completion, example):
    """Dyadic length, except 0.0 for calls 17..24 (the third rollout batch of a process of the tiny config) when
    GSPO_TEST_COLLAPSE is set: a reward collapse on cue, once per process, in the process that asks for it."""
    import os

    _BATCH_CALLS.append(1)
    if os.environ.get("GSPO_TEST_COLLAPSE") and 16 < len(_BATCH_CALLS) <= 24:
        return 0.0
    return len(completion) / 128.0


def every_third_char(completion, example):
    """Step credit for a random model: a step ends every 3 characters; it is right when its last character is a
    letter (a signal that varies within and across completions)."""
    return [(end, float(completion[end - 1].isalpha())) for end in range(3, len(completion) + 1, 3)]


def bad_steps(completion, example):
    """Step credit that breaks its contract: ends that go backwards."""
    return [(2, 1.0), (1, 0.0)]


def hang_steps(completion, example):
    """Step credit that never returns (a regex with catastrophic backtracking, a lock): for the time-limit test."""
    import time

    while True:
        time.sleep(1.0)
