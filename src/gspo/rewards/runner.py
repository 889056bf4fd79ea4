"""Score completions with user reward functions in worker processes, each call under a hard time limit.

Why processes: a verifier can hang (sympy on a pathological expression) and no thread can be stopped from outside,
while math-verify's own ``signal.alarm`` limit works only in a main thread. So every call runs in the main thread
of a long-lived worker process, and a worker that overruns ``timeout_s`` on one call is SIGKILLed and replaced.

Protocol: the parent sends a chunk of up to ``CHUNK`` calls in one message (cheap IPC); the worker answers each
call as soon as it finishes. The parent therefore always knows which call is running and since when: on a timeout
exactly that call is failed, and the unanswered rest of its chunk goes back to the queue. Workers come from a
``forkserver`` (never a plain ``fork``: the parent holds torch's thread pools, which a fork copies in a broken
state); the server imports :mod:`gspo.rewards.worker` (no torch) once, so a worker starts in milliseconds, and
ignores a SIGTERM sent to the whole process group (:mod:`gspo.rewards.forkserver`).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from gspo.data import default_reward
from gspo.errors import UserError
from gspo.example import Example
from gspo.rewards.worker import RewardFn, call as _call, call_steps, locate, resolve, what, worker_main  # noqa: F401

Call = tuple[int, int, str, Example]  # (call id, function index, completion, example)

CHUNK = 16  # calls per message: large enough to amortise IPC, small enough to balance load across workers
MAX_ERRORS = 8  # error messages kept per score() for logging
STARTUP_TIMEOUT_S = 120.0  # a worker imports the reward modules (sympy, a user's own) before its first call


@dataclass
class RewardSpec:
    """One term of the weighted reward sum: ``path`` is ``"module:function"``; ``name`` defaults to the function's."""

    path: str
    weight: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is None:
            self.name = self.path.rpartition(":")[2].rpartition(".")[2] or self.path
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise UserError(f"reward {self.name!r} has weight {self.weight!r}; give a finite number such as 1.0.")


@dataclass
class RewardResult:
    """Scores of ``N`` completions. A failed call (raised, timed out, worker died) is NaN, never a silent 0."""

    total: torch.Tensor  # (N,) float32, sum_f weight_f * reward_f; NaN where any function failed
    per_function: dict[str, torch.Tensor]  # name -> (N,) float32, NaN on failure
    failures: dict[str, int]  # name -> number of failed calls
    errors: list[str]  # the first MAX_ERRORS failure messages, for logging


class WorkerHandle:
    """The parent's handle on one worker: its process, pipe, and the calls it still owes."""

    def __init__(self, proc: Any, conn: Connection):
        self.proc = proc
        self.conn = conn
        self.ready = False
        self.chunk: deque[Call] | None = None  # sent but unanswered calls; the first one is running
        self.started = 0.0  # monotonic time the running call started (as seen by the parent)
        self.spawned = time.monotonic()  # its start-up limit counts from here, not from the score() call

    def kill(self) -> None:
        """SIGKILL the process and the processes the user's code started (its process group): the only way to stop a
        call stuck in C code, or waiting for a child."""
        kill_group(self.proc)
        self.proc.join(timeout=5.0)
        self.conn.close()


def kill_group(proc: Any) -> None:
    """SIGKILL a worker's process group (:func:`gspo.rewards.worker.start_worker` makes the worker lead one), or the
    worker alone when it has not made its group yet."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
            return
    except (ProcessLookupError, TypeError):  # gone already, or never started
        pass
    proc.kill()


def shutdown_workers(workers: list[WorkerHandle], owner_pid: int) -> None:
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


def worker_context() -> Any:
    """A fork server that imports the worker module (no torch) once, so a new worker starts in milliseconds, not the
    ~1.5 s of a fresh interpreter (a fork server started earlier without this preload still works, just slower)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gspo.rewards.forkserver"])
    return ctx


