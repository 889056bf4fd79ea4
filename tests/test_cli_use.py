"""What a user sees from the `gspo` command: their own files and commands working, and output they can read and
trust."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo import cli
from gspo.cli import main
from gspo.commands.compare import train_in_process
from gspo.runlog.metrics import summarize

from test_trainer import tiny_dir  # noqa: F401  (the module fixture)

ROOT = Path(__file__).resolve().parents[1]


def _readme_example() -> tuple[dict[str, str], list[list[str]]]:
    """The files (name -> text) and the commands of the README's section "Your own data and reward"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Your own data and reward\n", 1)[1].split("\n## ", 1)[0]
    files = dict(re.findall(r"`(\w+\.(?:jsonl|py|toml))`[^\n]*:\n\n```\w*\n(.*?)```", section, re.S))
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ")
    return files, [shlex.split(line) for line in commands.splitlines() if line.strip()]


def _gspo(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``gspo ...`` as the installed command runs it: the current folder is not on its import path (``-P``), since
    the command's first import path is its own script's folder."""
    assert argv[0] == "gspo"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-P", "-m", "gspo.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_example_trains_with_the_reward_module_of_the_current_folder(tiny_dir, tmp_path):  # noqa: F811
    """The README's worked example, run in a folder of its own on a tiny model: `my_reward:score` is imported from
    that folder (by the trainer's process and the reward workers), scores every completion, and `gspo summary` prints
    the run's table."""
    files, (train, summary) = _readme_example()
    assert set(files) == {"problems.jsonl", "my_reward.py", "run.toml"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    done = _gspo([*train, f"model.name='{tiny_dir}'", "rewards.workers=1", "log.progress=false"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "my-task" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/failures"] == 0 and r["reward/score/mean"] is not None for r in rows)
    # a smoke test writes no checkpoint at its end (log.final_checkpoint = false), and says so
    assert not list((tmp_path / "runs" / "my-task").glob("checkpoints/step-*")), done.stdout
    assert "no checkpoint (log.final_checkpoint = false)" in done.stdout
    shown = _gspo(summary, tmp_path)
    assert shown.returncode == 0 and "reward, first batch" in shown.stdout, shown.stderr[-3000:]


def _fake_run(path: Path, rewards: list[float]) -> str:
    """A run directory whose metrics.jsonl has one single-minibatch rollout batch per reward."""
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "rollout_batch": i, "minibatch": 0, "reward/mean": r, "clip/token_total": 0.25,
             "clip/seq_total": 0.5, "entropy": 2.0 - i / 10, "completion/len_mean": 12.0, "time/elapsed": 3.0 * (i + 1)}
            for i, r in enumerate(rewards)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_summary_prints_a_table_within_80_columns_and_json_on_request(tmp_path, capsys):
    """`gspo summary` prints labelled rows with a column per run, split into tables that fit 80 columns; with --json
    it prints what summarize() returns, as JSON."""
    runs = [_fake_run(tmp_path / f"a-rather-long-run-name-seed{s}", [0.25, 0.5, 0.75]) for s in (1, 2, 3)]
    assert main(["summary", *runs]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert all(Path(r).name in out for r in runs) and out.count("reward, first batch") >= 2  # 3 runs: 2+ tables
    assert re.search(r"^reward, first batch +0\.250\b", out, re.M) and "clipped tokens, off-policy" in out
    assert main(["summary", runs[0], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == summarize(runs[0])


def test_summary_labels_say_what_a_short_run_was_averaged_over(tmp_path, capsys):
    """A 2-batch run's summary says 'last 2 batches' and 'first 2 batches', not 10 and 3 it does not have; beside a
    12-batch run the rows say 'or all, where fewer'."""
    short = _fake_run(tmp_path / "short", [0.375, 0.125])
    assert main(["summary", short]) == 0
    out = capsys.readouterr().out
    assert "reward, last 2 batches" in out and "reward, first 2 batches" in out and "last 10" not in out
    assert out.count("reward, last 2 batches") == 1 and "reward_" not in out  # last 3 and last 10: one row
    assert main(["summary", short, _fake_run(tmp_path / "long", [0.5] * 12)]) == 0
    assert "reward, last 10 batches (or all, where fewer)" in capsys.readouterr().out
    assert main(["summary", _fake_run(tmp_path / "one", [0.25])]) == 0  # one batch: no window rows, only its own
    out = capsys.readouterr().out
    assert "reward, first batch" in out and "reward, last" not in out and "reward_" not in out


def test_eval_prints_a_table_and_json_on_request_and_writes_out_as_before(tiny_dir, tmp_path, capsys):  # noqa: F811
    """`gspo eval` prints a table of its numbers; with --json the result as JSON; --out writes the JSON either way."""
    argv = ["eval", f"model.name='{tiny_dir}'", "model.device='cpu'", "rewards.workers=0", "rollout.max_new_tokens=4",
            "--n", "2", "--samples", "1", "--batch-size", "2"]
    assert main([*argv, "--out", str(tmp_path / "table.json")]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^greedy accuracy +\d\.\d{3}$", table, re.M) and "pass@1 over the samples" in table
    assert main([*argv, "--json", "--out", str(tmp_path / "json.json")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads((tmp_path / "json.json").read_text())
    assert json.loads((tmp_path / "table.json").read_text()).keys() == result.keys()


def test_a_reader_that_closes_the_pipe_ends_gspo_quietly():
    """`gspo config | head -1`: once the reader has closed the pipe, gspo exits 141 (128 + SIGPIPE, as the shell
    reports for other tools) with nothing on stderr, not a BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "gspo.cli", "config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before gspo writes anything: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err[-2000:]


def test_a_broken_pipe_of_gspos_own_is_still_an_error(tmp_path, monkeypatch):
    """A BrokenPipeError while stdout is still open (a reward worker's pipe broke) is raised, not taken for a reader
    that went away."""
    def broken(args):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(cli, "cmd_config", broken)
    with open(tmp_path / "stdout", "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        with pytest.raises(BrokenPipeError, match="a worker's pipe"):
            main(["config"])


def test_each_in_process_compare_arm_times_its_own_start_up(tiny_dir, tmp_path):  # noqa: F811
    """`gspo compare` without --jobs trains its arms one after another in one process: the second arm's timings.json
    counts from that arm's own start, so its whole run (process_s) fits in the time left after the first arm's
    training loop (it used to count from the command's start, the first arm's training included)."""
    overrides = [f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=4", "train.steps=2", "train.minibatches=2", "rewards.workers=0",
                 "log.progress=false", "log.checkpoint_every=0", "rewards.functions=[{path='trainer_rewards:text_length'}]"]
    todo = [([*overrides, f"algorithm='{algo}'"], tmp_path / algo, False) for algo in ("gspo", "grpo")]
    start = time.perf_counter()
    assert train_in_process(None, todo) == 0
    total = time.perf_counter() - start
    first, second = (json.loads((tmp_path / algo / "timings.json").read_text()) for algo in ("gspo", "grpo"))
    assert 0 < second["process_start_to_trainer"] <= second["process_s"] <= total - first["loop_s"], (first, second)
