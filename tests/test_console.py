"""The console a user watches: the progress line names the phase, keeps an estimate of the time left when steps are
slow, fits 80 columns, and log records print above it, never onto its line."""
from __future__ import annotations

import io
import logging
import re
import sys

from gspo.runlog.metrics import Console

ROW = {"reward/mean": 0.4375, "clip/token_total": 0.1234, "clip/seq_total": 0.25, "completion/len_mean": 123.4}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> _Terminal:
    """stderr as an 80-column terminal (set in the test itself: pytest puts its own capture back between a fixture's
    set-up and the test)."""
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setenv("COLUMNS", "80")
    return screen


def _lines(screen: _Terminal) -> list[str]:
    """What the terminal shows, line by line (carriage returns and cursor codes resolved to the text after them)."""
    text = ANSI.sub("", screen.getvalue())
    return [part.split("\r")[-1] for part in text.split("\n") if part.split("\r")[-1].strip()]


def test_the_line_names_the_phase_and_an_estimate_and_fits_80_columns(monkeypatch):
    """After a step of 60 s (rich's own estimate forgets steps older than 30 s), the bar shows the step count, the time
    left at the run's pace and the phase; each rollout batch's metrics line sits above it; nothing is over 80 wide."""
    import gspo.runlog.metrics as metrics

    terminal = _terminal(monkeypatch)
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "time", lambda: clock[0])
    console = Console(48, 0, minibatches=4)
    console.phase("rollout")
    console.phase("reward")
    console.phase("old_logprobs")
    console.phase("step")
    clock[0] += 60.0
    console.update(1, ROW, end_of_batch=False)
    assert console.eta(1) == "eta 47:00"  # 47 steps left at 60 s each
    console.phase("step")
    console._bar.refresh()
    assert "update 2/4" in _lines(terminal)[-1] and "1/48" in _lines(terminal)[-1]
    for k in range(2, 5):
        console.update(k, ROW, end_of_batch=k == 4)
    console._bar.refresh()
    console.close()
    shown = _lines(terminal)
    assert any(line.startswith("step 4/48 reward 0.438 clip tok 12.34% seq 25.0% len 123") for line in shown)
    assert all(len(line) <= 80 for line in shown), [line for line in shown if len(line) > 80]


def test_a_log_record_prints_above_the_bar(monkeypatch):
    """A warning logged while the bar is live arrives through the bar's console (which prints above it) and the
    handler writes to the terminal again once the bar is closed."""
    terminal = _terminal(monkeypatch)
    handler = logging.StreamHandler(sys.__stderr__)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        console = Console(8, 0)
        assert handler.stream is not sys.__stderr__  # rerouted while the bar is live
        logging.getLogger("gspo").warning("SIGINT: finishing rollout batch 3")
        console.close()
        assert handler.stream is sys.__stderr__
    finally:
        root.removeHandler(handler)
    assert any("SIGINT: finishing rollout batch 3" in line for line in _lines(terminal))


def test_the_plain_line_fits_80_columns_at_five_digit_step_counts(monkeypatch, capsys):
    """Without a terminal (CI, logs): one line per rollout batch, with elapsed time and estimate, within 80 columns."""
    console = Console(99_999, 0)
    console.update(12_345, ROW, end_of_batch=True)
    line = capsys.readouterr().err.strip()
    assert line.startswith("[gspo] 12345/99999 reward 0.438 clip tok 12.34% seq 25.0% len 123 eta")
    assert len(line) <= 80, (len(line), line)
