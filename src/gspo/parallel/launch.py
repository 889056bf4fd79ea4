"""``gspo train --nproc N``: the one place where a job of several processes is started, stopped, and its end turned
into one line and an exit code.

The launcher (:func:`run_job`, in the process the user started) runs torchrun -- torch's own launcher, called by
:func:`agent_main` in a process of its own -- in a session of its own, so that a Ctrl-C at the terminal or a SIGTERM
to the user's process group reaches the launcher alone, and each worker gets the signal once: the launcher hands it
to torchrun, torchrun to each worker (every worker has a session of its own too), and the workers stop as one
process does: they finish the rollout batch, agree, checkpoint together and exit 130 / 143. A second signal reaches
the workers directly (a second signal stops a process at once). A job still running ``dist.timeout_s`` (plus
:data:`MARGIN_S`) after the first signal is killed.

Every process of the job carries :data:`JOB_DIR` in its environment, a temporary directory: each worker writes how it
ended there (:func:`report`), torchrun which workers failed before it stopped the others; the launcher reads both and
prints one line: the stop line with the ``--resume`` command, or ``gspo: error:`` with the cause (the first process
that failed on its own, its message), exit 2 for a user error and 1 otherwise. torchrun's own report (a traceback and
a page per process) is kept for ``--debug``. The variable is also how the launcher finds every process of the job
once torchrun is gone (theirs included: reward workers inherit it) and kills whatever outlived it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gspo.errors import UserError

JOB_DIR = "GSPO_JOB_DIR"
AGENT_FILE = "torchrun.json"
# Past torchrun's own wait for the workers (dist.timeout_s): its SIGKILL to them, and its own exit. The tests shorten
# it with GSPO_LAUNCH_MARGIN_S where torchrun is made to hang and the margin is only waited out.
MARGIN_S = float(os.environ.get("GSPO_LAUNCH_MARGIN_S") or 15.0)
STOP_CODES = {130: "SIGINT", 143: "SIGTERM", -signal.SIGINT: "SIGINT", -signal.SIGTERM: "SIGTERM"}


def _write_json(path: Path, data: dict) -> None:
    """Whole or absent: the launcher may read the directory the moment the job ends."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def report(**outcome) -> bool:
    """Under ``gspo train --nproc``: record how this worker ended for the launcher (``exit``, ``stop_signal``,
    ``step``; or ``error``, ``user_error``, ``lost``), which then prints the job's one line; False elsewhere (a plain
    ``torchrun``, one process), where nothing is recorded and the process speaks for itself."""
    job = _launched()
    if job is None:
        return False
    rank = int(os.environ["RANK"])
    _write_json(job / f"rank-{rank:05d}.json", {"rank": rank, "pid": os.getpid(), "time": time.time(), **outcome})
    return True


def _launched() -> Path | None:
    """The job directory when this process is a worker of ``gspo train --nproc``."""
    job = os.environ.get(JOB_DIR)
    if not job or "RANK" not in os.environ or "LOCAL_RANK" not in os.environ or not Path(job).is_dir():
        return None
    return Path(job)


def report_error(e: BaseException) -> bool:
    """:func:`report` of the exception that ends this worker: a KeyboardInterrupt is the second stop signal, a
    :class:`~gspo.parallel.comm.PeerLost` the consequence of another process's end, not a cause of its own."""
    if _launched() is None:  # before any import: every command's errors come this way
        return False
    from gspo.parallel.comm import PeerLost

    if isinstance(e, KeyboardInterrupt):
        return report(exit=130, stop_signal="SIGINT", at_once=True)
    text = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    lost = ("waited" if e.waited else "closed") if isinstance(e, PeerLost) else None
    return report(error=(text.strip().splitlines() or [type(e).__name__])[0], user_error=isinstance(e, UserError),
                  lost=lost)


# ------------------------------------------------------------------------------------------ torchrun, in its process


