"""The optional TensorBoard and W&B sinks: same numbers as metrics.jsonl, resume and rollback, missing extras, failures."""
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from gspo.config import build_config
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.runlog.sinks import TensorBoardSink
from gspo.train import Trainer

from test_trainer import tiny_config  # noqa: F401  (the tiny model fixture lives there too)
from test_trainer import tiny_dir  # noqa: F401


def tb_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one tag as TensorBoard reads the run's event files (restart markers applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def jsonl_series(run: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_jsonl(run / "metrics.jsonl")]


def test_tensorboard_scalars_match_metrics_jsonl(tiny_dir, tmp_path):
    """Every step's reward/mean, clipping and lr in the event files equal metrics.jsonl's (to float32)."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=4", "log.tensorboard=true"), run).train()
    for key in ("reward/mean", "clip/token_total", "lr"):
        expected = jsonl_series(run, key)
        assert [s for s, _ in expected] == [1, 2, 3, 4]
        assert tb_scalars(run, key) == [(s, pytest.approx(v, rel=1e-6)) for s, v in expected]


def test_tensorboard_hides_points_after_the_resumed_checkpoint(tiny_dir, tmp_path):
    """A run that died after step 4 with step 2's checkpoint: on resume, steps 3-4 disappear from TensorBoard as they
    do from metrics.jsonl, even before the resumed session writes anything."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=4", "log.tensorboard=true"), run).train()
    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    Trainer(tiny_config(tiny_dir, "train.steps=2", "log.tensorboard=true"), run, resume=True).train()
    assert [s for s, _ in jsonl_series(run, "reward/mean")] == [1, 2]
    assert [s for s, _ in tb_scalars(run, "reward/mean")] == [1, 2]


@pytest.mark.slow
def test_tensorboard_follows_a_sentinel_rollback(tiny_dir, tmp_path):
    """After a rollback the event files show the replayed steps (lower lr, collapsed reward), not the rolled-back ones."""
    pytest.importorskip("tensorboard")
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    run = tmp_path / "run"
    t = Trainer(tiny_config(tiny_dir, "train.steps=12", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining_later'}]",
                            "log.tensorboard=true"), run)
    with pytest.raises(UserError, match="no checkpoint older"):
        t.train()
    for key in ("lr", "reward/mean"):
        expected = jsonl_series(run, key)
        assert [s for s, _ in expected] == [1, 2, 3, 4]
        assert tb_scalars(run, key) == [(s, pytest.approx(v, rel=1e-6)) for s, v in expected]
    assert [v for _, v in jsonl_series(run, "lr")] == [1e-3, 1e-3, 5e-4, 5e-4]


@pytest.mark.parametrize("key,package", [("log.tensorboard", "tensorboard"), ("log.wandb", "wandb")])
def test_sink_asked_for_but_not_installed_is_a_user_error(key, package, monkeypatch):
    """A sink whose package is missing is refused when the config is built, naming the field and the pip extra."""
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails, and find_spec finds nothing
    with pytest.raises(UserError, match=rf"{key} = true but the {package} package is not installed; "
                                        rf"pip install 'gspo\[{package}\]', or set {key} = false"):
        build_config({}, [f"{key}=true"])
    assert not build_config({}).log.tensorboard and not build_config({}).log.wandb  # off by default


def test_broken_tensorboard_install_stops_before_training(tiny_dir, tmp_path, monkeypatch):
    """A tensorboard that is found but fails to import stops train() before any step, with the reinstall hint."""
    pytest.importorskip("tensorboard")
    t = Trainer(tiny_config(tiny_dir, "log.tensorboard=true"), tmp_path / "run")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match=r"importing tensorboard failed .*pip install 'gspo\[tensorboard\]'"):
        t.train()
    assert t.state.step == 0 and read_jsonl(tmp_path / "run" / "metrics.jsonl") == []


