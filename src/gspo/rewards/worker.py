"""The reward worker process's side: resolve the reward functions, then answer calls. Standard library only (and
gspo's torch-free modules), so the fork server that starts workers is ready in a fraction of a second instead of the
seconds an import of torch takes; a reward module that needs torch imports it itself."""
from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from gspo.errors import UserError
from gspo.example import Example

RewardFn = Callable[[str, Example], float]


def resolve(path: str) -> RewardFn:
    """The callable named by ``"module:function"`` (``function`` may be dotted, e.g. ``"mod:Class.method"``)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"reward {path!r} is not 'module:function'; write it like 'gspo.rewards.builtin:last_number'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # a user's module can fail to import in any way (syntax error, missing dependency)
        raise UserError(
            f"reward {path!r}: importing {module_name!r} failed ({type(e).__name__}: {e}); fix the module name, "
            "or put its folder on PYTHONPATH (or run from that folder)."
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"reward {path!r}: {module_name!r} has no attribute {attr!r}; check the function name.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"reward {path!r} is a {type(obj).__name__}, not a function; point it at a function.")
    return obj


def locate(path: str) -> str:
    """Check ``"module:function"`` as far as it can be without running any of the module's code (which may block, or
    fail): the form, and that the module's top-level package exists on the path. Returns ``path``; the import itself
    happens in the worker processes, under their start-up limit."""
    import importlib.util

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"reward {path!r} is not 'module:function'; write it like 'gspo.rewards.builtin:last_number'.")
    top = module_name.split(".")[0]
    try:
        found = top in sys.modules or importlib.util.find_spec(top) is not None  # a top-level name imports nothing
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"reward {path!r}: no module named {top!r}; fix the module name, or put its folder on "
                        "PYTHONPATH (or run from that folder).")
    return path


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


def _watch_parent() -> None:
    """Exit this worker once its parent is gone, even while a reward call hangs in the main thread.

    The parent is the fork server, which itself exits with the training process; either way we get re-parented.
    """
    parent_pid = os.getppid()
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def worker_main(conn: Connection, paths: list[str], sys_path: list[str], cwd: str) -> None:
    """Worker process: resolve the reward functions, then answer chunks of calls one result per call."""
    # Ctrl-C and a SIGTERM sent to the whole process group (Slurm, systemd) are the parent's to handle: it finishes its
    # batch, which needs these workers, then shuts them down; a worker also exits when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.chdir(cwd)  # reward functions may open files relative to where the user started training
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    if cwd not in sys.path:
        sys.path.append(cwd)
    threading.Thread(target=_watch_parent, daemon=True).start()
    try:
        fns = [resolve(p) for p in paths]
        for fn in fns:
            if callable(getattr(fn, "warm_up", None)):
                fn.warm_up()  # one-off set-up cost stays out of the first call's time limit
    except Exception as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for call_id, fn_idx, completion, example in chunk:
            conn.send((call_id, *call(fns[fn_idx], completion, example)))
