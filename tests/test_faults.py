"""Faults the run directory must survive, injected for real: kills during a log rewind, a second process in the same
directory, lines torn by a full disk (a real, small tmpfs where this machine lets root mount one)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo.config import build_config
from gspo.errors import UserError
from gspo.runlog.metrics import JsonlWriter, read_jsonl
from gspo.train import Trainer

from test_trainer import tiny_config, tiny_dir  # noqa: F401  (the module fixture)

REWIND = """
import os, signal, sys
sys.path.insert(0, {src!r})
from pathlib import Path
from gspo.runlog.metrics import JsonlWriter
mode = {mode!r}
if mode == "fsync":  # die with the kept lines fully written to the temporary file, before the rename
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
elif mode == "replace":  # die right after the rename
    real = os.replace
    os.replace = lambda a, b: (real(a, b), os.kill(os.getpid(), signal.SIGKILL))
print("ready", flush=True)
JsonlWriter(Path({path!r}), keep=lambda row: row["step"] <= 15000).close()
print("done", flush=True)
"""


def _check_lines(path: Path) -> list[dict]:
    """Every line of ``path`` parses; returns the rows."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert all(isinstance(r, dict) for r in rows)
    return rows


def test_a_kill_during_the_rewind_on_resume_loses_no_line(tmp_path):
    """SIGKILL while the run log drops the lines past a checkpoint (what --resume and a rollback do): before the rename
    the file holds every old line, after it exactly the kept ones; at random moments, one or the other, never fewer,
    never a torn one. (Rewriting in place emptied a 30,000-line file in one try.)"""
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": i, "loss": 0.1 * i, "pad": "x" * 60}) + "\n" for i in range(1, 30001))

    def rewind(mode: str, delay: float | None = None) -> tuple[int, int]:
        path.write_text(original)
        proc = subprocess.Popen([sys.executable, "-c", REWIND.format(src=src, path=str(path), mode=mode)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        if delay is not None:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        out = proc.stdout.read()
        proc.wait(timeout=60)
        rows = _check_lines(path)
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        return len(rows), proc.returncode if "done" not in out else 0

    assert rewind("fsync") == (30000, -signal.SIGKILL)  # killed with the new copy complete but not yet renamed
    assert rewind("replace") == (15000, -signal.SIGKILL)  # killed right after the rename
    rng = random.Random(0)
    killed = 0
    for _ in range(6):
        lines, code = rewind("random", rng.uniform(0.0, 0.15))
        assert lines in (30000, 15000)
        killed += code == -signal.SIGKILL
    assert killed, "no random kill landed before the rewind finished; the delays are too long for this machine"


def test_a_second_process_in_the_run_directory_is_refused(tiny_dir, tmp_path):  # noqa: F811
    """While a trainer holds the run directory, another start there (a requeued job whose predecessor still runs)
    ends in one line naming the holder's pid; once the first has finished, --resume works."""
    run = tmp_path / "run"
    first = Trainer(tiny_config(tiny_dir), run)
    with pytest.raises(UserError, match=f"in use by another gspo process \\(pid {os.getpid()}\\)"):
        Trainer(tiny_config(tiny_dir), run, resume=True)
    first.train()
    Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True).train()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_second_gspo_process_is_refused(tiny_dir, tmp_path):  # noqa: F811
    """The same across processes: a real second `gspo train --resume` on a directory whose trainer is alive exits 2
    with the one-line message, and the first run's files are untouched."""
    run = tmp_path / "run"
    holder = Trainer(tiny_config(tiny_dir), run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        str(Path(__file__).resolve().parent)])}
    proc = subprocess.run([sys.executable, "-m", "gspo.cli", "train", "--resume", "--run-dir", str(run),
                           f"model.name='{tiny_dir}'", "model.device='cpu'", "rewards.workers=0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "is in use by another gspo process" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    holder.train()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


def test_a_torn_line_never_blocks_resume_summary_or_report(tiny_dir, tmp_path):  # noqa: F811
    """A last line torn by a full disk is skipped by every reader: --resume continues, `gspo summary` and `gspo report`
    work; a torn line in the middle makes resume start from a checkpoint the surviving lines cover, so no step is
    missing afterwards."""
    from gspo.cli import main

    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=4"), run).train()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.')  # the torn tail of a write that ran out of space
    assert main(["summary", str(run)]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    # A hole: step 3's line is torn in the middle of the file.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:25]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    t = Trainer(tiny_config(tiny_dir, "train.steps=6"), run, resume=True)
    assert t.state.step == 2  # step-000004 is past the hole; step-000002 is covered
    t.train()
    check_run_dir(run, 6)


def _tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` at ``path`` for the test (needs root and a kernel that lets this container mount;
    the test is skipped otherwise); unmounted afterwards."""
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()[:100]}): the full-disk tests need root")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs."""
    yield from _tmpfs(tmp_path / "disk", "256k")


def test_a_full_disk_while_logging_ends_in_one_line_and_keeps_whole_lines(small_disk):
    """On a real full file system a metrics line that does not fit ends in one error naming the file, the file keeps
    only whole lines, and after space is freed the same writer's file takes new lines and reads back whole."""
    path = small_disk / "metrics.jsonl"
    filler = small_disk / "filler"
    writer = JsonlWriter(path)
    writer.write({"step": 1, "loss": 0.5})
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last byte
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    with pytest.raises(UserError, match="metrics.jsonl.*failed.*No space left on device"):
        for step in range(2, 200):
            writer.write({"step": step, "loss": 0.5, "pad": "y" * 500})
    writer.close()
    rows = _check_lines(path)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    filler.unlink()
    writer = JsonlWriter(path)
    writer.write({"step": len(rows) + 1, "loss": 0.5})
    writer.close()
    assert [r["step"] for r in _check_lines(path)] == list(range(1, len(rows) + 2))


def test_sigterm_to_the_process_group_during_scoring_loses_no_reward(tiny_dir, tmp_path):  # noqa: F811
    """SIGTERM to the trainer and then to its whole process group (how `timeout`, Slurm and systemd stop a job) while
    reward workers are scoring: the trainer takes the two as one request, the fork
    server and the workers ignore it, the batch is scored in full (no NaN reward), trained, checkpointed, and
    `gspo train` exits 143; --resume then completes the run. (The fork server used to die, taking the workers with it:
    the batch was trained on NaN rewards without a word.)"""
    run, marker = tmp_path / "run", tmp_path / "scoring"
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "GSPO_TEST_MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    args = [sys.executable, "-m", "gspo.cli", "train", "--run-dir", str(run), f"model.name='{tiny_dir}'",
            "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "train.steps=4", "train.minibatches=2", "rewards.workers=2", "log.progress=false", "log.checkpoint_every=0",
            "rewards.functions=[{path='trainer_rewards:slow_length'}]"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the reward never ran"
    # as GNU `timeout` stops a command: SIGTERM to it, then to its whole process group (the trainer gets two; it
    # used to take the second as "stop now" and lose the checkpoint)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.1)  # delivered by then: two pending SIGTERMs would merge into one in the kernel
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-2000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/failures"] == 0 and r["reward/failed_frac"] == 0 for r in rows)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    marker.unlink()
    assert subprocess.run([*args, "--resume"], env=env, cwd=tmp_path, capture_output=True, timeout=300).returncode == 0
    check_run_dir(run, 4)


def test_resume_refuses_a_changed_objective_and_keeps_the_history(tiny_dir, tmp_path):  # noqa: F811
    """--resume with another algorithm, weight decay or Adam betas is refused in one line naming the keys, and
    config.json keeps the values the run was trained with; allowed changes (train.steps, train.lr) are taken, logged
    in config_history.jsonl with the step they start from."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir), run).train()
    for override, key in (("algorithm='grpo'", "algorithm"), ("train.weight_decay=0.1", "train.weight_decay"),
                          ("train.adam_betas=[0.8, 0.9]", "train.adam_betas")):
        with pytest.raises(UserError, match=f"--resume cannot change .*{key}"):
            Trainer(tiny_config(tiny_dir, "train.steps=4", override), run, resume=True)
        assert json.loads((run / "config.json").read_text())["algorithm"] == "gspo"
        assert json.loads((run / "config.json").read_text())["train"]["weight_decay"] == 0.0
    Trainer(tiny_config(tiny_dir, "train.steps=4", "train.lr=5e-4"), run, resume=True).train()
    history = read_jsonl(run / "config_history.jsonl")
    assert [h["step"] for h in history] == [0, 2]
    assert history[1]["changed"] == {"train.steps": [2, 4], "train.lr": [1e-3, 5e-4]}
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 5e-4


def test_a_failed_background_checkpoint_ends_the_run_at_once(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """A checkpoint written in the background that fails (a full disk) ends the run after the batch that follows, in
    one line naming the intact checkpoint, even with a sentinel that only warns: it is neither lost nor swallowed."""
    import errno

    import gspo.train.checkpoint

    real = gspo.train.checkpoint.save_checkpoint
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(gspo.train.checkpoint, "save_checkpoint", fail_second)
    # Checkpoints every 3 batches (steps 6, 12, 18): the one of step 12 fails; the next write would only come at
    # step 18, so the run must notice the failure by itself, after the batch in flight.
    t = Trainer(tiny_config(tiny_dir, "train.steps=20", "log.checkpoint_every=3"), tmp_path / "run")
    with pytest.raises(UserError, match="checkpoint of step 12 .*No space left on device.*step-000006, is intact"):
        t.train()
    assert t.state.step == 14  # stopped after the batch during which the write failed, not at step 18 or the end
    assert (tmp_path / "run" / "checkpoints" / "step-000006" / "COMPLETE").exists()


def test_an_empty_loss_mask_is_not_a_collapse(tiny_dir, tmp_path):  # noqa: F811
    """When overlong filtering leaves a minibatch without loss tokens its ratio statistics are null (not measurable),
    and the sequence-ratio detector does not take that for an exploding spread."""
    t = Trainer(tiny_config(tiny_dir, "loss.mask_truncated=true", "sentinel.seq_ratio_log_max=5.0",
                            "sentinel.action='stop'"), tmp_path / "run")
    t.train()  # a random tiny model never stops within 6 tokens: every completion is truncated, so filtered
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert t.state.step == 2 and t.collapse is None
    assert all(r["ratio/seq_max"] is None for r in rows)


def test_a_signal_during_the_final_checkpoint_lets_it_complete(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """A real SIGINT while the final checkpoint is being written is noted, not obeyed at once: the checkpoint
    completes (it used to be lost with the process), and a run that had finished ends as finished."""
    import threading

    import gspo.train.checkpoint

    real = gspo.train.checkpoint.save_checkpoint

    def slow(*args, **kwargs):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(gspo.train.checkpoint, "save_checkpoint", slow)
    t = Trainer(tiny_config(tiny_dir, "log.checkpoint_every=0"), tmp_path / "run")
    t.train()
    assert t.stop_signal is None  # the run had finished: the signal stopped nothing, and it is not reported as a stop
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "COMPLETE").exists()


def test_data_whose_every_prompt_is_too_long_fails_after_one_pass(tiny_dir, tmp_path):  # noqa: F811
    """Every prompt over data.max_prompt_tokens (skip mode): one line after one pass over the data, naming the limit
    and the shortest prompt seen, not hours of silent re-tokenising."""
    rows = [{"question": "word " * (200 + i), "answer": "1"} for i in range(30)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = Trainer(tiny_config(tiny_dir, "data.task='jsonl'", f"data.path='{tmp_path / 'long.jsonl'}'",
                            "data.prompt_field='question'", "data.answer_field='answer'", "data.max_prompt_tokens=64"),
                tmp_path / "run")
    start = time.monotonic()
    with pytest.raises(UserError, match="last 30 prompts in a row .* data.max_prompt_tokens = 64 .*shortest had"):
        t.train()
    assert time.monotonic() - start < 60


def test_a_reward_that_fails_on_every_call_stops_the_run(tiny_dir, tmp_path):  # noqa: F811
    """A reward function that raises on every completion is a bug, not bad luck: one line naming it and its first
    error, instead of a run that trains on nothing and says "done"."""
    t = Trainer(tiny_config(tiny_dir, "rewards.functions=[{path='reward_fixtures:always_fails'}]"), tmp_path / "run")
    with pytest.raises(UserError, match="'always_fails' failed on all 8 completions .*first error: .*KeyError"):
        t.train()


def test_file_system_inputs_end_in_one_line(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """A run directory that is a file or cannot be written, a model directory whose weights are truncated, and a model
    cache (GSPO_CACHE) that is a file: each one line naming the path."""
    import shutil

    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="run directory .*afile' is a file"):
        Trainer(tiny_config(tiny_dir), tmp_path / "afile")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="cannot be written"):
            Trainer(tiny_config(tiny_dir), locked / "run")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    with pytest.raises(UserError, match="broken"):
        Trainer(tiny_config(broken), tmp_path / "run")
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "afile"))
    from gspo.models import load_model

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UserError, match="model cache .*cannot be written.*GSPO_CACHE"):
        load_model(str(gguf))


def check_run_dir(run: Path, steps: int) -> list[dict]:
    """What every fault must leave: every JSONL line parses, metrics steps run 1..steps once each, and every complete
    checkpoint loads (weights and trainer state). Returns the metrics rows."""
    import torch

    from gspo.checkpoint import complete_checkpoints, load_model_weights, verify
    from gspo.models import load_model

    for name in ("metrics.jsonl", "samples.jsonl", "histograms.jsonl", "traces.jsonl", "config_history.jsonl"):
        if (run / name).exists():
            _check_lines(run / name)
    rows = _check_lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for ckpt in complete_checkpoints(run / "checkpoints"):
        assert verify(ckpt) is None, ckpt  # every file as written, those of several processes included
        model, _ = load_model(str(ckpt))
        load_model_weights(model, ckpt)
        assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == int(ckpt.name.split("-")[1])
    return rows


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


@pytest.mark.extended
def test_kills_at_random_moments_during_resume_leave_a_run_equal_to_an_uninterrupted_one(tiny_dir, tmp_path):  # noqa: F811
    """`gspo train --resume` SIGKILLed at random moments (while it loads, trains, checkpoints or rewinds its logs),
    three times, then resumed to the end: the run directory passes check_run_dir and its metrics equal those of a run
    that was never interrupted, key for key (time keys aside). The killed resumes are `gspo train` processes; the
    runs that are not killed (the uninterrupted one, the first two steps, the last resume) train in this process,
    which saves a process start each (most of the test's time) and checks in passing that a run in-process and one
    under the command line log the same metrics."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    overrides = [f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=2",
                 "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=16", "train.minibatches=2",
                 "train.lr=1e-3", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=1",
                 "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"]
    args = [sys.executable, "-m", "gspo.cli", "train", *overrides]

    def train(run: Path, *extra: str, resume: bool = False) -> None:
        Trainer(build_config({}, [*overrides, *extra], device="cpu"), run, resume=resume).train()

    train(tmp_path / "straight")
    expected = _comparable(check_run_dir(tmp_path / "straight", 16))
    chaos = tmp_path / "chaos"
    train(chaos, "train.steps=2")
    rng = random.Random(1)
    for _ in range(3):  # each resume is killed once it has trained past its checkpoint, at a random moment after
        done = len(read_jsonl(chaos / "metrics.jsonl"))
        proc = subprocess.Popen([*args, "--run-dir", str(chaos), "--resume"], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and len(read_jsonl(chaos / "metrics.jsonl")) <= done:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL, "the resumed run finished before it could be killed"
    train(chaos, resume=True)
    assert _comparable(check_run_dir(chaos, 16)) == expected


KILL_IN_PRUNE = """
import os, shutil, signal, sys
from pathlib import Path
import torch
from gspo import checkpoint
from gspo.models import load_model

torch.set_num_threads(1)  # this process forks one child per kill point
model, tokenizer = load_model(sys.argv[1])
out = Path(sys.argv[2])
checkpoint.save_checkpoint(out / "template", 1, model, tokenizer, {"step": 1}, keep=1)
seen = [0]


def counted(real, kill_at):
    def call(*args, **kwargs):
        seen[0] += 1
        if seen[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call


for kill_at in range(1, 100):
    root = out / f"kill-{kill_at}"
    shutil.copytree(out / "template", root)
    pid = os.fork()
    if pid == 0:  # from here on every rename, unlink and rmdir may be the last: checkpoint 2 renamed into place,
        # then checkpoint 1 deleted
        os.replace, os.rename, os.unlink, os.rmdir = (counted(f, kill_at) for f in (os.replace, os.rename, os.unlink,
                                                                                      os.rmdir))
        checkpoint.save_checkpoint(root, 2, model, tokenizer, {"step": 2}, keep=1)
        os._exit(0)
    status = os.waitpid(pid, 0)[1]
    if os.WIFEXITED(status):
        assert os.WEXITSTATUS(status) == 0
        print(kill_at)
        break
    assert os.WTERMSIG(status) == signal.SIGKILL
"""


def test_kills_at_every_file_operation_of_pruning_leave_only_loadable_checkpoints(tiny_dir, tmp_path):  # noqa: F811
    """Saving checkpoint 2 with keep=1 renames it into place, then deletes checkpoint 1. A process is SIGKILLed at
    each file operation of both in turn (seen in CI: a random kill mid-prune left step-N with its COMPLETE marker and
    without its weights). After each kill every checkpoint taken for complete loads, and the next save clears what
    the kill left."""
    from gspo.checkpoint import complete_checkpoints, load_model_weights, save_checkpoint
    from gspo.models import load_model

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    done = subprocess.run([sys.executable, "-c", KILL_IN_PRUNE, str(tiny_dir), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    operations = int(done.stdout.split()[-1]) - 1  # the first kill point past the last operation completed the save
    assert operations > 5, "pruning a checkpoint took fewer file operations than it has files"
    model, tokenizer = load_model(str(tiny_dir))
    for kill_at in range(1, operations + 1):
        root = tmp_path / f"kill-{kill_at}"
        found = complete_checkpoints(root)
        assert found, f"the kill at operation {kill_at} left no complete checkpoint"
        for ckpt in found:
            load_model_weights(load_model(str(ckpt))[0], ckpt)
        save_checkpoint(root, 3, model, tokenizer, {"step": 3}, keep=1)
        assert sorted(p.name for p in root.iterdir()) == ["step-000003"], kill_at


def test_a_rollback_abandons_the_checkpoints_after_its_target(tiny_dir, tmp_path):  # noqa: F811
    """After a sentinel rollback the checkpoints of the abandoned timeline are renamed out of the way: a later --resume
    cannot load one of them and mix two timelines in one run directory."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    run = tmp_path / "run"
    t = Trainer(tiny_config(tiny_dir, "train.steps=12", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining_later'}]"), run)
    with pytest.raises(UserError, match="no checkpoint older"):
        t.train()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert any(n.startswith("rolled-back-step-000004") for n in names), names
    resumed = Trainer(tiny_config(tiny_dir, "train.steps=12", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                                  "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining_later'}]"),
                      run, resume=True)
    # The replay collapsed again before writing a checkpoint: the newest one left is the rollback's target, step 2, not
    # the abandoned timeline's step 4 (whose metrics lines were replaced by the replay's).
    assert resumed.state.step == 2
    resumed.release()


def test_a_start_that_failed_before_its_first_step_leaves_nothing_in_the_way(tiny_dir, tmp_path):  # noqa: F811
    """A run that died in its first batch (here: every reward call failed) left only its config behind: the corrected
    command starts there without --resume, and is not told the run 'was trained with' the broken settings."""
    run = tmp_path / "run"
    with pytest.raises(UserError, match="failed on all"):
        Trainer(tiny_config(tiny_dir, "rewards.functions=[{path='reward_fixtures:always_fails'}]"), run).train()
    Trainer(tiny_config(tiny_dir), run).train()
    check_run_dir(run, 2)


def test_a_file_system_without_locks_warns_and_trains(tiny_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    """Where flock is not supported (Lustre without it, NFS without a lock daemon: ENOLCK) the run warns and goes on
    instead of calling the directory 'in use'."""
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="gspo"):
        Trainer(tiny_config(tiny_dir), tmp_path / "run").train()
    assert "cannot be locked on this file system" in caplog.text


def test_the_trainer_process_never_runs_a_reward_packages_code(tmp_path, monkeypatch):
    """With workers, a reward in a package whose __init__ is broken is found out by the workers (one line), not by
    importing the package in the trainer's own process."""
    from gspo.rewards import RewardRunner, RewardSpec
    from gspo.types import Example

    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("this is not python\n")
    (tmp_path / "brokenpkg" / "mod.py").write_text("def f(c, e):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    runner = RewardRunner([RewardSpec("brokenpkg.mod:f")], workers=1)
    assert "brokenpkg" not in sys.modules
    with pytest.raises(UserError, match="brokenpkg.mod:f"):
        runner.score(["x"], [Example("q", "1")])
    runner.close()


@pytest.fixture
def roomy_disk(tmp_path):
    """A 512 MiB tmpfs, room for a whole tiny run."""
    yield from _tmpfs(tmp_path / "roomy", "512m")


def test_the_disk_filling_up_mid_run(tiny_dir, roomy_disk):  # noqa: F811
    """A real file system fills up while training (another job's files): the run ends in one line naming what could
    not be written and the fix; once space is freed, --resume completes a run that passes check_run_dir and equals an
    uninterrupted one."""
    import threading

    run, filler = roomy_disk / "run", roomy_disk / "filler"
    extra = ("train.steps=12", "log.checkpoint_every=2", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]")
    t = Trainer(tiny_config(tiny_dir, *extra), run)

    def fill_when_training():
        while not (run / "metrics.jsonl").exists() or len(read_jsonl(run / "metrics.jsonl")) < 4:
            time.sleep(0.01)
        with open(filler, "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass

    watcher = threading.Thread(target=fill_when_training, daemon=True)
    watcher.start()
    with pytest.raises(UserError, match="No space left on device.*(Free disk space|free disk space)"):
        t.train()
    watcher.join(timeout=60)
    assert t.state.step < 12
    filler.unlink()
    Trainer(tiny_config(tiny_dir, *extra), run, resume=True).train()
    rows = check_run_dir(run, 12)
    Trainer(tiny_config(tiny_dir, *extra), roomy_disk / "straight").train()
    assert _comparable(rows) == _comparable(read_jsonl(roomy_disk / "straight" / "metrics.jsonl"))


def test_resume_accepts_a_moved_copy_of_the_data_and_model_but_not_another_file(tiny_dir, tmp_path):  # noqa: F811
    """A dataset or model moved to another path (scratch, local disk) resumes: its fingerprint equals the one recorded
    when the run started. A different file at the new path is refused in one line naming the key."""
    import shutil

    data, model = tmp_path / "data.jsonl", tmp_path / "model"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"})
                            + "\n" for i in range(1, 9)))
    shutil.copytree(tiny_dir, model)
    run = tmp_path / "run"
    Trainer(tiny_config(model, "data.task='gsm8k'", f"data.path='{data}'"), run).train()
    assert set(read_jsonl(run / "config_history.jsonl")[0]["sources"]) >= {"model.name", "data.path"}
    moved_data, moved_model = tmp_path / "scratch" / "d.jsonl", tmp_path / "local" / "m"
    moved_data.parent.mkdir()
    data.rename(moved_data)
    shutil.move(str(model), moved_model)
    Trainer(tiny_config(moved_model, "data.task='gsm8k'", f"data.path='{moved_data}'", "train.steps=4"), run,
            resume=True).train()
    assert read_jsonl(run / "config_history.jsonl")[-1]["changed"]["data.path"] == [str(data), str(moved_data)]
    other = tmp_path / "other.jsonl"
    other.write_text(moved_data.read_text().replace("1", "2"))
    with pytest.raises(UserError, match="--resume cannot change data.path .*copy of the same file"):
        Trainer(tiny_config(moved_model, "data.task='gsm8k'", f"data.path='{other}'", "train.steps=6"), run, resume=True)


KILL_IN_ROLLBACK = """
import os, signal, sys
from gspo.cli import main
from gspo.runlog import RunLog
from gspo.train.loop import Trainer
import transformers.models.llama.modeling_llama  # noqa: F401  (what every run loads: imported once, before the forks)

kill_at, seen, armed = [0], [0], [False]


def counted(real):
    def call(*args, **kwargs):
        if armed[0]:
            seen[0] += 1
            if seen[0] == kill_at[0]:
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"operation {seen[0]}: {real.__name__} {args[:1]}", file=sys.stderr, flush=True)
        return real(*args, **kwargs)
    return call


os.rename, os.replace, os.fsync = counted(os.rename), counted(os.replace), counted(os.fsync)
real_restore, real_rewind = Trainer.restore, RunLog.rewind


def restore(self, before_batch=None):  # a rollback begins: every rename, replace and fsync from here on may be the last
    armed[0] = before_batch is not None
    return real_restore(self, before_batch)


def rewind(self, step, rollout_batch):  # the rollback's last act; then one more kill point, right after it
    real_rewind(self, step, rollout_batch)
    counted(lambda: None)()
    armed[0] = False
    print("rollback complete", file=sys.stderr, flush=True)


Trainer.restore, RunLog.rewind = restore, rewind
# A line "KILL_AT RUN_DIR" on stdin: `gspo train ARGV --run-dir RUN_DIR` in a process forked from this one (the imports
# above, most of a process start, are paid once), killed at its KILL_AT-th operation; its stdout and stderr go to
# RUN_DIR.out; the line answered is how it ended (its exit code, or minus the signal that killed it).
while line := sys.stdin.readline():
    at, run = line.split(maxsplit=1)
    run = run.strip()
    pid = os.fork()
    if pid == 0:
        kill_at[0] = int(at)
        out = os.open(run + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.argv = ["gspo", *sys.argv[1:], "--run-dir", run]
        try:
            code = main(sys.argv[1:])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.mark.extended
def test_kills_at_every_file_operation_of_a_rollback_leave_a_resumable_run(tiny_dir, tmp_path):  # noqa: F811
    """A sentinel rollback renames the abandoned checkpoints and rewinds the log files. The run is SIGKILLed at each
    of the rollback's file operations in turn (every rename, replace and fsync after it begins, then right after it
    ends); after each kill, `--resume` trains to the end, and the run directory passes check_run_dir (every line
    parses, steps 1..N once each, every complete checkpoint loads). Each killed `gspo train` is a process of its own,
    forked from one that imported gspo, torch and transformers once (an import per kill point took most of the
    test's time)."""
    import select

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    overrides = [f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=2",
                 "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=8", "train.minibatches=2",
                 "train.lr=1e-3", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=1",
                 "log.histograms=false", "log.trace_every=0", "sentinel.action='rollback'", "sentinel.reward_drop=0.05",
                 "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:collapses_in_third_batch'}]"]
    forks = subprocess.Popen([sys.executable, "-c", KILL_IN_ROLLBACK, "train", *overrides], cwd=tmp_path,
                             env={**env, "GSPO_TEST_COLLAPSE": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)

    def run_killed_at(kill_at: int, run: Path) -> tuple[int, str]:
        """How `gspo train` killed at its ``kill_at``-th operation ended (minus the signal), and its stderr."""
        forks.stdin.write(f"{kill_at} {run}\n")
        forks.stdin.flush()
        assert select.select([forks.stdout], [], [], 300)[0], "a run killed at a file operation never ended"
        code = forks.stdout.readline()
        assert code, f"the process that forks the runs died (exit {forks.wait()})"
        return int(code), Path(f"{run}.out").read_text()

    try:
        code, err = run_killed_at(10**6, tmp_path / "whole")  # the rollback's file operations, in order
        assert code == 0 and "rollback complete" in err, err[-2000:]
        check_run_dir(tmp_path / "whole", 8)
        ops = [line for line in err.splitlines() if line.startswith("operation ")]
        # Every operation on the checkpoints and on metrics.jsonl (the directory's fsync after its rename included),
        # and the last one, right after the rollback. The other logs go through the same JsonlWriter; each kill point
        # costs a run up to the rollback.
        last_metrics = max(i for i, line in enumerate(ops, 1) if "metrics.jsonl" in line) + 1
        points = [*range(1, last_metrics + 1), len(ops)]
        for kill_at in points:
            run = tmp_path / f"kill-{kill_at}"
            code, err = run_killed_at(kill_at, run)
            assert code == -signal.SIGKILL, err[-2000:]
            # The resume runs in this process (no collapse is asked for here).
            Trainer(build_config({}, overrides, device="cpu"), run, resume=True).train()
            check_run_dir(run, 8)
            assert not any(p.name.endswith(".tmp") for p in (run / "checkpoints").iterdir())
    finally:
        forks.stdin.close()  # it exits once the run in progress, if any, has ended
        try:
            forks.wait(timeout=300)
        finally:
            forks.kill()
    # a rename per abandoned checkpoint, an fsync and a replace per log file and the directory's fsync, the end
    assert any("rename" in op and "step-" in op for op in ops) and any("metrics.jsonl" in op for op in ops), ops


NATIVE_CALL = """
import logging, sys
sys.path.insert(0, {src!r})
import torch
from gspo.train.guards import StopSignals
logging.basicConfig(level=logging.INFO, format="[gspo] %(message)s", stream=sys.stderr)
a = torch.randn(8192, 8192)
with StopSignals(grace_s=1.0, kept=lambda: "keeps its last checkpoint, step-000002") as stop:
    print("ready", flush=True)
    torch.mm(a, a)  # one native call of many seconds on a CPU: no bytecode of the main thread runs meanwhile
    print("native call returned", flush=True)
print("guard exited", stop.received, flush=True)
"""


def _start_native_call(tmp_path: Path) -> subprocess.Popen:
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.Popen([sys.executable, "-c", NATIVE_CALL.format(src=src)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # into the matmul
    return proc


def test_the_first_ctrl_c_is_acknowledged_while_a_native_call_runs(tmp_path):
    """A first SIGINT is acknowledged on stderr before a long native call (a backward pass, a matmul) returns, not after
    it (Python's own handler waits for the main thread's next bytecode); the call is not interrupted."""
    proc = _start_native_call(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        ack = proc.stderr.readline()
        assert "SIGINT: finishing" in ack and "Ctrl-C again to stop now" in ack
        assert proc.poll() is None  # still in the native call: the first signal stops nothing
    finally:
        proc.kill()
        out = proc.communicate()[0]
    assert "native call returned" not in out  # the acknowledgement came while the call ran


def test_a_second_ctrl_c_ends_a_process_stuck_in_a_native_call(tmp_path):
    """After a second SIGINT, a process whose main thread stays inside one native call ends within the grace period
    (exit 130) with the reason on stderr, instead of waiting for the call to return."""
    proc = _start_native_call(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        assert "SIGINT: finishing" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    # what the run directory keeps is said once, here, since the command's own last line never comes
    assert "stopping now, without writing a checkpoint" in err
    assert "did not return within 1 s; exiting: the run directory keeps its last checkpoint, step-000002" in err
    assert err.count("keeps its last checkpoint") == 1
    assert "native call returned" not in out


def test_a_second_ctrl_c_between_native_calls_raises_keyboard_interrupt():
    """Where the main thread runs Python, the second signal is a KeyboardInterrupt there (the loop's cleanup runs);
    the first only sets ``received``."""
    from gspo.train.guards import StopSignals

    # What was there before (a command started in the background by a shell inherits SIGINT ignored, and so does
    # every process it starts, pytest's workers included)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(grace_s=60) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # the watcher thread acknowledges it; the main thread keeps running bytecode
                if stop.received:
                    break
                time.sleep(0.01)
            assert stop.received == "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before  # the guard put the handlers back


def test_the_signal_watcher_is_gone_when_the_guard_is():
    """Leaving the guard ends its watcher thread: one still running at interpreter exit was ended by pthread_exit,
    which aborted about one `gspo train` in three (exit 134, 'terminate called without an active exception')."""
    import threading

    from gspo.train.guards import StopSignals

    with StopSignals():
        assert any(t.name == "gspo-signals" for t in threading.enumerate())
    assert not any(t.name == "gspo-signals" for t in threading.enumerate())