def config_specs(cfg) -> list[RewardSpec]:
    """The reward functions a config scores with: ``rewards.functions``, else the task's verifier, except that an
    environment's own rewards need none (training and ``gspo eval`` both take them from here)."""
    return ([RewardSpec(r.path, r.weight, r.name) for r in cfg.rewards.functions]
            or ([] if cfg.env.path else [RewardSpec(default_reward(cfg.data.task))]))


def _as_spec(spec: RewardSpec | str | dict) -> RewardSpec:
    """A ``RewardSpec`` from a spec, a bare ``"module:function"`` path, or a dict of RewardSpec's fields."""
    if isinstance(spec, RewardSpec):
        return spec
    if isinstance(spec, str):
        return RewardSpec(spec)
    if isinstance(spec, dict) and set(spec) <= {"path", "weight", "name"} and "path" in spec:
        return RewardSpec(**spec)
    raise UserError(
        f"reward spec {spec!r} is not understood; give a 'module:function' path or a table with "
        "path (required), weight and name."
    )


class RewardRunner:
    """Weighted sum of reward functions over completions, each call in a worker process under a hard time limit.

    ``workers=0`` runs every call in this process: no time limit is enforced (a hung function hangs the caller),
    which is meant for tests and debugging. Not thread-safe: call ``score`` from one thread at a time.

    ``allow_empty``: no reward functions (an environment's rewards stand alone); ``score`` then gives zeros.
    ``steps``: the ``loss.step_credit`` function (``"module:function"``), loaded and called in the same workers under
    the same limits (:meth:`step_spans`), so that no user code runs in the trainer's process.
    """

    def __init__(self, specs: Sequence[RewardSpec | str | dict], workers: int = 2, timeout_s: float = 10.0,
                 steps: str | None = None, allow_empty: bool = False):
        specs = [_as_spec(s) for s in ([specs] if isinstance(specs, (str, RewardSpec, dict)) else specs)]
        if not specs and steps is None and not allow_empty:
            raise UserError(
                "no reward functions were given; name at least one, e.g. 'gspo.rewards.builtin:last_number'."
            )
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"reward names {dupes} are used twice; give each reward spec a distinct name.")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise UserError(f"reward workers={workers!r} is invalid; use an integer >= 0 (0 runs in-process).")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise UserError(f"reward timeout_s={timeout_s!r} is invalid; use a positive number of seconds.")
        self.specs = specs
        self.timeout_s = float(timeout_s)
        # With workers the reward modules are imported there only, under the start-up limit: a module that blocks at
        # import must not hang the trainer. The parent checks what it can without running module code.
        for spec in specs:
            locate(spec.path)
        self.steps = locate(steps, steps=True) if steps else None
        self.fns = [resolve(s.path) for s in specs] if workers == 0 else []  # in-process calls only
        if workers == 0 and steps:
            self.fns.append(resolve(steps, steps=True))
        self._ctx = worker_context()
        self._workers: list[WorkerHandle] = []
        self._closed = False
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, shutdown_workers, self._workers, os.getpid())
        # Starting the fork server and the workers takes a fraction of a second: do it from a thread, so that it
        # overlaps the caller's own start-up (loading the model); score() waits for them.
        self._start_error: BaseException | None = None
        self._starting: threading.Thread | None = None
        self.start_seconds = 0.0  # how long starting the workers took (in the background)
        if workers:
            self._starting = threading.Thread(target=self._start_all, args=(workers,), name="gspo-reward-start",
                                              daemon=True)
            self._starting.start()

    def _start_all(self, n: int) -> None:
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                self._workers.append(self._start())
        except BaseException as e:  # re-raised by the first score()
            self._start_error = e
        self.start_seconds = time.perf_counter() - t0

    def ready(self) -> "RewardRunner":
        """Wait until the worker processes have started (raising what failed, if anything)."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._start_error is not None:  # stays: without workers, scoring must not fall back to in-process calls
            error = self._start_error
            raise UserError(f"The reward worker processes could not start ({type(error).__name__}: {error}); check the "
                            "machine's process limits, or set rewards.workers = 0.") from error
        return self

    @property
    def workers(self) -> int:
        """Number of worker processes (0: in-process)."""
        self.ready()
        return len(self._workers)

    def _start(self) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        args = (child_conn, [s.path for s in self.specs], list(sys.path), os.getcwd(), self.steps)
        proc = self._ctx.Process(target=worker_main, args=args, daemon=True, name="gspo-reward-worker")
        proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        return WorkerHandle(proc, parent_conn)

    def _paths(self) -> str:
        return ", ".join([repr(s.path) for s in self.specs] + ([what(self.steps, steps=True)] if self.steps else []))

    def _replace(self, w: WorkerHandle) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._start()

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> RewardResult:
        """Every reward function on every ``(completion, example)`` pair, and their weighted sum.

        A call that raises, times out or loses its worker is NaN and counted in ``failures``; a function that
        returns a non-number, NaN or inf raises UserError, since that is a bug in the function, not bad luck.
        """
        if self._closed:
            raise RuntimeError("RewardRunner.score() was called after close(); create a new RewardRunner.")
        self.ready()
        if len(completions) != len(examples):
            raise ValueError(
                f"{len(completions)} completions but {len(examples)} examples; pass one example per completion."
            )
        n = len(completions)
        values = [[math.nan] * n for _ in self.specs]
        failures = {s.name: 0 for s in self.specs}
        errors: list[str] = []
        bad: list[str] = []

        def record(call_id: int, status: str, value: Any) -> None:
            fn_idx, i = divmod(call_id, n)
            spec = self.specs[fn_idx]
            if status == "ok":
                values[fn_idx][i] = value
            elif status == "bad":
                bad.append(f"reward function {spec.name!r} ({spec.path}) {value} for completion {i}")
            else:
                failures[spec.name] += 1
                if len(errors) < MAX_ERRORS:
                    errors.append(f"{spec.name} on completion {i}: {value}")

        self._dispatch([(f * n + i, f, completions[i], examples[i]) for f in range(len(self.specs)) for i in range(n)],
                       record, _call)
        if bad:
            raise UserError(f"{bad[0]}; a reward must return a finite number, so fix that function.")
        per_function = {s.name: torch.tensor(v, dtype=torch.float32) for s, v in zip(self.specs, values)}  # (N,) each
        total = torch.zeros(n, dtype=torch.float32)  # (N,)
        for s in self.specs:
            total += s.weight * per_function[s.name]
        return RewardResult(total=total, per_function=per_function, failures=failures, errors=errors)

    def step_spans(self, completions: Sequence[str],
                   examples: Sequence[Example]) -> list[tuple[list[int], list[float]]]:
        """``loss.step_credit`` on every ``(completion, example)``: each completion's step ends (character indices)
        and credits. A call that fails, times out or breaks the contract ends the run in one line: a step-credit
        function must score every completion of its task."""
        if self.steps is None:
            raise RuntimeError("RewardRunner.step_spans() needs the runner to be made with steps='module:function'.")
        self.ready()
        spans: list[Any] = [None] * len(completions)
        problems: list[str] = []

        def record(i: int, status: str, value: Any) -> None:
            if status == "ok":
                spans[i] = value
            elif not problems:
                problems.append(f"{value} on completion {i}" if status == "bad" else
                                f"failed on completion {i} ({value})")

        index = len(self.specs)
        self._dispatch([(i, index, completions[i], examples[i]) for i in range(len(completions))], record, call_steps)
        if problems:
            raise UserError(f"{what(self.steps, steps=True)} {problems[0]}; it must score every completion of the "
                            f"task with (end, credit) steps within rewards.timeout_s = {self.timeout_s:g} s, so fix "
                            "it.")
        return spans

    def _dispatch(self, calls: list[Call], record: Callable[[int, str, Any], None], one: Callable) -> None:
        """Every call answered through ``record``: in the workers, or here with ``one`` (a worker's call function)."""
        if self._workers:
            self._run_pool(calls, record)
            return
        for call_id, fn_idx, completion, example in calls:
            record(call_id, *one(self.fns[fn_idx], completion, example))

    def _run_pool(self, calls: list[Call], record: Callable[[int, str, Any], None]) -> None:
        """Feed ``calls`` to the workers in chunks until each is answered, failed or timed out."""
        size = max(1, min(CHUNK, math.ceil(len(calls) / len(self._workers))))
        pending = deque(deque(calls[j : j + size]) for j in range(0, len(calls), size))
        remaining = len(calls)
        startup_deadline = time.monotonic() + STARTUP_TIMEOUT_S

        def fail_running(w: WorkerHandle, reason: str) -> None:
            """Fail the call ``w`` was running, requeue the rest of its chunk, and replace the worker."""
            nonlocal remaining
            if w.chunk:
                record(w.chunk.popleft()[0], "err", reason)
                remaining -= 1
                if w.chunk:
                    pending.appendleft(w.chunk)
            w.chunk = None
            self._replace(w)

        try:
            while remaining:
                for w in list(self._workers):
                    if w.ready and w.chunk is None and pending:
                        w.chunk = pending.popleft()
                        w.started = time.monotonic()
                        try:
                            w.conn.send(list(w.chunk))
                        except OSError:  # died while idle: nothing of this chunk ran, so requeue all of it
                            pending.appendleft(w.chunk)
                            w.chunk = None
                            self._replace(w)
                now = time.monotonic()
                busy = [w for w in self._workers if w.chunk is not None]
                deadline = min((w.started + self.timeout_s for w in busy), default=startup_deadline)
                by_conn = {w.conn: w for w in self._workers}
                for conn in wait(list(by_conn), timeout=max(0.0, deadline - now)):
                    w = by_conn[conn]
                    answered, alive = self._read(w, record)
                    remaining -= answered
                    if not alive:
                        w.proc.join(timeout=1.0)
                        if not w.ready:  # would fail the same way again: stop rather than respawn forever
                            raise UserError(
                                f"a reward worker exited while loading {self._paths()} (exit code {w.proc.exitcode}; "
                                "its output is above); set rewards.workers = 0 to debug the reward module in-process."
                            )
                        fail_running(w, f"the worker process died (exit code {w.proc.exitcode}) during this call")
                now = time.monotonic()
                for w in list(self._workers):
                    if w.chunk is not None and now - w.started > self.timeout_s:
                        fail_running(w, f"timed out after {self.timeout_s:g} s; the worker was killed")
                if remaining and not pending and all(w.chunk is None for w in self._workers):
                    raise RuntimeError(f"internal error: {remaining} reward calls were lost; please report this.")
                if not any(w.ready for w in self._workers) and \
                        now > max(startup_deadline, max(w.spawned for w in self._workers) + STARTUP_TIMEOUT_S):
                    raise UserError(
                        f"loading the reward functions {self._paths()} in the workers did not finish within "
                        f"{STARTUP_TIMEOUT_S:g} s (an import or warm_up that blocks); make them load quickly, or set "
                        "rewards.workers = 0 to debug in-process."
                    )
        except BaseException:
            # Busy workers would answer these calls during the next score(): replace them so no stale answer leaks.
            for w in list(self._workers):
                if w.chunk is not None:
                    w.chunk = None
                    self._replace(w)
            raise

    def _read(self, w: WorkerHandle, record: Callable[[int, str, Any], None]) -> tuple[int, bool]:
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
                raise UserError(msg[1])  # the worker's own one-line message, naming the reward
            else:
                call = w.chunk.popleft()
                assert call[0] == msg[0], "reward worker answered out of order"
                record(*msg)
                answered += 1
                w.started = time.monotonic()  # the worker moved on to the next call of its chunk
                if not w.chunk:
                    w.chunk = None

    def close(self) -> None:
        """Stop the worker processes; the runner cannot score afterwards."""
        self._closed = True
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        self._finalizer()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
