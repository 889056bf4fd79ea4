"""`gspo train --nproc N`, the launcher, with real torchrun jobs on gloo (CPU): a stop signal to the launcher (or its
process group) reaches the job and ends it with the --resume line, no process outliving it; a config error ends in
gspo's own one line before any process starts; a process that fails, is killed or never joins ends the job in one
line naming it, within a bounded time. Every run directory stays valid and resumes, also at another process count."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo.runlog.metrics import read_jsonl

from test_dist import ENV, _overrides
from test_faults import check_run_dir
from test_trainer import tiny_dir  # noqa: F401  (the module fixture)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process; None once it is gone (a zombie counts as gone: it runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def _tree(root: int) -> set[int]:
    """``root`` and every live process below it."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*"):
        if (s := _stat(int(stat.name))) is not None:
            parents[int(stat.name)] = s[1]
    tree, grew = {root}, True
    while grew:
        below = {p for p, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | below, bool(below)
    return tree


def _mentioning(text: str) -> set[int]:
    """Live processes whose command line holds ``text`` (the run directory: every process of a job names it)."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(proc.name) != os.getpid() and _stat(int(proc.name)) is not None:
            found.add(int(proc.name))
    return found


class Job:
    """`gspo train ... --nproc 2` started in its own session, as a shell starts a job; stderr goes to a file (orphans
    that kept a pipe open would block a reader forever)."""

    def __init__(self, cwd: Path, run: Path, overrides: list[str], *flags: str, nproc: int = 2, env=None):
        self.run, self.err_path = run, cwd / f"stderr-{time.monotonic_ns()}.txt"
        self.proc = subprocess.Popen([sys.executable, "-m", "gspo.cli", "train", *overrides, "--nproc", str(nproc),
                                      "--run-dir", str(run), *flags], cwd=cwd, env=env or ENV, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"))
        self.pid = self.proc.pid

    def lines(self) -> int:
        return len(read_jsonl(self.run / "metrics.jsonl")) if (self.run / "metrics.jsonl").exists() else 0

    def workers(self) -> list[int]:
        """The processes running `gspo.cli train` below the launcher (torchrun's workers), by pid."""
        return sorted(p for p in _tree(self.pid) - {self.pid}
                      if b"gspo.cli" in Path(f"/proc/{p}/cmdline").read_bytes() and _stat(p) is not None
                      and b"torch.distributed" not in Path(f"/proc/{p}/cmdline").read_bytes()
                      and b"gspo.parallel" not in Path(f"/proc/{p}/cmdline").read_bytes())

    def rank(self, rank: int) -> int | None:
        """The pid of worker ``rank`` (torchrun's RANK in its environment), once it exists."""
        for pid in self.workers():
            try:
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        return None

    def agent(self) -> int:
        """torchrun's process (the launcher's only child)."""
        (pid,) = [p for p in _tree(self.pid) if _stat(p) and _stat(p)[1] == self.pid]
        return pid

    def wait_for(self, ready, what: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None and not ready():
            time.sleep(0.05)
        assert self.proc.poll() is None and ready(), f"{what} never came: {self.stderr()[-3000:]}"

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_all()

    def kill_all(self) -> set[int]:
        """SIGKILL to whatever of the job is still alive (a test that fails must not leave a job training); returns
        what was left."""
        left = _mentioning(str(self.run)) | ({self.pid} if self.proc.poll() is None else set())
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.poll()
        return left

    def stderr(self) -> str:
        return self.err_path.read_text()


def _gone(pids: set[int], within: float = 5.0) -> set[int]:
    """The processes of ``pids`` still alive ``within`` seconds from now (reaping an orphan takes its new parent a
    moment)."""
    deadline = time.time() + within
    while (alive := {p for p in pids if _stat(p) is not None}) and time.time() < deadline:
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to its process group"])
def test_a_stop_signal_to_gspo_train_nproc_stops_the_whole_job(tiny_dir, tmp_path, how):  # noqa: F811
    """`kill PID` of `gspo train --nproc 2` (a container stop), or Ctrl-C (SIGINT to the terminal's process group):
    the signal reaches every process once, they finish the rollout batch, checkpoint together and end; the launcher
    exits 143 / 130 with one --resume line (no torchrun report) and no process of the job is left. The run directory
    is valid, and the printed command resumes it (run on one process after SIGTERM; after SIGINT, for CI time, only
    read: two processes and --resume).
    (The launcher used to die alone, leaving torchrun and its workers training as orphans.) The second job runs with
    MASTER_ADDR / MASTER_PORT naming a port in use: the launcher's torchrun picks a free port of its own."""
    run = tmp_path / "run"
    overrides = _overrides(tiny_dir, "train.steps=8", "log.checkpoint_every=0")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy.getsockname()[1])}
    job = Job(tmp_path, run, overrides, env=env if how.startswith("SIGINT") else ENV)
    try:
        job.wait_for(lambda: job.lines() >= 2 and len(job.workers()) == 2, "two metrics lines from two processes")
        tree = _tree(job.pid)
        if how.startswith("SIGTERM"):
            os.kill(job.pid, signal.SIGTERM)
        else:
            os.killpg(job.pid, signal.SIGINT)
        code = job.finish(timeout=120)
    finally:
        left = job.kill_all()
        busy.close()
    err = job.stderr()
    assert not left and not _gone(tree), f"processes of the job outlived it: {sorted(left or _gone(tree))}"
    assert code == (143 if how.startswith("SIGTERM") else 130), err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIG")]
    assert len(stops) == 1 and "--nproc 2" in stops[0] and "--resume" in stops[0], err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "gspo: error" not in err, err[-3000:]
    rows = check_run_dir(run, len(read_jsonl(run / "metrics.jsonl")))
    assert 2 <= len(rows) < 8 and f"after {len(rows)} optimizer steps" in stops[0]
    assert (run / "checkpoints" / f"step-{len(rows):06d}" / "COMPLETE").exists()
    again = shlex.split(stops[0].split("continue with: ", 1)[1])
    assert again[:2] == ["gspo", "train"] and again[again.index("--nproc") + 1] == "2" and "--resume" in again
    if how.startswith("SIGINT"):
        return
    again = [a for i, a in enumerate(again) if a != "--nproc" and again[i - 1] != "--nproc"]  # another process count
    done = subprocess.run([sys.executable, "-m", "gspo.cli", *again[1:]], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_run_dir(run, 8)


def test_a_launcher_killed_with_sigkill_still_stops_its_job(tiny_dir, tmp_path):  # noqa: F811
    """SIGKILL to `gspo train --nproc 2` (nothing can catch it: the OOM killer, a `kill -9`): the kernel sends torchrun
    SIGTERM as its parent dies (PR_SET_PDEATHSIG), so the job stops as after a SIGTERM -- the rollout batch finished,
    a checkpoint written together -- and no process is left, and the run directory is whole."""
    run = tmp_path / "run"
    overrides = _overrides(tiny_dir, "train.steps=40", "log.checkpoint_every=0")
    job = Job(tmp_path, run, overrides)
    try:
        job.wait_for(lambda: job.lines() >= 2 and len(job.workers()) == 2, "two metrics lines from two processes")
        tree = _tree(job.pid)
        os.kill(job.pid, signal.SIGKILL)
        job.proc.wait(timeout=30)
        alive = _gone(tree, within=60)
    finally:
        left = job.kill_all()
    assert not alive and not left, f"processes of the job outlived it: {sorted(alive | left)}"
    rows = check_run_dir(run, len(read_jsonl(run / "metrics.jsonl")))
    assert 2 <= len(rows) < 40 and (run / "checkpoints" / f"step-{len(rows):06d}" / "COMPLETE").exists()
    # (a resume on one process from such a stop: the SIGTERM case of test_a_stop_signal_to_gspo_train_nproc...)


def _one_error_line(err: str) -> str:
    """The launcher's one line; nothing of torchrun's report, no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("gspo: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "torch.distributed" not in err, err[-3000:]
    return lines[0]


def test_a_config_error_under_nproc_is_gspo_s_one_line_before_any_process_starts(tiny_dir, tmp_path):  # noqa: F811
    """A bad value, and a batch two processes cannot share, end in gspo's own line and exit 2 from the launcher,
    which checks the config as one process does before starting torchrun: no run directory is made. (torchrun used
    to start two processes that each printed the line, then its own multi-screen report, exit 1.)"""
    for bad, match in [("train.lr=nan", "'train.lr' = nan is not a finite number"),
                       ("rollout.prompts_per_batch=3", "cannot be shared by 2 processes")]:
        run = tmp_path / bad.split("=")[0]
        done = subprocess.run([sys.executable, "-m", "gspo.cli", "train", *_overrides(tiny_dir, bad), "--nproc", "2",
                               "--run-dir", str(run)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and match in _one_error_line(done.stderr), done.stderr[-3000:]
        assert not run.exists()


@pytest.mark.parametrize("fault", ["bad data", "SIGKILL", "SIGSTOP"])
def test_a_process_that_fails_or_hangs_at_start_ends_the_job_in_one_line(tiny_dir, tmp_path, fault):  # noqa: F811
    """At start: a data file with a bad line (every process raises the same UserError after loading the model), rank
    1 killed before it joins the others, or stopped before it joins (a rendezvous that never completes). Each ends in
    one line naming the cause -- the data file's line (exit 2), process 1 killed by SIGKILL (exit 1), process 0's
    wait of dist.timeout_s for the others and process 1 that never answered (exit 2) -- with no process left, in a
    bounded time (dist.timeout_s, then torchrun's 30 s wait for the hung process, which the test cuts short with the
    SIGKILL torchrun would send). The same command then starts the run afresh in that directory."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1 + 1 =", "answer": "2"}\n{not json\n')
    extra = {"bad data": ["data.task='jsonl'", f"data.path='{data}'"], "SIGSTOP": ["dist.timeout_s=3"]}
    run = tmp_path / "run"
    job = Job(tmp_path, run, _overrides(tiny_dir, "train.steps=2", *extra.get(fault, [])))
    try:
        if fault != "bad data":
            job.wait_for(lambda: job.rank(1) is not None and job.rank(0) is not None, "processes 0 and 1")
            first, hung = job.rank(0), job.rank(1)
            os.kill(hung, getattr(signal, fault))
        if fault == "SIGSTOP":  # once process 0 has given up, end the hung one (torchrun would wait 30 s to)
            deadline = time.time() + 120
            while time.time() < deadline and _stat(first) is not None:
                time.sleep(0.1)
            os.kill(hung, signal.SIGKILL)
        code = job.finish(timeout=240)
    finally:
        left = job.kill_all()
    assert not left, f"processes of the job outlived it: {sorted(left)}"
    line = _one_error_line(job.stderr())
    if fault == "bad data":
        assert code == 2 and f"{data}:2: the line is not valid JSON" in line and not line.startswith("gspo: error: process"), line
    elif fault == "SIGKILL":
        assert code == 1 and "process 1 of 2 (pid " in line and "was killed by SIGKILL" in line, line
        assert "no checkpoint was written" in line
    else:
        assert code == 2 and line.startswith("gspo: error: process 1 of 2 did not answer") and \
            "Process 0 of 2 waited dist.timeout_s = 3 s for the others to join" in line, line
    if fault == "SIGKILL":  # nothing in the way of a new start
        again = subprocess.run([sys.executable, "-m", "gspo.cli", "train", *_overrides(tiny_dir, "train.steps=2"),
                                "--nproc", "2", "--run-dir", str(run)], cwd=tmp_path, env=ENV, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        check_run_dir(run, 2)


@pytest.mark.slow
def test_a_job_that_does_not_stop_is_killed_after_dist_timeout_s(tiny_dir, tmp_path):  # noqa: F811
    """torchrun hangs (SIGSTOP) and never passes the launcher's SIGTERM on: dist.timeout_s + the launcher's margin
    (15 s; 3 s here, through GSPO_LAUNCH_MARGIN_S: a stopped torchrun only makes the launcher wait it out) after the
    signal the launcher kills every process of the job and exits 143 with the --resume line. The run directory is
    valid (lines and checkpoints are whole or absent, whatever the kill interrupted) and resumes on one process."""
    run = tmp_path / "run"
    job = Job(tmp_path, run, _overrides(tiny_dir, "train.steps=1000", "dist.timeout_s=10"),
              env={**ENV, "GSPO_LAUNCH_MARGIN_S": "3"})
    try:
        job.wait_for(lambda: job.lines() >= 2 and len(job.workers()) == 2, "two metrics lines from two processes")
        tree = _tree(job.pid)
        os.kill(job.agent(), signal.SIGSTOP)
        os.kill(job.pid, signal.SIGTERM)
        code = job.finish(timeout=120)
    finally:
        left = job.kill_all()
    err = job.stderr()
    assert not left and not _gone(tree), f"processes of the job outlived it: {sorted(left or _gone(tree))}"
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
    assert code == 143 and len(stops) == 1, err[-3000:]
    assert "did not end within 13 s of it (dist.timeout_s + 3 s)" in stops[0] and "so its processes were killed" in stops[0]
    rows = check_run_dir(run, len(read_jsonl(run / "metrics.jsonl")))
    assert len(rows) < 1000
    again = shlex.split(stops[0].split("continue with: ", 1)[1])
    steps = [a for a in again if a.startswith("train.steps=")]
    assert again[:2] == ["gspo", "train"] and "--resume" in again and steps
    again = [a for i, a in enumerate(again) if "--nproc" not in (a, again[i - 1]) and a not in steps]
    target = (len(rows) // 2 + 1) * 2  # whole rollout batches (the kill may have come between two minibatch lines)
    done = subprocess.run([sys.executable, "-m", "gspo.cli", *again[1:], f"train.steps={target}"], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_run_dir(run, target)


def test_torchrun_gets_the_shutdown_timeout_only_where_it_has_the_option(monkeypatch):
    """torch 2.11's torchrun has no --shutdown-timeout and refused the whole command (every `gspo train --nproc` job on
    the GPU image): the launcher passes it only where this torch's torchrun lists it."""
    import argparse

    import torch.distributed.run as run

    from gspo.parallel.launch import _shutdown_timeout

    assert _shutdown_timeout(12.2) in ([], ["--shutdown-timeout=13"])
    old = argparse.ArgumentParser()
    old.add_argument("--nproc-per-node")
    monkeypatch.setattr(run, "get_args_parser", lambda: old)
    assert _shutdown_timeout(12.2) == []
    new = argparse.ArgumentParser()
    new.add_argument("--shutdown-timeout", type=int)
    monkeypatch.setattr(run, "get_args_parser", lambda: new)
    assert _shutdown_timeout(12.2) == ["--shutdown-timeout=13"]
