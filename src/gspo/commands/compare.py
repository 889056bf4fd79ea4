"""``gspo compare``: one config trained under several arms and seeds, then reported.

An arm is a preset followed by "+"-suffixes that each switch settings on (``grpo+r2``: GRPO with Routing Replay R2;
``gspo+mb8``: GSPO with 8 minibatches per rollout batch), as :mod:`gspo.commands.arms` reads them. Runs already
finished are kept and checkpointed ones resume, so the same command continues a comparison; the runs left train one after another in this process or, with ``--jobs N``, as up to N
``gspo train`` processes spread over the visible GPUs.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gspo.config import flatten, load_config
from gspo.errors import STOPPED_FILE, RunStopped, UserError

Todo = tuple[list[str], Path, bool]  # a run still to train: its overrides, its run directory, whether it resumes


def _literal(value: Any) -> str:
    """A suffix's value as a dotted override's TOML literal (``True`` is ``true`` there)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def compare(config: str | None, overrides: list[str], arms: list[tuple[str, str, dict]], seeds: list[int], out: Path,
            jobs: int = 1) -> int:
    """Train ``config`` under each arm (``(arm, preset, overrides)`` as :func:`gspo.commands.arms.parse_arm` reads them) and seed into
    ``<out>/<arm>-seed<seed>``, then write the report and print the key-metrics table; the exit code."""
    from gspo.commands.report import group_means, key_metrics, load_runs, metrics_table, write_report

    run_dirs, todo = plan_runs(config, overrides, arms, seeds, out)
    code = train_concurrently(config, todo, out, jobs) if jobs > 1 else train_in_process(config, todo)
    if code:
        return code
    names = ", ".join(arm for arm, _, _ in arms)
    page = write_report(run_dirs, out / "report", title=f"gspo compare: {names} x seeds {', '.join(map(str, seeds))}")
    rows = [key_metrics(run) for run in load_runs(run_dirs)]
    print(metrics_table(rows + group_means(rows), markdown=True))
    print(f"report: {page}")
    return 0


def plan_runs(config: str | None, overrides: list[str], arms: list[tuple[str, str, dict]], seeds: list[int],
              out: Path) -> tuple[list[Path], list[Todo]]:
    """Every arm and seed's run directory, and the runs among them still to train. Every arm's settings are checked
    before any run starts; a run that died before its first checkpoint is moved aside and trained again."""
    from gspo.checkpoint import aside, complete_checkpoints
    from gspo.runlog.metrics import read_jsonl
    from gspo.train.guards import lock_run_dir

    run_dirs, todo = [], []
    for algo, preset, extra in arms:
        for seed in seeds:
            run_overrides = [*overrides, f"algorithm={preset!r}", f"seed={seed}", f"log.label={algo!r}",
                             *(f"{k}={_literal(v)}" for k, v in extra.items())]
            try:
                cfg = load_config(config, run_overrides)
            except UserError as e:
                raise UserError(f"--algos {algo}: {e}") from None
            run_dir = out / f"{algo}-seed{seed}"
            run_dirs.append(run_dir)
            rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            if rows and rows[-1]["step"] >= cfg.train.steps:
                _same_run(run_dir, cfg, rows[-1]["step"])
                print(f"[compare] {run_dir} is complete; kept", file=sys.stderr)
                continue
            if (why := stopped_itself(run_dir)) is not None:  # a result: resuming would stop it the same way
                _same_run(run_dir, cfg, None)
                print(f"[compare] {run_dir} stopped itself ({why}); kept", file=sys.stderr)
                continue
            resume = bool(complete_checkpoints(run_dir / "checkpoints")) if run_dir.exists() else False
            if run_dir.exists() and not resume:  # died before its first checkpoint: keep what it wrote, start again
                lock_run_dir(run_dir).close()  # one line if a process still trains in it (a compare run twice)
                moved = aside(run_dir, f"{run_dir.name}.incomplete-{int(time.time())}")
                run_dir.rename(moved)
                print(f"[compare] {run_dir} had no checkpoint; moved to {moved}", file=sys.stderr)
            if cfg.model.gpu_memory is not None:  # the config file's share, which start_next must see and keep
                run_overrides.append(f"model.gpu_memory={cfg.model.gpu_memory!r}")
            todo.append((run_overrides, run_dir, resume))
    return run_dirs, todo


