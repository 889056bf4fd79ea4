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
Differences from the GSPO paper's setup: none in the objective; rewards that fail are excluded rather than scored 0.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo.checkpoint import RANK_FILE, checkpoint_step, complete_checkpoints
from gspo.config import SOURCE_KEYS, Config, resume_changes, source_fingerprints
from gspo.data import DataStream, build_dataset, dataset_args, default_reward
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.models import load_model, stop_token_ids
from gspo.logprobs import as_fsdp_forward
from gspo.parallel import comm
from gspo.parallel.holding import hold
from gspo.parallel.strategy import check_layout, choose as choose_strategy
from gspo.runlog.profiler import BatchProfiler, stage
from gspo.rewards.runner import RewardRunner, RewardSpec
from gspo.rollout import RolloutEngine, make_engine, rounded_weights
from gspo.runlog import RunLog
from gspo.runtime import Runtime, finite, precision_name, seconds_since, seed_everything, set_rng_state
from gspo.train.actor import Actor, prepare_model
from gspo.train.collect import Collector
from gspo.train.guards import NonFiniteSteps, StopSignals, dist_failures, lock_run_dir, out_of_memory
from gspo.train.sentinel import (best_window_end, collapse_findings, response, reward_drop, rollback_limit,
                                 stop_reason)
from gspo.train.state import (CheckpointWriter, TrainState, checkpoint_batch, checkpoints_through, load as load_state,
                              newest_checkpoint)
from gspo.types import Batch

log = logging.getLogger("gspo")

# How a metric is combined over the processes of a job where they differ (the rest are means): memory is the busiest
# GPU's, the time to the gradient the slowest and the fastest process's. (Rollout counters are already the job's:
# Collector.gather sums the tokens and takes the slowest time.)
REDUCE = {"memory/peak_gib": "max", "dist/compute_max_s": "max", "dist/compute_min_s": "min"}


def _has_lines(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


@dataclass
class Parts:
    """The components of a run, built from its config: what the loop sequences (the probe uses them too)."""

    runtime: Runtime
    actor: Actor
    tokenizer: object
    engine: RolloutEngine
    collector: Collector
    rewards: RewardRunner


def build(cfg: Config, runtime: Runtime, timings: dict[str, float] | None = None) -> Parts:
    """Model, actor, engine, reward workers and collect stage for ``cfg``; ``timings`` gets the seconds of each."""
    timings = {} if timings is None else timings
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 3)
        clock = now

    seed_everything(cfg.seed)
    specs = ([RewardSpec(r.path, r.weight, r.name) for r in cfg.rewards.functions]
             or [RewardSpec(default_reward(cfg.data.task))])
    rewards = RewardRunner(specs, workers=cfg.rewards.workers, timeout_s=cfg.rewards.timeout_s)  # starts in the background
    lap("reward_functions")
    try:
        if runtime.device.type == "cuda":
            torch.cuda.init()
            torch.empty(1, device=runtime.device)  # the CUDA context, on its own line of the timings
        lap("cuda_init")
        model, tokenizer = load_model(cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(runtime.device))
        lap("model_load")
        ref_model, routing = prepare_model(cfg, runtime, model)
        strategy = choose_strategy(cfg, model, runtime.device, runtime.world_size)
        lap("actor")
        # Under FSDP, with LoRA, and with rounded engine weights, the engine takes its own copy of the plain weights
        # before the holding shards or adapts the policy; it is fed the gathered, merged or rounded weights after every
        # optimizer step.
        engine = make_engine(cfg.rollout.engine, model, tokenizer, stop_ids=stop_token_ids(tokenizer, model),
                             device=runtime.device, autocast_dtype=runtime.autocast, fused_step=cfg.rollout.fused_step,
                             compact_rows=cfg.rollout.compact_rows,
                             replica=strategy == "fsdp" or cfg.lora.rank > 0 or cfg.rollout.engine_weight_bits > 0,
                             vllm_gpu_memory=cfg.rollout.vllm_gpu_memory,
                             # R3 replays the experts that sampled each token: the engine records them
                             routing=routing if cfg.moe.routing_replay == "rollout" else None)
        holding = hold(strategy, model, runtime, cfg, ref_model=ref_model, prepare_forward=as_fsdp_forward)
        actor = Actor(cfg, runtime, model, holding, ref_model=ref_model, routing=routing)
        lap("engine")
        stream = DataStream(build_dataset(dataset_args(cfg.data, cfg.seed)), seed=cfg.seed)
        lap("data")
    except BaseException:
        rewards.close()
        raise
    # Each process samples with its own stream (the first one's is the one-process run's).
    generator = torch.Generator(device=runtime.device).manual_seed(cfg.seed + runtime.rank)
    return Parts(runtime, actor, tokenizer, engine, Collector(cfg, tokenizer, stream, rewards, engine, generator), rewards)