def test_failing_sink_warns_once_and_the_run_completes(tiny_dir, tmp_path, monkeypatch, caplog):
    """A sink that raises mid-run is warned about once and dropped; training and metrics.jsonl go on untouched."""
    pytest.importorskip("tensorboard")
    calls = []

    def full_disk(self, row):
        calls.append(row["step"])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardSink, "log", full_disk)
    t = Trainer(tiny_config(tiny_dir, "train.steps=4", "log.tensorboard=true"), tmp_path / "run")
    with caplog.at_level("WARNING", logger="gspo"):
        t.train()
    assert t.state.step == 4 and calls == [1]
    assert caplog.text.count("TensorBoard sink failed (OSError") == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------- W&B, offline


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every file it writes under tmp_path (no network, no login, no ~/.config)."""
    pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)  # unset: the runs go into the run directory


def read_wandb_run(path: Path, wait_s: float = 60.0) -> tuple[dict, list[dict]]:
    """The config and history rows of an offline ``run-<id>.wandb`` file, once W&B's service process has written its
    exit record: ``run.finish()`` can return before that process has written the last records (seen on a loaded
    2-core machine: no history yet when the test read the file, all of it a moment later)."""
    deadline = time.monotonic() + wait_s
    while True:
        config, rows, closed = _parse_wandb_file(path)
        if closed or time.monotonic() > deadline:
            assert closed, f"{path} has no exit record after {wait_s} s"
            return config, rows
        time.sleep(0.2)


def _parse_wandb_file(path: Path) -> tuple[dict, list[dict], bool]:
    """W&B's framing of LevelDB's log format: a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte
    header (crc32, length, type). Returns the config, the history rows and whether the exit record is there."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, closed = path.read_bytes(), False
    assert data[:4] == b":W&B", "not a W&B data file (has the format changed?)"
    block, pos, parts, config, rows = 32768, 7, [], {}, []
    while True:
        if block - pos % block < 7:  # too little room left for a header: the block is padded
            pos += block - pos % block
            continue
        if pos + 7 > len(data) or data[pos + 6] == 0:
            break
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST part of a split one
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            which = record.WhichOneof("record_type")
            if which in ("run", "config"):
                items = record.run.config.update if which == "run" else record.config.update
                config.update({i.key: json.loads(i.value_json) for i in items})
            elif which == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
            closed |= which == "exit"
    return config, rows, closed


def test_wandb_offline_run_logs_the_metrics_and_resumes_the_same_run(tiny_dir, tmp_path, wandb_offline):
    """Offline: the run's history equals metrics.jsonl step by step, its config is the run's, and --resume continues
    the W&B run of the same id."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=2", "log.wandb=true", "log.wandb_project='gspo-test'"), run).train()
    run_id = (run / "wandb_id.txt").read_text().strip()
    Trainer(tiny_config(tiny_dir, "train.steps=4", "log.wandb=true", "log.wandb_project='gspo-test'"), run,
            resume=True).train()
    assert (run / "wandb_id.txt").read_text().strip() == run_id
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # one per session, both of the same W&B run
    sessions = [read_wandb_run(f) for f in files]
    config, history = sessions[0][0], [row for _, rows in sessions for row in rows]
    assert config["algorithm"] == "gspo" and config["log"]["wandb_project"] == "gspo-test"
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    for key in ("reward/mean", "loss", "clip/seq_total"):
        assert [(row["_step"], row[key]) for row in history] == jsonl_series(run, key)


def test_wandb_does_not_resend_steps_replayed_by_a_rollback(tiny_dir, tmp_path, wandb_offline, caplog):
    """W&B cannot overwrite a logged step: after a rollback the replayed steps are not sent (once said in the log),
    so the W&B history stays one point per step."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    run = tmp_path / "run"
    t = Trainer(tiny_config(tiny_dir, "train.steps=12", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining_later'}]",
                            "log.wandb=true"), run)
    with caplog.at_level("INFO", logger="gspo"), pytest.raises(UserError, match="no checkpoint older"):
        t.train()
    assert caplog.text.count("W&B already holds steps up to 6") == 1
    (file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_wandb_run(file)[1]
    assert [row["_step"] for row in history] == [1, 2, 3, 4, 5, 6]
    assert [(row["_step"], row["lr"]) for row in history[:2]] == jsonl_series(run, "lr")[:2]