def _end_with_launcher(launcher: int) -> None:
    """SIGTERM to this process when the launcher ends, even by SIGKILL (Linux's parent-death signal): torchrun passes
    it on and the job stops as if the launcher had been sent it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup is all there is
        return
    if os.getppid() != launcher:  # it was gone before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def agent_main(argv: list[str]) -> int:
    """``python -m gspo.parallel.launch LAUNCHER_PID [--debug] TORCHRUN_ARGS...``: torchrun in this process; which
    workers failed (torchrun's ChildFailedError) goes to the job directory instead of a report on the terminal."""
    launcher, debug = int(argv[0]), argv[1:2] == ["--debug"]
    _end_with_launcher(launcher)
    if not debug:  # torchrun's banners and warnings; this process logs nothing else
        logging.disable(logging.CRITICAL)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    out = Path(os.environ[JOB_DIR]) / AGENT_FILE
    try:
        torchrun.run(torchrun.parse_args(argv[2 if debug else 1:]))
        return 0
    except ChildFailedError as e:  # the workers that failed before torchrun stopped the others
        _write_json(out, {"failures": {str(rank): {"exitcode": f.exitcode, "pid": f.pid, "time": f.timestamp}
                                       for rank, f in e.failures.items()}})
        if debug:
            raise
        return 1
    except SignalException as e:  # it has passed the signal on and waited for the workers
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 -- torchrun itself failed: the launcher names it in its line
        _write_json(out, {"error": (f"{type(e).__name__}: {e}".strip().splitlines() or [""])[0]})
        if debug:
            raise
        return 1


# ------------------------------------------------------------------------------------------ the launcher


def _job_processes(job: Path, parent: int | None = None) -> list[int]:
    """Live processes whose environment names this job's directory (children of ``parent`` only, if given)."""
    token = f"{JOB_DIR}={job}\0".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if parent is not None and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if token in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _kill_leftovers(job: Path) -> None:
    """SIGKILL to every process of the job still alive, then wait (a few seconds at most) until they are gone."""
    left = _job_processes(job)
    for pid in left:
        _send(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _job_processes(job)


class _Signals:
    """While the job runs: the first SIGINT / SIGTERM goes to torchrun, which passes it to each worker once; a second
    goes to the workers directly (a second signal stops a process at once). Installed before torchrun starts, so that
    no signal finds the launcher without its handlers; one that came before torchrun existed is passed on when it
    does."""

    def __init__(self, job: Path, grace_s: float):
        self.job, self.grace_s = job, grace_s
        self.agent: subprocess.Popen | None = None
        self.received: list[int] = []
        self.deadline: float | None = None  # when the job is killed, once a signal came
        self._previous: dict = {}

    def __enter__(self) -> "_Signals":
        self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s + MARGIN_S
        if self.agent is None:
            return
        if len(self.received) == 1:
            _send(self.agent.pid, signum)
        else:
            for pid in _job_processes(self.job, parent=self.agent.pid):
                _send(pid, signum)

    def started(self, agent: subprocess.Popen) -> None:
        self.agent = agent
        if self.received:
            _send(agent.pid, self.received[0])

    def wait(self) -> bool:
        """Wait for torchrun to end; True if the job outlived its time after a stop signal (it is still running)."""
        while self.agent.poll() is None:
            if self.deadline is not None and time.monotonic() > self.deadline:
                return True
            try:
                self.agent.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        return False


def _shutdown_timeout(grace_s: float) -> list[str]:
    """torchrun's wait between its SIGTERM to the workers and its SIGKILL, set to ``grace_s`` where this torch's
    torchrun has the option (2.11's does not, and refuses the whole command: its default wait, 30 s, stays; the
    launcher's own deadline still kills what outlives the job)."""
    from torch.distributed.run import get_args_parser

    known = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    return [f"--shutdown-timeout={math.ceil(grace_s)}"] if "--shutdown-timeout" in known else []


def run_job(nproc: int, worker_args: list[str], *, grace_s: float, debug: bool, run_dir: Path, again: str) -> int:
    """Run ``python -m gspo.cli WORKER_ARGS`` as ``nproc`` processes under torchrun and return the exit code (0,
    130 / 143 when stopped by a signal, 2 for a user error, 1 otherwise) once no process of the job is left; prints
    the job's one line. ``grace_s``: how long the job may take to stop after a signal; ``again``: the command that
    resumes it."""
    job = Path(tempfile.mkdtemp(prefix="gspo-job-"))
    cmd = [sys.executable, "-m", "gspo.parallel.launch", str(os.getpid()), *(["--debug"] if debug else []),
           "--standalone", f"--nproc_per_node={nproc}", *_shutdown_timeout(grace_s), "-m", "gspo.cli", *worker_args]
    try:
        with _Signals(job, grace_s) as signals:
            agent = subprocess.Popen(cmd, env={**os.environ, JOB_DIR: str(job)}, start_new_session=True)
            try:
                signals.started(agent)
                timed_out = signals.wait()
            finally:
                _kill_leftovers(job)  # torchrun too, when it outlived its time
                agent.wait()
        code, line = verdict(_read(job), agent.returncode, nproc=nproc, received=signals.received,
                             timed_out=timed_out, grace_s=grace_s, run_dir=run_dir, again=again)
    finally:
        shutil.rmtree(job, ignore_errors=True)
    if line:
        print(line, file=sys.stderr)
    return code


def _read(job: Path) -> dict:
    """What torchrun and the workers recorded: ``{"torchrun": {...}, "ranks": {rank: {...}}}``."""
    def load(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    return {"torchrun": load(job / AGENT_FILE),
            "ranks": {int(p.stem.split("-")[1]): load(p) for p in job.glob("rank-*.json")}}


def _checkpoint_state(run_dir: Path) -> tuple[int | None, str]:
    """The newest complete checkpoint's step (None if there is none) and a phrase naming it."""
    from gspo.checkpoint import checkpoint_step, complete_checkpoints

    done = complete_checkpoints(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
    if not done:
        return None, "no checkpoint was written"
    return checkpoint_step(done[-1]), f"the last complete checkpoint is {done[-1]}"


def _stop_line(signame: str, step: int | None, run_dir: Path, again: str) -> str:
    if step is None:
        return f"stopped by {signame} before its first checkpoint; run the same command again to start over"
    return (f"stopped by {signame} after {step} optimizer steps; checkpoint in {run_dir / 'checkpoints'}; "
            f"continue with: {again}")


def verdict(seen: dict, agent_code: int, *, nproc: int, received: list[int], timed_out: bool, grace_s: float,
            run_dir: Path, again: str) -> tuple[int, str | None]:
    """The job's exit code and its one line (None when the job finished: the first process said so)."""
    ranks, agent = seen["ranks"], seen["torchrun"]
    step, checkpoint = _checkpoint_state(run_dir)
    if len(ranks) == nproc and all(r.get("exit") == 0 for r in ranks.values()):
        return 0, None  # every process finished (torchrun itself may have been the one that hung)
    if timed_out:
        name = signal.Signals(received[0]).name
        return 128 + received[0], (
            f"stopped by {name}, but the job did not end within {grace_s + MARGIN_S:g} s of it (dist.timeout_s + "
            f"{MARGIN_S:g} s), so its processes were killed; {checkpoint}"
            + (f"; continue with: {again}" if step is not None else "; run the same command again to start over"))
    if agent.get("error"):
        return 1, f"gspo: error: torchrun could not run the job ({agent['error']}); run again with --debug for its report."
    if agent_code == 0:
        return 0, None
    failed = {int(r): f for r, f in agent.get("failures", {}).items()} or \
        {r: {} for r, rec in ranks.items() if rec.get("exit") != 0}
    causes, stops = [], []
    for rank, failure in sorted(failed.items()):
        rec, code = ranks.get(rank, {}), failure.get("exitcode")
        if rec.get("stop_signal") or (not rec.get("error") and code in STOP_CODES):
            stops.append(rec.get("stop_signal") or STOP_CODES[code])
            continue
        # In the order torchrun saw them fail (whole seconds; a process it killed itself, after waiting for it, comes
        # later). Within one second: an error of its own; then having waited in vain for the others (whoever died
        # next was killed for hanging); then a death without a word; then having found the others gone (after it).
        kind = {"waited": 1, "closed": 3}.get(rec.get("lost"), 0 if rec.get("error") else 2)
        causes.append((int(failure.get("time", rec.get("time", 0))), kind, rank, rec, failure))
    if not causes and (stops or received):
        name = signal.Signals(received[0]).name if received else stops[0]
        return 130 if name == "SIGINT" else 143, _stop_line(name, ranks.get(0, {}).get("step", step), run_dir, again)
    then = f"{checkpoint}" + (f"; once the cause is fixed, continue with: {again}" if step is not None else "")
    if not causes:
        return 1, (f"gspo: error: the job ended with exit code {agent_code} and no process said why (run again with "
                   f"--debug for torchrun's report); {then}")
    causes.sort(key=lambda c: c[:3])
    _, _, rank, rec, failure = causes[0]
    hung = [c[2] for c in causes[1:] if c[4].get("exitcode") == -signal.SIGKILL]
    return _error_line(rank, rec, failure, ranks, nproc=nproc, then=then, hung=hung if rec.get("lost") == "waited" else [])


def _error_line(rank: int, rec: dict, failure: dict, ranks: dict, *, nproc: int, then: str,
                hung: list[int]) -> tuple[int, str]:
    """The line for the process that failed first on its own: its message, or how it ended; ``hung``: the processes
    torchrun killed after the first gave up waiting for them."""
    who = f"process {rank} of {nproc}"
    if rec.get("error"):
        same = all(r.get("error") == rec["error"] for r in ranks.values() if r.get("error"))
        text = rec["error"] if rec.get("user_error") and same else f"{who}: {rec['error']}"
        if hung:
            many = len(hung) > 1
            text = (f"process{'es' if many else ''} {', '.join(map(str, hung))} of {nproc} did not answer (and "
                    f"{'were' if many else 'was'} killed once the others gave up on {'them' if many else 'it'}): {text}")
        if not rec.get("user_error"):
            text += f" (its traceback is above); {then}"
        return (2 if rec.get("user_error") else 1), f"gspo: error: {text}"
    code, pid = failure.get("exitcode"), failure.get("pid", "?")
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (a kill -9, or the kernel's out-of-memory killer: see `dmesg`)" if -code == signal.SIGKILL else ""
        return 1, f"gspo: error: {who} (pid {pid}) was killed by {name}{why}; {then}"
    return 1, (f"gspo: error: {who} (pid {pid}) exited with code {code} without an error of gspo's own (run again "
               f"with --debug for torchrun's report); {then}")


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