def describe_run(cfg: Config, runtime: Runtime, run_dir: Path, resume: bool) -> str:
    """The start-up line: algorithm, task, model, device, precision (and why, on a CPU), batch shape and length."""
    r, t = cfg.rollout, cfg.train
    where = runtime.device.type if runtime.world_size == 1 else f"{runtime.world_size} x {runtime.device.type}"
    precision = precision_name(runtime.autocast)
    if runtime.device.type == "cpu" and cfg.model.precision == "auto":
        precision += " (this CPU has native bf16)" if runtime.autocast else " (this CPU has no native bf16)"
    batches = -(-t.steps // t.minibatches)
    return (f"{'resuming' if resume else 'training'} {cfg.algorithm} on {cfg.data.task} with {cfg.model.name} on "
            f"{where}, {precision}; {r.prompts_per_batch * runtime.world_size} prompts x {r.group_size} completions "
            f"of up to {r.max_new_tokens} tokens a rollout batch, {t.steps} optimizer steps ({batches} rollout "
            f"batch{'es' if batches != 1 else ''} x {t.minibatches} minibatches); run directory {run_dir}")


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
        self.runtime = runtime or Runtime.from_config(cfg.model)
        check_layout(cfg, self.runtime.world_size)
        comm.init(self.runtime.device, cfg.dist.timeout_s)
        self.timings: dict[str, float] = {"process_start_to_trainer": self.since_start()}
        self._prepare_run_dir(resume)
        if self.runtime.is_main:  # before the model loads (seconds to minutes): what this run is, at once
            log.info("%s", describe_run(cfg, self.runtime, self.run_dir, resume))
        try:
            parts = build(cfg, self.runtime, self.timings)
            self.actor, self.tokenizer, self.engine = parts.actor, parts.tokenizer, parts.engine
            self.collector, self.rewards = parts.collector, parts.rewards
            self.state = TrainState()
            self.writer = CheckpointWriter(self.run_dir)
            self.profiler = BatchProfiler(cfg.log.profile_batch, self.run_dir, self.runtime.rank, self.runtime.device)
            self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps)
            self.stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when train() stopped early on one
            self.collapse: str | None = None  # what the collapse sentinel saw last, if it triggered
            self.rewards_seen: dict[int, float | None] = {}  # rollout batch -> reward/mean, for the sentinel
            if resume:
                self.restore()
            if self.runtime.is_main:
                self._record_config()
            self.timings["trainer_ready_at"] = self.since_start()
        except BaseException:
            if hasattr(self, "rewards"):
                self.rewards.close()
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
            # The final checkpoint is written inside the signal guard too: a first SIGINT / SIGTERM while it is being
            # written is noted, and the checkpoint completes.
            with StopSignals(lambda: f"rollout batch {self.state.rollout_batch}") as stop, dist_failures(self):
                runlog = RunLog(self.run_dir, cfg, step=state.step, rollout_batch=state.rollout_batch,
                                enabled=self.runtime.is_main)
                # Under torchrun the processes stop together, at the first rollout-batch boundary after any of them
                # got a signal (one that went on alone would wait in a collective for the others).
                stopping = comm.any_rank(stop.received is not None)
                while state.step < cfg.train.steps and not stopping:
                    with self.profiler.around(state.rollout_batch):
                        self.rollout_batch_once(runlog)
                    self.writer.poll()  # a background checkpoint that failed ends the run now, in one line
                    stopping = comm.any_rank(stop.received is not None)
                    if self.check_collapse(self.last_rows):  # rolled back to an earlier checkpoint: replay from there
                        runlog.rewind(state.step, state.rollout_batch)
                        continue
                    every = cfg.log.checkpoint_every
                    if every and state.rollout_batch % every == 0 and state.step < cfg.train.steps and not stopping:
                        self.checkpoint()
                t_loop_end = time.perf_counter()
                self.timings["loop_s"] = round(t_loop_end - t_train, 3)
                if state.step > start_step or not (self.run_dir / "checkpoints" / f"step-{state.step:06d}").is_dir():
                    self.checkpoint()  # written while the reward workers close
                self.rewards.close()
                self.writer.wait()
                runlog.close()  # after the final checkpoint: a failed write closes the sinks (W&B) as failed
                # A signal that came during the final checkpoint of a finished run stopped nothing: the run is done.
                self.stop_signal = (stop.received or "SIGTERM") if stopping and state.step < cfg.train.steps else None
            failed = False
        finally:
            if runlog is not None:
                runlog.close(failed=failed)
            self.rewards.close()
            if failed:  # an earlier checkpoint in flight still completes; the loop's own error is the one to report
                try:
                    self.writer.wait()
                except Exception as e:  # noqa: BLE001 -- reported beside the error that ends the run
                    log.warning("the checkpoint being written when the run stopped did not complete either: %s", e)
            self.release()
        self.timings["final_checkpoint_s"] = round(time.perf_counter() - t_loop_end, 3)
        self.timings["checkpoint_wait_s"] = round(self.writer.seconds, 3)
        self.timings.update({f"final_checkpoint_{k}": v for k, v in self.writer.phases.items()})
        self.timings["process_s"] = self.since_start()
        if self.runtime.is_main:
            try:
                (self.run_dir / "timings.json").write_text(json.dumps(self.timings, indent=1))
            except OSError as e:  # a diagnostic: the run itself is complete
                log.warning("timings.json could not be written (%s)", e.strerror or e)
        if self.stop_signal is not None:
            log.warning("%s received: stopped after step %d with a checkpoint; continue with --resume",
                        self.stop_signal, state.step)
        return self.run_dir

    def rollout_batch_once(self, runlog: RunLog) -> None:
        """One rollout batch: weights to the engine, collect, update; its metrics lines are left in ``last_rows``."""
        state = self.state
        t_sync = time.perf_counter()
        with stage("sync_weights"):
            weights = self.actor.weights()
            if self.cfg.rollout.engine_weight_bits:  # an injected engine-trainer gap (the engine's copy only)
                weights = rounded_weights(weights, self.cfg.rollout.engine_weight_bits)
            self.engine.sync_weights(weights)
        t_sync = time.perf_counter() - t_sync
        first = "first_rollout_at" not in self.timings
        if first:
            self.timings["first_rollout_at"] = self.since_start()
            log.info("first rollout %.1f s after %s (%s)", self.timings["first_rollout_at"],
                     "the command" if self.started is None else "this run started",
                     ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items() if k != "first_rollout_at"))
        t_collect = time.perf_counter()
        with out_of_memory("the rollout", lambda: state.step, self.newest_checkpoint), stage("collect"):
            batch = self.collector.collect()
        batch.metrics["time/sync_weights"] = t_sync
        if first:
            self.timings["first_collect_s"] = round(time.perf_counter() - t_collect, 3)
            self.timings["engine_warmup_s"] = round(getattr(self.engine, "warmup_s", 0.0), 3)
            self.timings["reward_workers_start_s"] = round(self.rewards.start_seconds, 3)
        with self.writing_log():
            runlog.samples(batch, state.step, state.rollout_batch)
        with out_of_memory("the update", lambda: state.step, self.newest_checkpoint), stage("update"):
            self.last_rows = self.update(batch, runlog)
        with self.writing_log():
            runlog.flush()
        state.rollout_batch += 1

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
        self.writer.wait()  # a failed checkpoint write ends the run here, before anything relies on the directory
        newest = self.newest_checkpoint()
        if sc.action == "warn":
            log.warning("collapse sentinel at step %d: %s", state.step, self.collapse)
            return False
        # The newest checkpoint rollback_limit allows: from before the batch before the trigger and, after a reward
        # drop, from before the decline. When the reward peaked before the first checkpoint, the newest one before
        # the batch before the trigger, as for the other detectors.
        trigger = state.rollout_batch - 1
        peak = best_window_end(sc, self.rewards_seen, before_newest=True) if reward_drop(sc, self.rewards_seen) else None
        older = (checkpoints_through(self.run_dir, rollback_limit(trigger, peak))
                 or checkpoints_through(self.run_dir, rollback_limit(trigger, None)))
        action = response(sc, state.rollbacks, bool(older))
        if action == "rollback":
            rollbacks = state.rollbacks + 1
            log.warning("collapse sentinel at step %d: %s; rolling back to %s with the learning rate x %g (rollback %d "
                        "of %d)", state.step, self.collapse, older[-1].name, sc.lr_factor, rollbacks, sc.max_rollbacks)
            self.actor.lr_scale *= sc.lr_factor
            state.rollbacks = rollbacks
            self.restore(before_batch=checkpoint_batch(older[-1]) + 1)
            if self.runtime.is_main:
                self._abandon_checkpoints_after(state.step)
            comm.barrier()
            return True
        last = f"the last checkpoint is {newest}" if newest else "no checkpoint was written yet"
        last += stop_reason(sc, state.rollbacks, bool(older))
        raise UserError(f"Collapse sentinel stopped the run at step {state.step}: {self.collapse}; {last}. Resume from "
                        "it with a lower train.lr, or loosen the sentinel.* thresholds.")

    # ------------------------------------------------------------------------------------------ run directory

    def _prepare_run_dir(self, resume: bool) -> None:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"The run directory {str(self.run_dir)!r} is a file; choose another log.run_dir (or --run-dir).")
        # A directory without a checkpoint or a metrics line (a start that failed before its first step) has nothing to
        # lose or continue: a plain start takes it over.
        exists = self.run_dir.exists() and (bool(complete_checkpoints(self.run_dir / "checkpoints"))
                                            or _has_lines(self.run_dir / "metrics.jsonl"))
        if exists and not resume:
            raise UserError(f"Run directory {str(self.run_dir)!r} already exists; pass --resume to continue it, "
                            "or choose another log.run_dir.")
        if self.runtime.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._lock = lock_run_dir(self.run_dir)
            except OSError as e:
                raise UserError(f"The run directory {str(self.run_dir)!r} cannot be written ({e.strerror or e}); fix "
                                "its permissions or choose another log.run_dir.") from None
            try:
                self._config_changes = self._check_resumed_config() if resume and exists else {}
                (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
            except OSError as e:
                self.release()
                raise UserError(f"Writing {str(self.run_dir / 'config.json')!r} failed ({e.strerror or e}); free disk "
                                "space or fix the directory.") from None
            except BaseException:
                self.release()
                raise

    def _check_resumed_config(self) -> dict[str, list]:
        """What this session changes against the config the run was trained with; a change ``--resume`` may not make
        (see ``gspo.config.RESUMABLE``) is refused in one line, before anything is written."""
        path = self.run_dir / "config.json"
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
        path = self.run_dir / "config_history.jsonl"
        entries = read_jsonl(path) if path.exists() else []
        return entries[-1].get("sources", {}) if entries else {}

    def _record_config(self) -> None:
        """Append what this session trains with, from which step, to config_history.jsonl (config.json holds the
        latest): one line per session that started or resumed the run."""
        config = self.cfg.to_dict()
        entry = {"step": self.state.step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "changed": self._config_changes, "config": config, "sources": source_fingerprints(config)}
        try:
            with open(self.run_dir / "config_history.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            raise UserError(f"Writing {str(self.run_dir / 'config_history.jsonl')!r} failed ({e.strerror or e}); free "
                            "disk space or fix the directory.") from None
        if self._config_changes:
            log.info("resumed with changed settings: %s", ", ".join(f"{k} {v[0]!r} -> {v[1]!r}"
                                                                   for k, v in self._config_changes.items()))

    def release(self) -> None:
        """Let another process use the run directory (done at the end of ``train()``)."""
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.close()

    def _restore_process_rng(self, ckpt: Path, payload: dict, step: int) -> None:
        """Each process's own RNGs and sampling stream, from the checkpoint's ``rank-NNNNN.pt`` when the same number of
        processes wrote it. At another number of processes the streams cannot be mapped: every process is seeded
        afresh from (seed, step, rank); weights, optimizer, data position and minibatch shuffles are still exact."""
        rank, world = self.runtime.rank, self.runtime.world_size
        saved = payload.get("world_size", 1)
        if saved == world:
            if world > 1:
                own = torch.load(ckpt / RANK_FILE.format(rank), weights_only=False)
                set_rng_state(own["rng"])
                self.collector.generator.set_state(own["generator"])
            return
        seed = self.cfg.seed + 1_000_003 * step + rank
        seed_everything(seed)
        self.collector.generator.manual_seed(seed)
        if self.runtime.is_main:
            log.warning("resumed on %d process(es) from a checkpoint written by %d: weights, optimizer, data position "
                        "and minibatch shuffles are exact; the sampling streams are new (seeded from seed, step and "
                        "rank), so the rollouts differ from those of an uninterrupted run", world, saved)

    def _abandon_checkpoints_after(self, step: int) -> None:
        """A rollback abandons the timeline after ``step``: its checkpoints are renamed out of the way (to
        ``rolled-back-step-N``, never taken for a checkpoint), so neither --resume nor a message can pick them."""
        for ckpt in complete_checkpoints(self.run_dir / "checkpoints"):
            if checkpoint_step(ckpt) > step:
                ckpt.rename(ckpt.with_name(f"rolled-back-{ckpt.name}-{int(time.time())}"))

    def newest_checkpoint(self) -> str | None:
        """The newest complete checkpoint, once the write in flight (if any) has finished (a failed write stays
        pending: the next ``wait`` raises it)."""
        self.writer.wait(raise_error=False)
        return newest_checkpoint(self.run_dir)

    def checkpoint(self) -> None:
        """Start writing a checkpoint of the run as it is now (in the background; see CheckpointWriter)."""
        self.writer.pinned = self.rollback_target_pin()
        c = self.collector
        parts = {**self.actor.state_dict(), "generator": c.generator.get_state(), "data": c.stream.state_dict(),
                 "skipped_prompts": c.skipped_prompts, "world_size": self.runtime.world_size}
        self.actor.holding.save(self.writer, self.state, parts, self.tokenizer, self.cfg.log.keep_checkpoints,
                                self.t_start)

    def rollback_target_pin(self) -> int | None:
        """The step of the checkpoint a reward drop would roll back to (the newest holding a policy no later than the
        one that sampled the last batch of the best reward window so far: see rollback_limit), which pruning must keep
        however old it gets; None unless the sentinel rolls back on reward drops."""
        sc = self.cfg.sentinel
        peak = best_window_end(sc, self.rewards_seen) if sc.action == "rollback" else None
        if peak is None:
            return None
        self.writer.wait()  # the write in flight may be the one to pin
        kept = checkpoints_through(self.run_dir, peak)
        return checkpoint_step(kept[-1]) if kept else None

    def restore(self, before_batch: int | None = None) -> None:
        """Load the newest readable checkpoint (with ``before_batch``: the newest written before that rollout batch)."""
        path = self.run_dir / "metrics.jsonl"
        metrics = read_jsonl(path) if path.exists() else None  # read once: for the checkpoint choice and the sentinel
        ckpt, state, payload = load_state(self.run_dir, self.actor.holding.load_weights, before_batch, metrics)
        self.actor.load_state_dict(payload)
        self.collector.generator.set_state(payload["generator"])
        self._restore_process_rng(ckpt, payload, state.step)
        self.collector.stream.load_state_dict(payload["data"])
        self.collector.skipped_prompts = payload.get("skipped_prompts", 0)
        state.rollbacks = max(state.rollbacks, self.state.rollbacks)
        vars(self.state).update(vars(state))  # in place: the loop holds this object
        self.actor.set_lr(state.step)
        self.nonfinite = NonFiniteSteps(self.cfg.train.max_nonfinite_steps, state.nonfinite_steps)
        # The collapse sentinel's reward history up to the checkpoint, as the run that wrote it saw it.
        self.rewards_seen = {r["rollout_batch"]: r.get("reward/mean") for r in metrics or []
                             if r.get("minibatch", 0) == 0 and r["rollout_batch"] < state.rollout_batch}
        log.info("resumed from %s at optimizer step %d", ckpt, state.step)
