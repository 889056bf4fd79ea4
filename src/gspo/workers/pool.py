"""The parent's side of the worker processes that run user code, each call under a hard time limit.

Why processes: user code can hang (sympy on a pathological expression, a tool waiting on a socket) and no thread can
be stopped from outside, while math-verify's own ``signal.alarm`` limit works only in a main thread. So every call
runs in the main thread of a long-lived worker process, and a worker that overruns its limit on one call is SIGKILLed
(with the processes it started) and replaced. Workers come from a ``forkserver`` (never a plain ``fork``: the parent
holds torch's thread pools, which a fork copies in a broken state) that imports the workers' code (no torch) once, so
a worker starts in milliseconds, and ignores a SIGTERM sent to the whole process group (:mod:`gspo.workers.forkserver`).

- :class:`WorkerHandle`: one worker: its process, its pipe, the calls it owes and since when the first one runs;
- :class:`Workers`: a client's workers: start, replace, wait for answers until a deadline, the overdue ones, close;
- :func:`died`, :func:`timed_out`: what a call that lost its worker is failed with;
- :func:`kill_group`, :func:`shutdown`, :func:`context`: process-group kill, stopping them all, the fork server.

Which worker gets which calls, and what becomes of a failed worker's other calls, is the client's
(:mod:`gspo.rewards.runner`, :mod:`gspo.envs.pool`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from gspo.errors import UserError
from gspo.workers import child

STARTUP_TIMEOUT_S = 120.0  # a worker imports the user's modules (sympy, a user's own) before its first call
_PRELOAD = ["gspo.workers.forkserver"]  # what the fork server imports when it starts: this, then the clients' code

Record = Callable[[Any, str, Any], None]  # (call id, status, value) of one answer


class WorkerHandle:
    """The parent's handle on one worker: its process, pipe, and the calls it still owes."""

    def __init__(self, proc: Any, conn: Connection):
        self.proc = proc
        self.conn = conn
        self.ready = False
        self.chunk: deque[tuple] | None = None  # sent but unanswered calls (call id first); the first one is running
        self.started = 0.0  # monotonic time the running call started (as seen by the parent)
        self.spawned = time.monotonic()  # its start-up limit counts from here, not from the call that waits for it

    def send(self, calls: list[tuple], owed: deque[tuple]) -> None:
        """Send a chunk of ``calls``, of which the worker will answer ``owed``, in order: the first one runs from now."""
        self.chunk = owed
        self.conn.send(calls)
        self.started = time.monotonic()

    def kill(self) -> None:
        """SIGKILL the process and the processes the user's code started (its process group): the only way to stop a
        call stuck in C code, or waiting for a child."""
        kill_group(self.proc)
        self.proc.join(timeout=5.0)
        self.conn.close()


def kill_group(proc: Any) -> None:
    """SIGKILL a worker's process group (:func:`gspo.workers.child.start` makes the worker lead one), or the worker
    alone when it has not made its group yet."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
            return
    except (ProcessLookupError, TypeError):  # gone already, or never started
        pass
    proc.kill()


def shutdown(workers: list[WorkerHandle], owner_pid: int) -> None:
    """Stop every worker: ask politely, then kill whatever is still alive."""
    if os.getpid() != owner_pid:  # a forked copy of the parent must not stop the real parent's workers
        return
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 1.0
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        try:  # what the user's code started and left running (the worker that led its group is gone)
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        w.conn.close()
    workers.clear()


def context(preload: str) -> Any:
    """The forkserver context, its server to import ``preload`` (the client's worker module, by name) once, so that a
    new worker starts in milliseconds, not the ~1.5 s of a fresh interpreter. The server is one per process, started by
    the first worker of any client: it imports every module named before then (a worker of a module named later
    imports it itself, a few milliseconds slower)."""
    if preload not in _PRELOAD:
        _PRELOAD.append(preload)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def died(w: WorkerHandle) -> str:
    return f"the worker process died (exit code {w.proc.exitcode})"


def timed_out(timeout_s: float) -> str:
    return f"timed out after {timeout_s:g} s; the worker was killed"


class Workers:
    """A client's worker processes, each running :func:`gspo.workers.child.main` with the client's ``load`` and
    ``args`` (``load`` is a module-level function of ``preload``, the module the fork server imports)."""

    def __init__(self, load: Callable, args: tuple, name: str, preload: str):
        self.load, self.args, self.name = load, args, name
        self.handles: list[WorkerHandle] = []
        self._ctx = context(preload)
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, shutdown, self.handles, os.getpid())

    def _spawn(self) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        args = (child_conn, list(sys.path), os.getcwd(), self.load, self.args)
        proc = self._ctx.Process(target=child.main, args=args, daemon=True, name=self.name)
        proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        return WorkerHandle(proc, parent_conn)

    def start(self) -> None:
        """One more worker (it says it is ready once it has loaded the user's code)."""
        self.handles.append(self._spawn())

    def replace(self, w: WorkerHandle) -> WorkerHandle:
        """Kill ``w`` and start a fresh worker in its place."""
        w.kill()
        new = self.handles[self.handles.index(w)] = self._spawn()
        return new

    def wait(self, watched: list[WorkerHandle], deadline: float, record: Record) -> tuple[int, list[WorkerHandle]]:
        """Wait until one of ``watched`` sends something or the monotonic time ``deadline``, then take every answer
        that came to ``record``: how many calls were answered, and the workers that died (joined: their exit code is
        known). A worker whose user code could not load closes every worker and raises its one line."""
        answered, dead = 0, []
        by_conn = {w.conn: w for w in watched}
        for conn in wait(list(by_conn), timeout=max(0.0, deadline - time.monotonic())):
            w = by_conn[conn]
            n, alive = self._read(w, record)
            answered += n
            if not alive:
                w.proc.join(timeout=1.0)
                dead.append(w)
        return answered, dead

    def overdue(self, timeout_s: float) -> list[WorkerHandle]:
        """The workers whose running call has run past ``timeout_s``."""
        now = time.monotonic()
        return [w for w in self.handles if w.chunk and now - w.started > timeout_s]

    def _read(self, w: WorkerHandle, record: Record) -> tuple[int, bool]:
        """Handle every message ``w`` has sent: how many calls it answered, and whether it is still alive."""
        answered = 0
        while True:
            try:
                if not w.conn.poll():
                    return answered, True
                msg = w.conn.recv()
            except (EOFError, OSError):
                return answered, False
            if msg[0] == "ready":
                w.ready = True
            elif msg[0] == "init_error":
                self.close()
                raise UserError(msg[1])  # the worker's own one-line message, naming the user's code
            else:
                call = w.chunk.popleft()
                assert call[0] == msg[0], f"{self.name} answered out of order"
                record(*msg)
                answered += 1
                w.started = time.monotonic()  # the worker moved on to the next call of its chunk
                if not w.chunk:
                    w.chunk = None

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the worker processes."""
        self._finalizer()
