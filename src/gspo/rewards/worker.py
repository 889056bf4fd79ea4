"""The reward worker process's side: resolve the reward functions, then answer calls. Standard library only (and
gspo's torch-free modules), so the fork server that starts workers is ready in a fraction of a second instead of the
seconds an import of torch takes; a reward module that needs torch imports it itself."""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
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


def watch_parent() -> None:
    """Exit this worker once its parent is gone, even while a reward call hangs in the main thread.

    The parent is the fork server, which itself exits with the training process; either way we get re-parented.
    """
    parent_pid = os.getppid()
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    try:  # the processes the user's code started go too (when this worker leads their process group: never another's)
        if os.getpgrp() == os.getpid():
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _warm_up(path: str, fn: RewardFn) -> None:
    try:
        fn.warm_up()
    except Exception as e:  # the user's set-up code can fail in any way
        raise UserError(f"reward {path!r}: its warm_up raised {type(e).__name__}: {e}; fix it, or set rewards.workers "
                        "= 0 to debug it in-process.") from e


def start_worker(sys_path: list[str], cwd: str) -> None:
    """What a worker process of the user's code (rewards, environments, tools) does first."""
    # Ctrl-C and a SIGTERM sent to the whole process group (Slurm, systemd) are the parent's to handle: it finishes its
    # batch, which needs these workers, then shuts them down; a worker also exits when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A process group of its own, which the processes the user's code starts (a code-running tool's interpreter)
    # join: killing the worker (a call past its time limit, shutdown) kills them with it, never leaving them running.
    try:
        os.setpgrp()
    except OSError:  # (a session leader cannot: it keeps the group it has, and only itself is killed)
        pass
    os.chdir(cwd)  # user code may open files relative to where the user started training
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    user_code.search_current_folder()
    threading.Thread(target=watch_parent, daemon=True).start()


def chunks(conn: Connection):
    """The chunks of calls the parent sends, until it says stop (``None``) or is gone."""
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        yield chunk


def worker_main(conn: Connection, paths: list[str], sys_path: list[str], cwd: str,
                steps_path: str | None = None) -> None:
    """Worker process: resolve the reward functions (and ``loss.step_credit``'s function, called with the index after
    them), then answer chunks of calls one result per call."""
    start_worker(sys_path, cwd)
    try:
        fns = [resolve(p) for p in paths] + ([resolve(steps_path, steps=True)] if steps_path else [])
        for path, fn in zip(paths, fns):
            if callable(getattr(fn, "warm_up", None)):
                _warm_up(path, fn)  # one-off set-up cost stays out of the first call's time limit
    except UserError as e:  # already one sentence naming the reward and the fix
        conn.send(("init_error", str(e)))
        return
    conn.send(("ready", os.getpid()))
    for chunk in chunks(conn):
        for call_id, fn_idx, completion, example in chunk:
            one = call_steps if fn_idx == len(paths) else call
            conn.send((call_id, *one(fns[fn_idx], completion, example)))
