"""Environment and tool calls in worker processes, each under a hard time limit (the reward workers' design, see
:mod:`gspo.rewards.runner`, for objects that live as long as their trajectory).

Trajectory ``t`` lives in worker ``t % W`` for its whole life, so its environment object is always there. A call
that overruns ``timeout_s``, or a worker that dies, fails that call and every trajectory the worker held (their
environments went with it): those trajectories end, their reward is NaN (left out of their group's baseline and
counted), and a fresh worker takes the next ones. Nothing a user's environment does can stop the run, except failing
to load at all (one line).
"""
from __future__ import annotations

import os
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from gspo import user_code
from gspo.envs.worker import ENV_EXAMPLE, TOOL_EXAMPLE, Host, worker_main
from gspo.errors import UserError
from gspo.rewards.runner import STARTUP_TIMEOUT_S, WorkerHandle, shutdown_workers, worker_context

Call = tuple[int, str, Any]  # (trajectory, op, payload)
LOST = "its environment was lost: the worker that held it was restarted after another call failed"


class EnvPool:
    """``workers`` processes holding the environments and tools (``workers=0``: this process, no time limit)."""

    def __init__(self, env_path: str | None, tools: list[str], workers: int = 2, timeout_s: float = 10.0):
        if env_path:
            user_code.locate(env_path, f"env.path = {env_path!r}", ENV_EXAMPLE)
        for path in tools:
            user_code.locate(path, f"env.tools entry {path!r}", TOOL_EXAMPLE)
        self.env_path, self.tools, self.timeout_s = env_path, list(tools), float(timeout_s)
        self.host = Host(env_path, self.tools) if workers == 0 else None
        self.lost: set[int] = set()  # trajectories whose environment died with its worker
        self.held: dict[int, set[int]] = {}  # worker index -> the trajectories whose environment it holds
        self._ctx = worker_context()
        self._workers: list[WorkerHandle] = []
        self._finalizer = weakref.finalize(self, shutdown_workers, self._workers, os.getpid())
        for _ in range(workers):
            self._workers.append(self._start())

    def _start(self) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, daemon=True, name="gspo-env-worker",
                                 args=(child_conn, self.env_path, self.tools, list(sys.path), os.getcwd()))
        proc.start()
        child_conn.close()
        return WorkerHandle(proc, parent_conn)

    def call(self, calls: list[Call]) -> list[tuple[str, Any]]:
        """Every call's ``(status, value)``, in order: ``("ok", value)`` or ``("err", message)``."""
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        todo = []
        for i, (traj, op, payload) in enumerate(calls):
            if traj in self.lost:
                results[i] = ("err", LOST)
            elif self.host is not None:
                results[i] = self.host.call(op, traj, payload)
            else:
                todo.append(i)
                if op == "reset":
                    self.held.setdefault(traj % len(self._workers), set()).add(traj)
        if todo:
            self._run(calls, todo, results)
        return [r if r is not None else ("ok", None) for r in results]

    def _run(self, calls: list[Call], todo: list[int], results: list) -> None:
        queues: dict[int, deque[int]] = {}
        for i in todo:
            queues.setdefault(calls[i][0] % len(self._workers), deque()).append(i)
        for w_idx, queue in queues.items():
            w = self._workers[w_idx]
            w.chunk = deque(i for i in queue if calls[i][1] != "drop")  # drops are not answered
            try:
                self._send(w, [(i, *calls[i]) for i in queue])
            except OSError:
                self._fail(w_idx, calls, results, "its worker process had died")
        while any(self._workers[k].chunk for k in queues):
            busy = [k for k in queues if self._workers[k].chunk]
            deadline = min(self._deadline(self._workers[k]) for k in busy)
            ready = wait([self._workers[k].conn for k in busy], timeout=max(0.0, deadline - time.monotonic()))
            for k in busy:
                w = self._workers[k]
                if w.conn in ready and not self._read(w, results):
                    w.proc.join(timeout=1.0)
                    self._fail(k, calls, results, f"the worker process died (exit code {w.proc.exitcode})")
                elif w.chunk and time.monotonic() > self._deadline(w):
                    self._fail(k, calls, results, f"timed out after {self.timeout_s:g} s; the worker was killed")

    def _send(self, w: WorkerHandle, chunk: list) -> None:
        """Send ``chunk`` once ``w`` has loaded the user's code: a worker reads nothing before, so a chunk larger than
        the pipe's buffer would block here for ever behind an import that never ends. A worker that does not load
        (it would fail the same way again) ends the run in one line rather than being respawned for ever."""
        while not w.ready:
            left = w.spawned + STARTUP_TIMEOUT_S - time.monotonic()
            if left <= 0:
                raise UserError(f"loading env.path = {self.env_path!r} and env.tools {self.tools} in the workers did "
                                f"not finish within {STARTUP_TIMEOUT_S:g} s to load (an import that blocks); make "
                                "them load quickly, or set env.workers = 0 to debug in-process.")
            try:
                answered = w.conn.poll(left)
            except (EOFError, OSError):
                answered = True
            if answered and not self._read(w, []):  # (only "ready" or "init_error" can come before a call)
                w.proc.join(timeout=1.0)
                raise UserError(f"an environment worker exited while loading env.path = {self.env_path!r} and "
                                f"env.tools {self.tools} (exit code {w.proc.exitcode}; its output is above); set "
                                "env.workers = 0 to debug them in-process.")
        w.conn.send(chunk)
        w.started = time.monotonic()

    def _deadline(self, w: WorkerHandle) -> float:
        """When the call ``w`` is running times out (every worker with calls has loaded: :meth:`_send`)."""
        return w.started + self.timeout_s

    def _read(self, w: WorkerHandle, results: list) -> bool:
        """Take every answer ``w`` has sent; False when it is gone."""
        while True:
            try:
                if not w.conn.poll():
                    return True
                msg = w.conn.recv()
            except (EOFError, OSError):
                return False
            if msg[0] == "ready":
                w.ready = True
                w.started = time.monotonic()  # the first call's limit starts once the environment has loaded
            elif msg[0] == "init_error":
                self.close()
                raise UserError(msg[1])
            else:
                i = w.chunk.popleft()
                assert i == msg[0], "environment worker answered out of order"
                results[i] = (msg[1], msg[2])
                w.started = time.monotonic()

    def _fail(self, k: int, calls: list[Call], results: list, reason: str) -> None:
        """Worker ``k`` is killed and replaced: the call it was running fails with ``reason``, every trajectory it held
        is lost (its next ``step`` fails), and its other calls (tools, resets) go to the new worker."""
        w = self._workers[k]
        pending = list(w.chunk or ())
        if pending:
            results[pending.pop(0)] = ("err", reason)
        w.chunk = None
        self.lost |= self.held.pop(k, set())
        w.kill()
        new = self._workers[k] = self._start()
        retry = []
        for i in pending:
            traj, op, _ = calls[i]
            if op == "step" and traj in self.lost:
                results[i] = ("err", LOST)
                continue
            retry.append(i)
            if op == "reset":
                self.lost.discard(traj)
                self.held.setdefault(k, set()).add(traj)
        if retry:
            new.chunk = deque(retry)
            try:
                self._send(new, [(i, *calls[i]) for i in retry])
            except OSError:  # the new worker died at once: its calls fail as the first one did
                self._fail(k, calls, results, "its worker process had died")

    def forget(self, trajectories: list[int]) -> None:
        """Drop these trajectories' environments (their episodes are over)."""
        self.call([(t, "drop", None) for t in trajectories])
        self.lost.difference_update(trajectories)
        for held in self.held.values():
            held.difference_update(trajectories)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