def _same_run(run_dir: Path, cfg, steps: int | None) -> None:
    """A finished run kept for this compare was trained with the settings it asks for (what ``--resume`` may change
    aside, but for the learning rate and in-flight updates, which change its numbers), else one line: the report would
    show it under this command's title."""
    from gspo.config.resume import resume_changes

    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # no record to compare (a run written by an older gspo): kept as before
    changed, differ = resume_changes(saved, cfg.to_dict())
    differ += [k for k in ("train.lr", "rollout.in_flight") if k in changed]
    if steps is not None and steps != cfg.train.steps:
        differ = ["train.steps", *differ]
    if differ:
        key = differ[0]
        old = steps if key == "train.steps" and steps is not None else flatten(saved).get(key)
        raise UserError(f"{run_dir} is kept as finished but was trained with {key} = {old!r}, where this command asks "
                        f"for {flatten(cfg.to_dict()).get(key)!r}; use another --out, or move that run away to train it "
                        "again.")


def stopped_itself(run_dir: Path) -> str | None:
    """Why a run stopped itself by one of its own rules (:class:`gspo.errors.RunStopped`: the collapse sentinel,
    non-finite steps), as it recorded; None for a run that did not. Such a run is a result: compare keeps it and
    reports it with the steps it trained."""
    try:
        return json.loads((run_dir / STOPPED_FILE).read_text())["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


AGAIN = ("fix the cause and run the same command again: finished runs (and those that stopped themselves) are kept, "
         "runs stopped by a signal resume from their last checkpoint, the others start again.")


def _run(run_dir: Path) -> str:
    """A run as compare's lines name it: its arm and seed, and where it lives."""
    return f"{run_dir.name} ({run_dir})"


def train_in_process(config: str | None, todo: list[Todo]) -> int:
    """The runs of ``gspo compare`` one after another in this process."""
    import torch

    from gspo.train import Trainer

    for i, (overrides, run_dir, resume) in enumerate(todo):
        # The first run pays this process's start-up (imports), as a `gspo train` would; a later one shares it, so its
        # timings count from its own start, not from the command's (which would add the earlier runs' training).
        started = time.perf_counter() if i else None
        print(f"[compare] training {run_dir.name} -> {run_dir}{' (resumed)' if resume else ''}", file=sys.stderr)
        try:
            trainer = Trainer(load_config(config, overrides), run_dir, resume=resume, started=started)
            trainer.train()
        except RunStopped as e:  # a result for the report, not a failure of the compare
            print(f"[compare] {_run(run_dir)} stopped itself: {e}; kept in the report", file=sys.stderr)
            trainer = None  # its memory goes before the next run's model loads
        except UserError as e:
            raise UserError(f"{_run(run_dir)} failed: {str(e).rstrip('.')}; {AGAIN}") from None
        if trainer is not None and trainer.stop_signal is not None:
            print(f"[compare] stopped by {trainer.stop_signal}: {_run(run_dir)} stopped at its checkpoint; run the same "
                  "command again to continue (finished runs are kept, stopped ones resume)", file=sys.stderr)
            return 130 if trainer.stop_signal == "SIGINT" else 143
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


def train_concurrently(config: str | None, todo: list[Todo], out: Path, jobs: int) -> int:
    """``gspo compare --jobs N``: up to N runs at a time, each a ``gspo train`` process of its own, each started on the
    visible GPU running the fewest of them (several on one GPU when N exceeds them: small models leave a GPU idle
    between kernels, which another process's kernels fill). Each run's output goes to ``<out>/logs/<run>.log``. A stop
    signal is passed to every run, which checkpoints and stops; the same command continues them."""
    runs = _Runs(config, todo, out / "logs", jobs)
    previous = {s: signal.signal(s, runs.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while runs.pending or runs.running:
            while runs.pending and len(runs.running) < jobs:
                runs.start_next()
            time.sleep(0.5)
            runs.reap()
    except BaseException:
        runs.end_all()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return runs.outcome()


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named or [str(i) for i in range(torch.cuda.device_count())]


# A run stopped by a signal, before or after it trapped it: it checkpointed (or had not started) and resumes.
_STOP_CODES = (130, 143, -signal.SIGINT, -signal.SIGTERM)


class _Runs:
    """The runs of ``train_concurrently``: those waiting, those running (a process each), and how the others ended."""

    def __init__(self, config: str | None, todo: list[Todo], logs: Path, jobs: int):
        self.config, self.jobs, self.logs = config, jobs, logs
        self.gpus = _visible_gpus()
        self.runs = len(todo)
        logs.mkdir(parents=True, exist_ok=True)
        self.pending, self.running = list(todo), {}  # running: Popen -> (run_dir, log path, GPU or None)
        self.failed, self.halted, self.stopped = [], [], None  # halted: runs that stopped on a signal (they resume)

    def forward(self, signum, _frame) -> None:
        """The signal handler: no run starts any more, and every running one gets the signal."""
        self.stopped = signal.Signals(signum).name
        self.pending.clear()
        for proc in self.running:
            proc.send_signal(signum)

    def _least_busy_gpu(self) -> str | None:
        if not self.gpus:
            return None
        load = {g: 0 for g in self.gpus}
        for _, _, g in self.running.values():
            load[g] += 1
        return min(self.gpus, key=lambda g: load[g])

    def gpu_share(self) -> float | None:
        """Each run's share of its GPU's memory (``model.gpu_memory``) when ``--jobs`` puts several on one GPU: an
        equal part of 90% of it (the rest is the CUDA contexts' and the allocator's slack), so that no run's cache of
        freed blocks crowds out another's allocations. None with a GPU a run (or none)."""
        at_once = min(self.jobs, self.runs)
        if not self.gpus or at_once <= len(self.gpus):
            return None
        per_gpu = -(-at_once // len(self.gpus))
        return round(0.9 / per_gpu, 4)

    def start_next(self) -> None:
        overrides, run_dir, resume = self.pending.pop(0)
        env = dict(os.environ)
        gpu = self._least_busy_gpu()
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # As torchrun does for its processes: one CPU thread on a GPU (see gspo.runtime.limit_cpu_threads);
        # CPU runs share the host's cores (each would otherwise start as many OpenMP threads as it has)
        env.setdefault("OMP_NUM_THREADS", "1" if self.gpus else str(max(1, (os.cpu_count() or 1) // self.jobs)))
        share = self.gpu_share()
        if share is not None and not any(o.startswith("model.gpu_memory=") for o in overrides):
            overrides = [*overrides, f"model.gpu_memory={share}"]
        cmd = [sys.executable, "-m", "gspo.cli", "train", *([self.config] if self.config else []), *overrides,
               "--run-dir", str(run_dir), *(["--resume"] if resume else [])]
        log_path = self.logs / f"{run_dir.name}.log"
        where = f" on GPU {gpu}" if gpu is not None else ""
        print(f"[compare] training {run_dir.name} -> {run_dir}{' (resumed)' if resume else ''}{where}; output: "
              f"{log_path}", file=sys.stderr)
        with open(log_path, "a") as log_file:  # the child holds its own descriptor
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.running[proc] = (run_dir, log_path, gpu)
        if self.stopped:  # the signal came while it was being started
            proc.send_signal(signal.SIGINT if self.stopped == "SIGINT" else signal.SIGTERM)

    def reap(self) -> None:
        """Collect the runs that ended: halted by a signal, failed (with the last line of their output) or done."""
        for proc in list(self.running):
            # waitid(WNOWAIT) sees the end without reaping it: until it is reaped, the run's process group id cannot
            # be taken by a new process, so the sweep below reaches only what the run left behind.
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                continue
            _sweep(proc)
            proc.wait()
            run_dir, log_path, _ = self.running.pop(proc)
            code = proc.returncode
            if code in _STOP_CODES:
                self.halted.append(run_dir)
            elif code != 0 and (why := stopped_itself(run_dir)) is not None:  # a result for the report
                print(f"[compare] {_run(run_dir)} stopped itself: {why}; kept in the report", file=sys.stderr)
            elif code != 0:
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                       else f"failed (exit {code}: {_last_line(log_path)})")
                self.failed.append(f"{_run(run_dir)} {how}")
                print(f"[compare] {self.failed[-1]}; its output: {log_path}", file=sys.stderr)

    def end_all(self) -> None:
        """Nothing is left training on the GPUs, holding its run directory's lock."""
        for proc in self.running:
            proc.terminate()
        for proc in self.running:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            _sweep(proc)
            proc.wait()

    def outcome(self) -> int:
        """The exit code once every run has ended: a line naming the runs that failed (a UserError) or stopped."""
        halted = ", ".join(map(_run, self.halted))
        if self.failed:
            stopped = f"; {halted} stopped at {'its' if len(self.halted) == 1 else 'their'} checkpoint" if halted else ""
            raise UserError(f"{'; '.join(self.failed)}{stopped}. Each run's output is in {self.logs}; {AGAIN}")
        if self.stopped or self.halted:
            print(f"[compare] stopped by {self.stopped or 'a signal to the run'}: {halted or 'no run had started'} "
                  f"stopped at {'its' if len(self.halted) == 1 else 'their'} checkpoint; run the same command again to "
                  "continue (finished runs are kept, stopped ones resume)", file=sys.stderr)
            return 130 if self.stopped == "SIGINT" else 143
        return 0


def _last_line(log_path: Path) -> str:
    """The last line a failed run wrote (its error), without the ``gspo: error:`` that compare's own line starts with."""
    lines = log_path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()
    return lines[-1].removeprefix("gspo: error: ").strip() if lines else "no output"


def _sweep(proc: subprocess.Popen) -> None:
    """End whatever a run left in its process group (a session of its own): the reward workers of a run that was
    killed outlive it otherwise."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left
        pass
