"""Ctrl-C (a real SIGINT) before a run's first checkpoint: during start-up, and twice in a batch before any checkpoint.

The first Ctrl-C inside the training loop (finish the batch, checkpoint, exit 130) is tested in test_trainer.py and
test_faults.py; here the moments before there is anything to checkpoint."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo.runlog.metrics import read_jsonl

from test_faults import check_run_dir
from test_trainer import tiny_dir  # noqa: F401  (the module fixture)

TESTS = Path(__file__).resolve().parent


def _as_from_a_terminal():
    """SIGINT as a terminal's process has it: a shell starting a job in the background (as CI runners may start the
    tests) leaves it ignored, and Python then installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _interrupted(proc: subprocess.Popen) -> str:
    """The last line of an interrupted `gspo train`, after checking it ended as Ctrl-C must: exit 130, no traceback."""
    err = proc.communicate(timeout=300)[1]
    # -SIGINT: the interpreter ended by the signal after gspo's line (a shell's $? is 130 for both)
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, (proc.returncode, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("gspo: interrupted") and err.count("gspo: ") == 1, err[-3000:]
    # one true message about what the directory keeps (a second Ctrl-C used to say it "keeps the last checkpoint" too)
    assert err.count("keeps its last checkpoint") + err.count("has no checkpoint yet") <= 1, err[-3000:]
    return last


@pytest.mark.extended
def test_ctrl_c_before_the_first_checkpoint_then_the_command_it_names_goes_on(tiny_dir, tmp_path):  # noqa: F811
    """1. SIGINT at moments spread over start-up (imports, the config, the model, the reward import, which holds the
       process until the test releases it, so every moment falls before training): exit 130, one line, no traceback
       (one during the imports of gspo.cli's main used to end in a KeyboardInterrupt traceback, exit -2), and the
       directory is taken over by the next start.
    2. The same command, held in its second rollout batch (the first one trained and logged, no checkpoint yet:
       log.checkpoint_every = 2), then Ctrl-C twice: exit 130, one line that names the command to continue with.
    3. That command (--resume) trains the run from its start to the end; the run directory passes check_run_dir.
       (--resume used to refuse a run without a checkpoint, and a plain start a run with metrics lines: the directory
       had to be moved aside by hand.)"""
    run, hold = tmp_path / "run", tmp_path / "hold"
    env = {**os.environ, "GSPO_TEST_HOLD": str(hold),
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    base = [sys.executable, "-m", "gspo.cli", "train", f"model.name='{tiny_dir}'", "model.device='cpu'",
            "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.minibatches=2",
            "train.steps=6", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=2", "--run-dir", str(run)]

    hold.touch()
    for delay in (0.3, 1.0, 2.0, None):  # None: at the held reward import
        proc = _start([*base, "rewards.functions=[{path='hold_at_import:text_length'}]"], env)
        if delay is None:
            _wait_for(Path(f"{hold}.import"), proc)
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _interrupted(proc)
        assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").stat().st_size

    args = [*base, "rewards.functions=[{path='compare_rewards:text_length_unless'}]"]
    proc = _start(args, {**env, "GSPO_TEST_HOLD_RUNS": run.name})
    _wait_for(Path(f"{hold}.{run.name}"), proc)
    proc.send_signal(signal.SIGINT)
    while "SIGINT: finishing" not in proc.stderr.readline():  # the first one was acknowledged
        assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    last = _interrupted(proc)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2] and not (run / "checkpoints").exists()
    assert f"the run directory {run} has no checkpoint yet" in last and "continue with: gspo train --resume" in last

    done = subprocess.run([*args, "--resume"], env={**env, "GSPO_TEST_HOLD": ""}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "has no checkpoint yet: --resume trains it from the start" in done.stderr
    check_run_dir(run, 6)
