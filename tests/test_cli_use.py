"""What a user sees from the `gspo` command: their own files and commands working, and output they can read and
trust."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

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
    shown = _gspo(summary, tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["steps"] == 2, shown.stderr[-3000:]
