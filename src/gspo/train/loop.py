"""The training loop, and nothing else: it sequences the stages that live in their own modules.

One rollout batch per iteration:
  1. the engine gets the policy's current weights (``sync_weights``)
  2. collect: P prompts x G completions, rewards in isolated workers (failures -> NaN -> left out of the group
     baseline), [DAPO] refill of zero-variance groups and the soft overlong punishment, group-relative advantages
  3. the actor's old-policy log-probs: recomputed (default; minibatch 0 takes its own update forward's, so its ratio is
     exactly 1) or the engine's own (``old_logprobs = "rollout"``)
  4. ``minibatches`` optimizer steps over a seeded shuffle of the batch; only the first is on-policy; each step's
     metrics stay tensors until one reduce, then one metrics line
  5. the collapse sentinel, then a checkpoint every ``log.checkpoint_every`` batches
Steps 1-2 are the feed's (:mod:`gspo.feed`): in line with the update, or, with ``rollout.max_staleness`` > 0, ahead of
it (in a background thread, in turn, or in decode processes) for a policy that many batches older.
Differences from the GSPO paper's setup: none in the objective; rewards that fail are excluded rather than scored 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gspo.checkpoint import complete_checkpoints, what_is_kept
from gspo.config import Config
from gspo.errors import STOPPED_FILE, RunStopped, UserError
from gspo.feed import RemoteCollector, make_feed
from gspo.runlog.metrics import read_jsonl, replace_atomically
from gspo.parallel import comm, roles
from gspo.runlog.profiler import BatchProfiler, stage
from gspo.rollout import rounded_weights
from gspo.runlog import RunLog
from gspo.runtime import Runtime, bytecode_warning, finite, seconds_since
from gspo.train.checkpoint import Checkpoints, TrainState, checkpoint_batch
from gspo.train.guards import NonFiniteSteps, StopSignals, dist_failures, out_of_memory
from gspo.train.parts import build, describe_run
from gspo.train.run_dir import RunDir
from gspo.train.sentinel import collapse_findings, response, stop_reason
from gspo.types import Batch

log = logging.getLogger("gspo")

# How a metric is combined over the processes of a job where they differ (the rest are means): memory is the busiest
# GPU's, the time to the gradient the slowest and the fastest process's. (Rollout counters are already the job's:
# Collector.gather sums the tokens and takes the slowest time.)
REDUCE = {"memory/peak_gib": "max", "dist/compute_max_s": "max", "dist/compute_min_s": "min"}


class Trainer:
    """Runs one configured training job in ``run_dir``; ``train()`` does the work."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False, runtime: Runtime | None = None,
                 started: float | None = None):
        """``started``: the ``time.perf_counter()`` reading when this run began, for a run that is not the first of its
        process (``gspo compare`` trains its arms one after another in one); timings.json counts from it. Default: the
        process's start, imports included."""
        self.started = started
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # rollout.decode_processes: this process is one of the trainers, the job's first processes
        self.runtime, self.roles = roles.join(cfg, runtime)
        if self.roles is not None:
            if self.roles.decoding:
                raise UserError(f"Process {self.roles.rank} is a decode process (rollout.decode_processes): start the "
                                "job with gspo train (or torchrun -m gspo.cli train), which runs those.")
            self.runtime = dataclasses.replace(self.runtime, world_size=self.roles.trainers)
        self.timings: dict[str, float] = {"process_start_to_trainer": self.since_start()}
        # A run stopped before its first checkpoint (Ctrl-C or a kill in its first batches) resumes from its start, the
        # one state there is to go back to; its seed replays the metrics lines it had written. (The history is written
        # once a session has started, so every process of a job sees the same answer here.)
        from_start = resume and (self.run_dir / "config_history.jsonl").is_file() and not complete_checkpoints(
            self.run_dir / "checkpoints")
        self.dir = RunDir(self.run_dir, cfg, self.runtime.is_main)
        self.dir.open(resume)
        if self.runtime.is_main:  # before the model loads (seconds to minutes): what this run is, at once
            log.info("%s", describe_run(cfg, self.runtime, self.run_dir, resume))
            if (slow := bytecode_warning()) is not None:
                log.warning("%s", slow)
        try:
            parts = build(cfg, self.runtime, self.timings, sampling=self.roles is None)
            self.actor, self.tokenizer, self.engine = parts.actor, parts.tokenizer, parts.engine
            self.collector, self.rewards = parts.collector, parts.rewards
            if self.roles is not None:  # the decode processes collect; a checkpoint keeps their state
                self.collector = RemoteCollector(self.roles.decoders, cfg.seed, self.runtime.device)
            self.state = TrainState()
            self.feed = make_feed(cfg.rollout, collector=self.collector, engine=self.engine,
                                  weights=self.engine_weights, device=self.runtime.device, roles=self.roles)
            self.checkpoints = Checkpoints(self.run_dir, cfg, self.runtime, self.actor, self.collector, self.feed,
                                           self.tokenizer)
            self.profiler = BatchProfiler(cfg.log.profile_batch, self.run_dir, self.runtime.rank, self.runtime.device)
            self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps)
            self.stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when train() stopped early on one
            self.collapse: str | None = None  # what the collapse sentinel saw last, if it triggered
            self.rewards_seen: dict[int, float | None] = {}  # rollout batch -> reward/mean, for the sentinel
            if from_start:
                log.warning("%s has no checkpoint yet: --resume trains it from the start", self.run_dir)
            elif resume:
                self.restore()
            self.reset_feed()
            if self.runtime.is_main:
                self.dir.record(self.state.step)
                (self.run_dir / STOPPED_FILE).unlink(missing_ok=True)  # a stopped run resumed goes on: no longer one
            self.timings["trainer_ready_at"] = self.since_start()
        except BaseException:
            if hasattr(self, "collector"):
                self.collector.close()
            self.release()  # a start that failed leaves the directory to the next one
            raise

    def since_start(self) -> float:
        """Seconds since this run started (see ``started``), as timings.json records them."""
        return round(seconds_since(self.started), 3)

    # ------------------------------------------------------------------------------------------ the loop

    def train(self) -> Path:
        """Run until ``train.steps`` optimizer steps (or a stop signal); returns the run directory."""
        cfg, state = self.cfg, self.state
        self.t_start = time.time() - state.elapsed
        t_train = time.perf_counter()
        start_step = state.step
        runlog = None
        failed = True
        try:
            # the final checkpoint is in the signal guard too: a first signal during its write is noted; it completes
            with StopSignals(lambda: f"rollout batch {self.state.rollout_batch}",
                             kept=lambda: what_is_kept(self.run_dir)) as stop, dist_failures(self):
                runlog = RunLog(self.run_dir, cfg, step=state.step, rollout_batch=state.rollout_batch,
                                enabled=self.runtime.is_main)
                # Under torchrun the processes stop together, at the first rollout-batch boundary after any of them
                # got a signal (one that went on alone would wait in a collective for the others).
                stopping = comm.any_rank(stop.received is not None)
                while state.step < cfg.train.steps and not stopping:
                    with self.profiler.around(state.rollout_batch):
                        self.rollout_batch_once(runlog)
                    self.checkpoints.writer.poll()  # a background checkpoint that failed ends the run now, in one line
                    stopping = comm.any_rank(stop.received is not None)
                    if self.check_collapse(self.last_rows):  # rolled back to an earlier checkpoint: replay from there
                        runlog.rewind(state.step, state.rollout_batch)
                        continue
                    every = cfg.log.checkpoint_every
                    if every and state.rollout_batch % every == 0 and state.step < cfg.train.steps and not stopping:
                        self.checkpoint()
                t_loop_end = time.perf_counter()
                self.timings["loop_s"] = round(t_loop_end - t_train, 3)
                # (a run a signal stopped writes its checkpoint whatever log.final_checkpoint says: it is to resume)
                wanted = cfg.log.final_checkpoint or stopping or state.step < cfg.train.steps
                written = (self.run_dir / "checkpoints" / f"step-{state.step:06d}").is_dir()
                if wanted and (state.step > start_step or not written):
                    self.checkpoint(final=True)  # written while the reward workers close
                self.feed.close()  # the engine stops before the reward workers close under it
                self.collector.close()
                self.checkpoints.writer.wait()
                runlog.close()  # after the final checkpoint: a failed write closes the sinks (W&B) as failed
                # A signal that came during the final checkpoint of a finished run stopped nothing: the run is done.
                self.stop_signal = (stop.received or "SIGTERM") if stopping and state.step < cfg.train.steps else None
            failed = False
        except RunStopped as e:  # a result, not a fault: what stopped it, for gspo compare to keep and report
            if self.runtime.is_main:
                replace_atomically(self.run_dir / STOPPED_FILE, json.dumps({"step": state.step, "reason": str(e)}))
            raise
        finally:
            if runlog is not None:
                runlog.close(failed=failed)
            self.feed.close(timeout=None if not failed else 10.0)  # done (or idle) unless the run failed
            self.collector.close()
            if failed:  # an earlier checkpoint in flight still completes; the loop's own error is the one to report
                try:
                    self.checkpoints.writer.wait()
                except Exception as e:  # noqa: BLE001 -- reported beside the error that ends the run
                    log.warning("the checkpoint being written when the run stopped did not complete either: %s", e)
            self.release()
        self.timings["final_checkpoint_s"] = round(time.perf_counter() - t_loop_end, 3)
        self.timings["checkpoint_wait_s"] = round(self.checkpoints.writer.seconds, 3)
        self.timings.update({f"final_checkpoint_{k}": v for k, v in self.checkpoints.writer.phases.items()})
        self.timings["process_s"] = self.since_start()
        self.dir.write_timings(self.timings)
        if self.stop_signal is not None:
            log.warning("%s received: stopped after step %d with a checkpoint; continue with --resume",
                        self.stop_signal, state.step)
        return self.run_dir

    def rollout_batch_once(self, runlog: RunLog) -> None:
        """One rollout batch: the feed's batch (weights to the engine, collect), update, the new weights to the feed;
        its metrics lines are left in ``last_rows``."""
        state = self.state
        first = "first_rollout_at" not in self.timings
        if first:
            self.timings["first_rollout_at"] = self.since_start()
            log.info("first rollout %.1f s after %s (%s)", self.timings["first_rollout_at"],
                     "the command" if self.started is None else "this run started",
                     ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items() if k != "first_rollout_at"))
        t_collect = time.perf_counter()
        with out_of_memory("the rollout", lambda: state.step, self.checkpoints.newest), stage("collect"):
            batch = self.feed.take(state.rollout_batch)
        if first:
            self.timings["first_collect_s"] = round(time.perf_counter() - t_collect, 3)
            self.timings["engine_warmup_s"] = round(getattr(self.engine, "warmup_s", 0.0), 3)
            self.timings["reward_workers_start_s"] = round(getattr(self.rewards, "start_seconds", 0.0), 3)
        with self.writing_log():
            runlog.samples(batch, state.step, state.rollout_batch, self.tokenizer)
        with out_of_memory("the update", lambda: state.step, self.checkpoints.newest), stage("update"):
            self.last_rows = self.update(batch, runlog)
        with self.writing_log():
            runlog.flush()
        state.rollout_batch += 1
        with out_of_memory("the rollout", lambda: state.step, self.checkpoints.newest), stage("publish"):
            self.feed.publish(state.rollout_batch)

    def engine_weights(self):
        """The policy's ``(name, tensor)`` pairs as the engine gets them (rounded: an injected engine-trainer gap)."""
        weights = self.actor.weights()
        if self.cfg.rollout.engine_weight_bits:  # an injected engine-trainer gap (the engine's copy only)
            weights = rounded_weights(weights, self.cfg.rollout.engine_weight_bits)
        return weights

    def reset_feed(self) -> None:
        """Point the feed at where the run is now (a new run, a resume, a rollback): its timeline ends with the run's
        last rollout batch."""
        state, t = self.state, self.cfg.train
        self.feed.reset(state.rollout_batch, state.rollout_batch + max(0, t.steps - state.step) // t.minibatches)

    @contextlib.contextmanager
    def writing_log(self) -> Iterator[None]:
        """Writing the run log (on process 0 under torchrun, while the others wait at the next collective): its time
        adds to ``log_s`` of timings.json, and it is the ``gspo/log`` stage of a profile."""
        t0 = time.perf_counter()
        with stage("log"):
            yield
        self.timings["log_s"] = round(self.timings.get("log_s", 0.0) + time.perf_counter() - t0, 6)

    def update(self, batch: Batch, runlog: RunLog) -> list[dict]:
        """``train.minibatches`` optimizer steps over ``batch``; returns their metrics lines."""
        cfg, state = self.cfg, self.state
        t0 = time.perf_counter()
        rollout = batch.rollout
        tokens = None  # each row's prompt + completion tokens, for balancing the processes' slices
        if self.runtime.world_size > 1:
            tokens = torch.tensor([len(p) for p in rollout.prompt_ids]) + rollout.lengths.cpu()
        plan = self.actor.plan(rollout.completion_ids.shape[0], tokens)
        with stage("old_logprobs"):
            self.actor.prepare(batch, plan)
        batch.metrics["time/logprobs"] = time.perf_counter() - t0
        rows = []
        for k in range(cfg.train.minibatches):
            t_step = time.perf_counter()
            with stage("step"):
                out = self.actor.step(batch, plan, k, state.step)
            metrics = {**batch.metrics, **out.metrics}
            if self.runtime.device.type == "cuda":  # the job's peak: the largest over its processes
                metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.runtime.device) / 2**30
            with stage("reduce_metrics"):
                if out.compute_events is not None:  # waiting on this process's own device only, then one reduce
                    out.compute_events[1].synchronize()
                    seconds = out.compute_events[0].elapsed_time(out.compute_events[1]) / 1e3
                    metrics["dist/compute_max_s"] = metrics["dist/compute_min_s"] = seconds
                values = self.runtime.reduce(metrics, REDUCE)  # the step's one collective and host sync
            self.nonfinite.record(finite(values["loss"]) and finite(values["grad_norm"]), state.step + 1)
            with stage("diagnostics"):
                runlog.diagnostics(self.tokenizer, batch, out.rows, out.logprobs, step=state.step + 1,
                                   rollout_batch=state.rollout_batch, minibatch=k)
            dt = time.perf_counter() - t_step
            tokens = values.pop("trained_tokens")
            row = {"step": state.step + 1, "rollout_batch": state.rollout_batch, "minibatch": k, **values,
                   "lr": self.actor.lr_at(state.step), "nonfinite_steps": float(self.nonfinite.total),
                   "time/update": dt, "throughput/train_tok_s": tokens / max(dt, 1e-9),
                   "time/elapsed": time.time() - self.t_start}
            state.step += 1
            state.nonfinite_steps = self.nonfinite.total
            with self.writing_log():
                runlog.step(row, end_of_batch=(k == cfg.train.minibatches - 1))
            rows.append(row)
        return rows

    # ------------------------------------------------------------------------------------------ sentinel

    def check_collapse(self, rows: list[dict]) -> bool:
        """The collapse sentinel on the batch just trained: warn, stop the run, or roll back (returns True)."""
        sc, state = self.cfg.sentinel, self.state
        self.rewards_seen[state.rollout_batch - 1] = rows[0].get("reward/mean")
        found = collapse_findings(sc, rows, self.rewards_seen)
        if not found:
            return False
        self.collapse = "; ".join(found)
        # a failed checkpoint write ends the run here, before anything relies on the directory
        self.checkpoints.writer.wait()
        newest = self.checkpoints.newest()
        if sc.action == "warn":
            log.warning("collapse sentinel at step %d: %s", state.step, self.collapse)
            return False
        older = self.checkpoints.before_collapse(state.rollout_batch - 1, self.rewards_seen)
        action = response(sc, state.rollbacks, bool(older))
        if action == "rollback":
            rollbacks = state.rollbacks + 1
            log.warning("collapse sentinel at step %d: %s; rolling back to %s with the learning rate x %g (rollback %d "
                        "of %d)", state.step, self.collapse, older[-1].name, sc.lr_factor, rollbacks, sc.max_rollbacks)
            self.actor.lr_scale *= sc.lr_factor
            state.rollbacks = rollbacks
            self.feed.drop()  # the batches collected ahead belong to the abandoned timeline
            self.restore(before_batch=checkpoint_batch(older[-1]) + 1)
            self.reset_feed()
            if self.runtime.is_main:
                self.checkpoints.abandon_after(state.step)
            comm.barrier()
            return True
        last = f"the last checkpoint is {newest}" if newest else "no checkpoint was written yet"
        last += stop_reason(sc, state.rollbacks, bool(older))
        raise RunStopped(f"Collapse sentinel stopped the run at step {state.step}: {self.collapse}; {last}. Resume from "
                         "it with a lower train.lr, or loosen the sentinel.* thresholds.")

    # ------------------------------------------------------------------------------------------ checkpoints

    def checkpoint(self, final: bool = False) -> None:
        """Start writing a checkpoint of the run as it is now (see :meth:`Checkpoints.save`), keeping the one a reward
        drop would roll back to (:meth:`Checkpoints.rollback_target`). ``final``: the session's last, after which the
        feed stops where it was held (a stopped run's engine would otherwise collect on while the reward workers
        close)."""
        pinned = self.checkpoints.rollback_target(self.rewards_seen)
        # a feed that collects ahead finishes the batches older policies sample and stays idle while the checkpoint
        # takes its copy, so the batches it saves and the data position and sampling stream agree
        with out_of_memory("the rollout", lambda: self.state.step, self.checkpoints.newest):
            self.feed.pause()
        try:
            self.checkpoints.save(self.state, self.t_start, pinned)
        finally:
            if final:
                self.feed.close()
            else:
                self.feed.resume()

    def restore(self, before_batch: int | None = None) -> None:
        """Load the newest readable checkpoint (with ``before_batch``: the newest written before that rollout batch)."""
        path = self.run_dir / "metrics.jsonl"
        metrics = read_jsonl(path) if path.exists() else None  # read once: for the checkpoint choice and the sentinel
        ckpt, state = self.checkpoints.restore(before_batch, metrics)
        state.rollbacks = max(state.rollbacks, self.state.rollbacks)
        vars(self.state).update(vars(state))  # in place: the loop holds this object
        self.actor.set_lr(state.step)
        self.nonfinite = NonFiniteSteps(self.cfg.train.max_nonfinite_steps, state.nonfinite_steps)
        # The collapse sentinel's reward history up to the checkpoint, as the run that wrote it saw it.
        self.rewards_seen = {r["rollout_batch"]: r.get("reward/mean") for r in metrics or []
                             if r.get("minibatch", 0) == 0 and r["rollout_batch"] < state.rollout_batch}
        log.info("resumed from %s at optimizer step %d", ckpt, state.step)

    def release(self) -> None:
        """Let another process use the run directory (done at the end of ``train()``)."""
        self.dir.release()
