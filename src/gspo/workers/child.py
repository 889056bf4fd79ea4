"""The worker process's side. Standard library only (and gspo's torch-free modules), so the fork server that starts
workers is ready in a fraction of a second instead of the seconds an import of torch takes.

- :func:`main`: what a worker runs: :func:`start`, then the client's ``load(*args)`` (a UserError there is sent as the
  worker's one line, ``("init_error", message)``), ``("ready", pid)``, then one answer per call of each chunk;
- :func:`start`: signals, process group, folder and import path, and the thread that ends the worker with its parent;
- :func:`chunks`: the chunks of calls the parent sends, until it says stop.

Protocol: a chunk is a list of calls, each a tuple whose first item is its call id; an answer is ``(call id, status,
value)``, in the order of the chunk. A call that hangs is the parent's to time out (it kills this process).
"""
from __future__ import annotations

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


def watch_parent() -> None:
    """Exit this worker once its parent is gone, even while a call hangs in the main thread.

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


def start(sys_path: list[str], cwd: str) -> None:
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


def main(conn: Connection, sys_path: list[str], cwd: str, load: Callable[..., Callable[[tuple], Any]],
         args: tuple) -> None:
    """Worker process: ``load(*args)`` the client's user code, which gives the function that answers one call (with
    ``(call id, status, value)``, or ``None`` for a call that wants no answer), then answer every call sent."""
    start(sys_path, cwd)
    try:
        answer = load(*args)
    except UserError as e:  # already one sentence naming the user's code and the fix
        conn.send(("init_error", str(e)))
        return
    conn.send(("ready", os.getpid()))
    for chunk in chunks(conn):
        for call in chunk:
            reply = answer(call)
            if reply is not None:
                conn.send(reply)
