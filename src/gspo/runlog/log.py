"""The run log of one ``train()`` call: everything a run writes beside its checkpoints, in one object.

- ``metrics.jsonl``: one line per optimizer step (the source of truth; names documented in the README);
- ``samples.jsonl``: a few completions per rollout batch;
- ``histograms.jsonl`` and ``traces.jsonl``: the ratio diagnostics ``gspo report`` draws;
- the optional TensorBoard / W&B sinks and the console progress line.

Only the main process of a job writes. On resume and rollback the lines written after the checkpoint by the run that
died (or was rolled back) are dropped, since those steps are replayed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gspo.runlog.diagnostics import LOG_RATIO_EDGES, pick_trace_rows, ratio_histograms, token_trace
from gspo.runlog.metrics import Console, JsonlWriter
from gspo.runlog.profiler import watch_stages
from gspo.runlog.sinks import MetricSinks, open_sinks
from gspo.types import Batch


class RunLog:
    """The files and sinks of one ``train()`` call, continuing after optimizer step ``step`` / rollout batch
    ``rollout_batch`` (0, 0 for a new run)."""

    def __init__(self, run_dir: Path, cfg, *, step: int, rollout_batch: int, enabled: bool = True):
        self.run_dir = run_dir
        self.cfg = cfg
        self.enabled = enabled
        self.sinks = MetricSinks()
        self.console = Console(cfg.train.steps, step, enabled=enabled and cfg.log.progress,
                               minibatches=cfg.train.minibatches)
        watch_stages(self.console.phase)
        self._files: dict[str, JsonlWriter] = {}
        self._closed = False
        if enabled:
            self._open_files(step, rollout_batch)
            self.sinks = open_sinks(cfg.to_dict(), run_dir, step)

    def _open_files(self, step: int, rollout_batch: int) -> None:
        by_step = lambda row: isinstance(row.get("step"), int) and row["step"] <= step  # noqa: E731
        by_batch = lambda row: isinstance(row.get("rollout_batch"), int) and row["rollout_batch"] < rollout_batch  # noqa: E731
        keeps = {"metrics": by_step, "samples": by_batch,
                 "histograms": by_step, "traces": by_step}
        self._files = {}
        try:
            for name, keep in keeps.items():
                self._files[name] = JsonlWriter(self.run_dir / f"{name}.jsonl", keep=keep)
        except BaseException:
            self._close_files()  # the ones already open
            raise

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    # ------------------------------------------------------------------------------------------ writing

    def step(self, row: dict[str, Any], end_of_batch: bool) -> None:
        """One optimizer step's metrics line (floats: already reduced)."""
        if not self.enabled:
            return
        self._files["metrics"].write(row)
        self.sinks.log(row)
        self.console.update(row["step"], row, end_of_batch=end_of_batch)

    def samples(self, batch: Batch, step: int, rollout_batch: int, tokenizer=None) -> None:
        """One completion per prompt of the first ``log.samples_per_batch`` prompts; a multi-turn row also as its
        ``turns``: the completion cut where the tokens switch between sampled (``trained``) and appended (tool
        results, observations, template), each piece decoded with its special tokens."""
        if not self.enabled:
            return
        G = self.cfg.rollout.group_size
        for i in list(range(0, len(batch.examples), G))[: self.cfg.log.samples_per_batch]:
            ex = batch.examples[i]
            self._files["samples"].write({
                "step": step, "rollout_batch": rollout_batch, "prompt": ex.prompt, "answer": ex.answer,
                "completion": batch.rollout.texts[i], "reward": float(batch.rewards[i]),
                "advantage": _row_advantage(batch, i), "finish_reason": batch.rollout.finish_reasons[i],
                "length": int(batch.rollout.lengths[i]),
                **({"turns": turn_pieces(tokenizer, batch.rollout, i)}
                   if batch.rollout.sampled_mask is not None and tokenizer is not None else {}),
                **({"versions": _version_runs(batch.rollout.versions[i], batch.rollout.completion_mask[i])}
                   if batch.rollout.versions is not None else {})})

    def diagnostics(self, tokenizer, batch: Batch, rows: torch.Tensor, logp: torch.Tensor, *, step: int,
                    rollout_batch: int, minibatch: int) -> None:
        """Ratio histograms of optimizer step ``step`` (1-based) and, every ``log.trace_every`` rollout batches on the
        last minibatch, per-token traces of a few responses."""
        if not self.enabled:
            return
        lc = self.cfg.log
        rows_dev = rows.to(logp.device)  # after the step's reduce: the device has nothing queued to wait for
        old, mask = batch.old_logprobs[rows_dev], batch.loss_mask[rows].to(logp.device)
        where = {"step": step, "rollout_batch": rollout_batch, "minibatch": minibatch}
        if lc.histograms:
            self._files["histograms"].write({**where, "edges": LOG_RATIO_EDGES, **ratio_histograms(logp, old, mask)})
        if lc.trace_every and rollout_batch % lc.trace_every == 0 and minibatch == self.cfg.train.minibatches - 1:
            for i in pick_trace_rows(logp, old, mask, lc.trace_samples):
                row = int(rows[i])
                self._files["traces"].write({**where, "row": row, **token_trace(
                    tokenizer, batch.rollout.completion_ids[row], logp[i].cpu(), old[i].cpu(), mask[i].cpu(),
                    _row_advantage(batch, row))})

    def flush(self) -> None:
        self.sinks.flush()

    # ------------------------------------------------------------------------------------------ lifecycle

    def rewind(self, step: int, rollout_batch: int) -> None:
        """Continue after an earlier checkpoint (a rollback): drop the lines written after it."""
        if not self.enabled:
            return
        self._close_files()
        self._open_files(step, rollout_batch)
        self.sinks.rewind(step)

    def close(self, failed: bool = False) -> None:
        """Close the files, sinks and console (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        watch_stages(None)
        self.console.close()
        self._close_files()
        self.sinks.close(failed=failed)


def turn_pieces(tokenizer, rollout, i: int) -> list[dict]:
    """Row ``i``'s completion as runs of sampled and appended tokens: ``[{"trained": bool, "text": str}, ...]``."""
    n = int(rollout.lengths[i])
    ids, sampled = rollout.completion_ids[i][:n].tolist(), rollout.sampled[i][:n].tolist()
    pieces, start = [], 0
    for t in range(1, n + 1):
        if t == n or sampled[t] != sampled[start]:
            pieces.append({"trained": bool(sampled[start]), "text": tokenizer.decode(ids[start:t])})
            start = t
    return pieces


def _row_advantage(batch: Batch, i: int) -> float:
    """Row ``i``'s advantage; with per-token advantages (``loss.step_credit``), their mean over its completion."""
    adv = batch.advantages[i]
    if adv.dim() == 0:
        return float(adv)
    mask = batch.rollout.sampled[i]
    return float(adv[mask].mean()) if mask.any() else 0.0


def _version_runs(versions: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """A completion's per-token policy versions (in-flight updates) as ``[version, tokens]`` runs, in order."""
    runs: list[list[int]] = []
    for v in versions[mask].tolist():
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs
