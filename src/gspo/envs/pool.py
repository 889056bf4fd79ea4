"""Environment and tool calls in worker processes (:mod:`gspo.workers`), each under a hard time limit, for objects that
live as long as their trajectory.

Trajectory ``t`` lives in worker ``t % W`` for its whole life, so its environment object is always there. A call
that overruns ``timeout_s``, or a worker that dies, fails that call and every trajectory the worker held (their
environments went with it): those trajectories end, their reward is NaN (left out of their group's baseline and
counted), and a fresh worker takes the next ones. Nothing a user's environment does can stop the run, except failing
to load at all (one line).

- :class:`EnvPool`: ``call`` (a batch of calls, each to its trajectory's worker), ``forget``; a worker is sent its
  first calls only once it has loaded (``_send``), and ``_fail`` replaces one that died or overran;
- ``LOST``: what a call of a trajectory whose environment was lost is failed with.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from gspo import user_code
from gspo.envs.worker import ENV_EXAMPLE, TOOL_EXAMPLE, Host, load
from gspo.errors import UserError
from gspo.workers.pool import STARTUP_TIMEOUT_S, Record, WorkerHandle, Workers, died, timed_out

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
        self._pool = Workers(load, (env_path, self.tools), "gspo-env-worker", "gspo.envs.worker")
        for _ in range(workers):
            self._pool.start()

    def call(self, calls: list[Call]) -> list[tuple[str, Any]]:
        """Every call's ``(status, value)``, in order: ``("ok", value)`` or ``("err", message)``."""
        results: list[tuple[str, Any] | None] = [None] * len(calls)

        def record(i: int, status: str, value: Any) -> None:
            results[i] = (status, value)

        todo = []
        for i, (traj, op, payload) in enumerate(calls):
            if traj in self.lost:
                results[i] = ("err", LOST)
            elif self.host is not None:
                results[i] = self.host.call(op, traj, payload)
            else:
                todo.append(i)
                if op == "reset":
                    self.held.setdefault(traj % len(self._pool.handles), set()).add(traj)
        if todo:
            self._run(calls, todo, record)
        return [r if r is not None else ("ok", None) for r in results]

    def _run(self, calls: list[Call], todo: list[int], record: Record) -> None:
        workers = self._pool.handles
        queues: dict[int, list[tuple]] = {}
        for i in todo:
            queues.setdefault(calls[i][0] % len(workers), []).append((i, *calls[i]))
        for k, chunk in queues.items():
            self._send(workers[k], chunk, record)
        while busy := [workers[k] for k in queues if workers[k].chunk]:
            _, dead = self._pool.wait(busy, min(w.started + self.timeout_s for w in busy), record)
            for w in dead:
                self._fail(w, record, died(w))
            for w in self._pool.overdue(self.timeout_s):
                self._fail(w, record, timed_out(self.timeout_s))

    def _send(self, w: WorkerHandle, chunk: list[tuple], record: Record) -> None:
        """Send ``chunk`` once ``w`` has loaded the user's code: a worker reads nothing before, so a chunk larger than
        the pipe's buffer would block here for ever behind an import that never ends. A worker that does not load
        (it would fail the same way again) ends the run in one line rather than being respawned for ever."""
        while not w.ready:
            limit = w.spawned + STARTUP_TIMEOUT_S
            if time.monotonic() >= limit:
                raise UserError(f"loading env.path = {self.env_path!r} and env.tools {self.tools} in the workers did "
                                f"not finish within {STARTUP_TIMEOUT_S:g} s to load (an import that blocks); make "
                                "them load quickly, or set env.workers = 0 to debug in-process.")
            if self._pool.wait([w], limit, record)[1]:  # (only "ready" or "init_error" can come before a call)
                raise UserError(f"an environment worker exited while loading env.path = {self.env_path!r} and "
                                f"env.tools {self.tools} (exit code {w.proc.exitcode}; its output is above); set "
                                "env.workers = 0 to debug them in-process.")
        try:
            w.send(chunk, deque(c for c in chunk if c[2] != "drop"))  # drops are not answered
        except OSError:  # it died after loading: its first call fails, the rest go to a fresh worker
            self._fail(w, record, "its worker process had died")

    def _fail(self, w: WorkerHandle, record: Record, reason: str) -> None:
        """Worker ``w`` is killed and replaced: the call it was running fails with ``reason``, every trajectory it held
        is lost (its next ``step`` fails), and its other calls (tools, resets) go to the new worker."""
        k = self._pool.handles.index(w)
        owed = list(w.chunk or ())
        if owed:
            record(owed.pop(0)[0], "err", reason)
        w.chunk = None
        self.lost |= self.held.pop(k, set())
        new = self._pool.replace(w)
        retry = []
        for c in owed:
            i, traj, op, _ = c
            if op == "step" and traj in self.lost:
                record(i, "err", LOST)
                continue
            retry.append(c)
            if op == "reset":
                self.lost.discard(traj)
                self.held.setdefault(k, set()).add(traj)
        if retry:
            self._send(new, retry, record)

    def forget(self, trajectories: list[int]) -> None:
        """Drop these trajectories' environments (their episodes are over)."""
        self.call([(t, "drop", None) for t in trajectories])
        self.lost.difference_update(trajectories)
        for held in self.held.values():
            held.difference_update(trajectories)

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
