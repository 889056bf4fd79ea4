"""Optional metric sinks beside ``metrics.jsonl``: TensorBoard event files and a Weights & Biases run.

Both are off unless asked for (``log.tensorboard``, ``log.wandb``), and their packages are imported only then
(``pip install 'gspo[tensorboard]'`` / ``'gspo[wandb]'``). ``metrics.jsonl`` stays the source of truth: a sink that
fails during training is warned about once and dropped, and the run goes on.

Resume and rollback replay the steps after a checkpoint. TensorBoard hides its points past that step (``purge_step``);
W&B cannot overwrite a logged step, so the steps it already holds are not sent again.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

from gspo.errors import UserError

log = logging.getLogger("gspo")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line by name; ``step`` is the x-axis, not a series."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _not_importable(key: str, package: str, error: Exception) -> UserError:
    return UserError(f"{key} = true but importing {package} failed ({type(error).__name__}: {str(error)[:200]}); "
                     f"reinstall it with pip install 'gspo[{package}]', or set {key} = false.")


class TensorBoardSink:
    """One scalar per metric and optimizer step in ``<run_dir>/tensorboard/``, tagged with the metric names."""

    name = "TensorBoard"

    def __init__(self, run_dir: Path, step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _not_importable("log.tensorboard", "tensorboard", e) from e
        self._writer_cls = SummaryWriter
        self.log_dir = run_dir / "tensorboard"
        self._writer = None
        self.rewind(step)

    def rewind(self, step: int) -> None:
        """Continue after ``step``: the points past it, written by a session that died or was rolled back, are hidden."""
        if self._writer is not None:
            self._writer.close()
        # purge_step writes a restart marker: readers drop every earlier event at or after it.
        self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=step + 1 if step else None)

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=row["step"])

    def flush(self) -> None:
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run per run directory: its id is kept in ``wandb_id.txt``, so a resumed run continues the same W&B run."""

    name = "W&B"

    def __init__(self, run_dir: Path, config: dict[str, Any], step: int):
        try:
            import wandb
        except ImportError as e:
            raise _not_importable("log.wandb", "wandb", e) from e
        lc = config["log"]
        id_file = run_dir / "wandb_id.txt"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
            id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=lc["wandb_project"], entity=lc["wandb_entity"] or None, name=run_dir.name,
                                  id=run_id, resume="allow", config=config,
                                  dir=None if os.environ.get("WANDB_DIR") else str(run_dir))  # the user's WANDB_DIR wins
        except Exception as e:  # no API key, no network, a rejected entity: nothing is trained yet, so say it now
            raise UserError(f"log.wandb = true but wandb.init failed ({type(e).__name__}: {str(e)[:200]}); run "
                            "`wandb login`, set WANDB_MODE=offline to log without a network, or set log.wandb = false.") from e
        self.sent = step  # a resumed run does not send again the steps its earlier sessions sent
        self._told = False

    def rewind(self, step: int) -> None:
        self._told = False

    def log(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if step < self.run.step or step <= self.sent:  # W&B drops a step below its current one
            if not self._told:
                log.info("W&B already holds steps up to %d of this run: the replayed ones are not sent again "
                         "(metrics.jsonl and TensorBoard have them)", max(self.run.step, self.sent))
                self._told = True
            return
        self.run.log(scalars(row), step=step)
        self.sent = step

    def flush(self) -> None:
        pass  # W&B streams in the background

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MetricSinks:
    """The optional sinks of one ``train()`` call. A sink that raises is warned about once and dropped."""

    def __init__(self, sinks: list[Any] | None = None):
        self.sinks = list(sinks or [])

    def _each(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # a full disk, a network error: metrics.jsonl has every line anyway
                self.sinks.remove(sink)
                log.warning("%s sink failed (%s: %s); it is off for the rest of this run, metrics.jsonl is unaffected",
                            sink.name, type(e).__name__, str(e)[:200])
                if method != "close":
                    with contextlib.suppress(Exception):
                        sink.close(failed=True)

    def log(self, row: dict[str, Any]) -> None:
        self._each("log", row)

    def flush(self) -> None:
        self._each("flush")

    def rewind(self, step: int) -> None:
        """The run goes on after ``step`` (a rollback): points already written past it are stale."""
        self._each("rewind", step)

    def close(self, failed: bool = False) -> None:
        self._each("close", failed)
        self.sinks = []


def open_sinks(config: dict[str, Any], run_dir: Path, step: int) -> MetricSinks:
    """The sinks ``config["log"]`` asks for, continuing after optimizer step ``step``."""
    lc, sinks = config["log"], []
    try:
        if lc["tensorboard"]:
            sinks.append(TensorBoardSink(run_dir, step))
        if lc["wandb"]:
            sinks.append(WandbSink(run_dir, config, step))
    except BaseException:
        MetricSinks(sinks).close(failed=True)
        raise
    return MetricSinks(sinks)
