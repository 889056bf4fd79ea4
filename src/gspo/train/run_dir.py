"""The run directory as the trainer holds it: refused when it is a file or already holds a run (unless resumed), locked
for this process, ``config.json`` (the latest settings), ``config_history.jsonl`` (one line per session: what it
trained with, from which step, what it changed), ``timings.json``, and what ``--resume`` may change (see
:mod:`gspo.config.resume`). Only the main process of a job writes here.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from gspo.checkpoint import complete_checkpoints
from gspo.config import SOURCE_KEYS, Config, resume_changes, source_fingerprints
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.train.guards import lock_run_dir

log = logging.getLogger("gspo")


def _has_lines(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


class RunDir:
    """``path`` for a run of ``cfg``: :meth:`open` checks and locks it and writes config.json, :meth:`record` appends
    the session to config_history.jsonl, :meth:`release` unlocks it."""

    def __init__(self, path: str | Path, cfg: Config, is_main: bool):
        self.path = Path(path)
        self.cfg = cfg
        self.is_main = is_main
        self._lock = None
        self.changes: dict[str, list] = {}  # what this session changed against the run's config (--resume)

    def open(self, resume: bool) -> None:
        """Refuse a file or (without ``resume``) a directory that holds a run; on the main process create and lock it,
        check a resumed run's changed settings and write config.json."""
        path = self.path
        if path.exists() and not path.is_dir():
            raise UserError(f"The run directory {str(path)!r} is a file; choose another log.run_dir (or --run-dir).")
        # A directory without a checkpoint or a metrics line (a start that failed before its first step) has nothing to
        # lose or continue: a plain start takes it over.
        exists = path.exists() and (bool(complete_checkpoints(path / "checkpoints"))
                                    or _has_lines(path / "metrics.jsonl"))
        if exists and not resume:
            raise UserError(f"Run directory {str(path)!r} already exists; pass --resume to continue it, "
                            "or choose another log.run_dir.")
        if not self.is_main:
            return
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(path)
        except OSError as e:
            raise UserError(f"The run directory {str(path)!r} cannot be written ({e.strerror or e}); fix "
                            "its permissions or choose another log.run_dir.") from None
        try:
            self.changes = self._check_resumed_config() if resume and exists else {}
            (path / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        except OSError as e:
            self.release()
            raise UserError(f"Writing {str(path / 'config.json')!r} failed ({e.strerror or e}); free disk "
                            "space or fix the directory.") from None
        except BaseException:
            self.release()
            raise

    def _check_resumed_config(self) -> dict[str, list]:
        """What this session changes against the config the run was trained with; a change ``--resume`` may not make
        (see ``gspo.config.RESUMABLE``) is refused in one line, before anything is written."""
        path = self.path / "config.json"
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("%s cannot be read; the resumed run's settings are not checked against it", path)
            return {}
        changed, refused = resume_changes(old, self.cfg.to_dict(), self._recorded_sources())
        if refused:
            shown = "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused[:5])
            moved = " (a path may change only to a copy of the same file)" if set(refused) & set(SOURCE_KEYS) else ""
            raise UserError(f"--resume cannot change {', '.join(refused)} ({shown}){moved}: the run was trained with the "
                            f"old values; resume with them, or start a new run in another log.run_dir.")
        return changed

    def _recorded_sources(self) -> dict[str, str]:
        """The fingerprints of the model and data files the latest session of this run recorded (none for runs older
        than the record: then a moved file is refused like any other change)."""
        path = self.path / "config_history.jsonl"
        entries = read_jsonl(path) if path.exists() else []
        return entries[-1].get("sources", {}) if entries else {}

    def record(self, step: int) -> None:
        """Append what this session trains with, from optimizer step ``step``, to config_history.jsonl (config.json
        holds the latest): one line per session that started or resumed the run."""
        config = self.cfg.to_dict()
        entry = {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "changed": self.changes, "config": config, "sources": source_fingerprints(config)}
        try:
            with open(self.path / "config_history.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            raise UserError(f"Writing {str(self.path / 'config_history.jsonl')!r} failed ({e.strerror or e}); free "
                            "disk space or fix the directory.") from None
        if self.changes:
            log.info("resumed with changed settings: %s", ", ".join(f"{k} {v[0]!r} -> {v[1]!r}"
                                                                   for k, v in self.changes.items()))

    def write_timings(self, timings: dict[str, float]) -> None:
        """timings.json: where the run's seconds went (on the main process; a diagnostic, so a failure only warns)."""
        if not self.is_main:
            return
        try:
            (self.path / "timings.json").write_text(json.dumps(timings, indent=1))
        except OSError as e:  # the run itself is complete
            log.warning("timings.json could not be written (%s)", e.strerror or e)

    def release(self) -> None:
        """Let another process use the run directory (done at the end of ``train()``)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()
