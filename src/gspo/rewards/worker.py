"""The reward worker process's side: resolve the reward functions (:func:`load`, run by
:func:`gspo.workers.child.main`), then answer calls (:func:`call`, :func:`call_steps`); the parent resolves them here
too with ``workers=0``. Standard library only (and gspo's torch-free modules), so the fork server that starts workers
is ready in a fraction of a second instead of the seconds an import of torch takes; a reward module that needs torch
imports it itself."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gspo import user_code
from gspo.errors import UserError
from gspo.example import Example

RewardFn = Callable[[str, Example], float]
EXAMPLE = "gspo.rewards.builtin:last_number"
STEPS_EXAMPLE = "gspo.rewards.builtin:running_sum_step_spans"


def what(path: str, steps: bool = False) -> str:
    """How an error names the user's function: a reward, or the ``loss.step_credit`` function."""
    return f"loss.step_credit = {path!r}" if steps else f"reward {path!r}"


def resolve(path: str, steps: bool = False) -> RewardFn:
    """The callable named by ``"module:function"`` (``function`` may be dotted, e.g. ``"mod:Class.method"``); the
    current folder is searched too (:mod:`gspo.user_code`). ``steps``: a step-credit function (for the messages)."""
    return user_code.load_function(path, what(path, steps), STEPS_EXAMPLE if steps else EXAMPLE)


def locate(path: str, steps: bool = False) -> str:
    """:func:`gspo.user_code.locate` of a reward (or, with ``steps``, the step-credit function)."""
    return user_code.locate(path, what(path, steps), STEPS_EXAMPLE if steps else EXAMPLE)


def call(fn: RewardFn, completion: str, example: Example) -> tuple[str, Any]:
    """One reward call as ``("ok", float)``, ``("err", message)`` if it raised, or ``("bad", message)`` for a value
    that is not a finite number (bools and numpy/torch scalars are fine)."""
    try:
        value = fn(completion, example)
    except Exception as e:
        return "err", f"{type(e).__name__}: {e}"[:300]
    if value is None or isinstance(value, (str, bytes)):
        return "bad", f"returned {value!r:.80}"
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "bad", f"returned a {type(value).__name__}"
    except OverflowError:  # an int too large for a float (10**400)
        return "bad", "returned a number too large for a float"
    return ("ok", x) if math.isfinite(x) else ("bad", f"returned {x}")


def call_steps(fn: RewardFn, completion: str, example: Example) -> tuple[str, Any]:
    """One step-credit call as ``("ok", (ends, credits))``: for each step, in order, the character index just past it
    and its credit; ``("err", message)`` if it raised, ``("bad", message)`` for steps that break that contract."""
    try:
        steps = fn(completion, example)
    except Exception as e:
        return "err", f"{type(e).__name__}: {e}"[:300]
    ends, credits = [], []
    try:
        for end, credit in steps:
            ends.append(int(end))
            credits.append(float(credit))
    except (TypeError, ValueError, OverflowError):
        return "bad", f"returned {steps!r:.80}; it must return a list of (end character index, credit) pairs"
    if any(not math.isfinite(c) for c in credits) or ends != sorted(ends) or any(not 0 <= e <= len(completion)
                                                                                 for e in ends):
        return "bad", (f"returned {steps!r:.80}: the ends must ascend within the completion (0..{len(completion)}) "
                       "and the credits be finite numbers")
    return "ok", (ends, credits)


def _warm_up(path: str, fn: RewardFn) -> None:
    try:
        fn.warm_up()
    except Exception as e:  # the user's set-up code can fail in any way
        raise UserError(f"reward {path!r}: its warm_up raised {type(e).__name__}: {e}; fix it, or set rewards.workers "
                        "= 0 to debug it in-process.") from e


def load(paths: list[str], steps_path: str | None = None) -> Callable[[tuple], tuple]:
    """In a worker (:func:`gspo.workers.child.main`): resolve the reward functions (and ``loss.step_credit``'s
    function, called with the index after them), warm them up, and give the function that answers one call."""
    fns = [resolve(p) for p in paths] + ([resolve(steps_path, steps=True)] if steps_path else [])
    for path, fn in zip(paths, fns):
        if callable(getattr(fn, "warm_up", None)):
            _warm_up(path, fn)  # one-off set-up cost stays out of the first call's time limit

    def answer(c: tuple) -> tuple:
        call_id, fn_idx, completion, example = c
        one = call_steps if fn_idx == len(paths) else call
        return (call_id, *one(fns[fn_idx], completion, example))

    return answer
