"""Score completions with user reward functions in worker processes (:mod:`gspo.workers`: why processes, the fork
server), each call under a hard time limit; or, with ``workers=0``, in this process.

- :class:`RewardSpec`, :func:`config_specs`: the reward terms a config names; :class:`RewardResult`: the scores;
- :class:`RewardRunner`: ``score`` (the weighted sum, NaN where a call failed) and ``step_spans``
  (``loss.step_credit``), both through ``_run_pool``: any idle worker takes the next chunk of calls.

Protocol: the parent sends a chunk of up to ``CHUNK`` calls in one message (cheap IPC); the worker answers each
call as soon as it finishes. The parent therefore always knows which call is running and since when: on a timeout
exactly that call is failed, and the unanswered rest of its chunk goes back to the queue. The workers run
:func:`gspo.rewards.worker.load`, which the fork server imports once.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gspo.data import default_reward
from gspo.errors import UserError
from gspo.example import Example
from gspo.rewards.worker import RewardFn, call as _call, call_steps, load, locate, resolve, what  # noqa: F401
from gspo.workers.pool import STARTUP_TIMEOUT_S, WorkerHandle, Workers, died, timed_out

Call = tuple[int, int, str, Example]  # (call id, function index, completion, example)

CHUNK = 16  # calls per message: large enough to amortise IPC, small enough to balance load across workers
MAX_ERRORS = 8  # error messages kept per score() for logging


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
        self._pool = Workers(load, ([s.path for s in specs], self.steps), "gspo-reward-worker", "gspo.rewards.worker")
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
                self._pool.start()
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
        return len(self._pool.handles)

    def _paths(self) -> str:
        return ", ".join([repr(s.path) for s in self.specs] + ([what(self.steps, steps=True)] if self.steps else []))

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> RewardResult:
        """Every reward function on every ``(completion, example)`` pair, and their weighted sum.

        A call that raises, times out or loses its worker is NaN and counted in ``failures``; a function that
        returns a non-number, NaN or inf raises UserError, since that is a bug in the function, not bad luck.
        """
        if self._pool.closed:
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
        if self._pool.handles:
            self._run_pool(calls, record)
            return
        for call_id, fn_idx, completion, example in calls:
            record(call_id, *one(self.fns[fn_idx], completion, example))

    def _run_pool(self, calls: list[Call], record: Callable[[int, str, Any], None]) -> None:
        """Feed ``calls`` to the workers in chunks until each is answered, failed or timed out."""
        workers = self._pool.handles
        size = max(1, min(CHUNK, math.ceil(len(calls) / len(workers))))
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
            self._pool.replace(w)

        try:
            while remaining:
                for w in list(workers):
                    if w.ready and w.chunk is None and pending:
                        chunk = pending.popleft()
                        try:
                            w.send(list(chunk), chunk)
                        except OSError:  # died while idle: nothing of this chunk ran, so requeue all of it
                            pending.appendleft(chunk)
                            w.chunk = None
                            self._pool.replace(w)
                busy = [w for w in workers if w.chunk is not None]
                deadline = min((w.started + self.timeout_s for w in busy), default=startup_deadline)
                answered, dead = self._pool.wait(list(workers), deadline, record)
                remaining -= answered
                for w in dead:
                    if not w.ready:  # would fail the same way again: stop rather than respawn forever
                        raise UserError(
                            f"a reward worker exited while loading {self._paths()} (exit code {w.proc.exitcode}; "
                            "its output is above); set rewards.workers = 0 to debug the reward module in-process."
                        )
                    fail_running(w, f"{died(w)} during this call")
                for w in self._pool.overdue(self.timeout_s):
                    fail_running(w, timed_out(self.timeout_s))
                if remaining and not pending and all(w.chunk is None for w in workers):
                    raise RuntimeError(f"internal error: {remaining} reward calls were lost; please report this.")
                if not any(w.ready for w in workers) and \
                        time.monotonic() > max(startup_deadline, max(w.spawned for w in workers) + STARTUP_TIMEOUT_S):
                    raise UserError(
                        f"loading the reward functions {self._paths()} in the workers did not finish within "
                        f"{STARTUP_TIMEOUT_S:g} s (an import or warm_up that blocks); make them load quickly, or set "
                        "rewards.workers = 0 to debug in-process."
                    )
        except BaseException:
            # Busy workers would answer these calls during the next score(): replace them so no stale answer leaks.
            for w in list(workers):
                if w.chunk is not None:
                    w.chunk = None
                    self._pool.replace(w)
            raise

    def close(self) -> None:
        """Stop the worker processes; the runner cannot score afterwards."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        self._pool.close()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
