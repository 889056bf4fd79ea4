"""What a checkpoint holds and how a run comes back from one: the file format's trainer side (:class:`TrainState`,
:class:`CheckpointWriter`, :func:`load`) and the trainer's checkpoints (:class:`Checkpoints`: each part's
``state_dict()`` collected into one, the newest restored into each part, the rollback pin, the process RNGs).

A checkpoint (written atomically by :mod:`gspo.checkpoint`, in the background by :class:`CheckpointWriter`) is a
loadable HF model directory plus ``trainer_state.pt``: the counters of :class:`TrainState`, the optimizer, every RNG
(Python, NumPy, torch, CUDA, the rollout sampler and the minibatch shuffle) and the data position. Restoring all of
them at a rollout-batch boundary makes a resumed run bit-identical to one that never stopped. A run of several
processes adds its DCP shards and each process's RNGs (:func:`gspo.checkpoint.save_sharded`); see
docs/distributed.md for what a resume at another number of processes keeps exactly. The learning-rate schedule is a
function of the step, so there is no scheduler state to restore.
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
import threading
import time
import types
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gspo.checkpoint import (RANK_FILE, aside, attempt, checkpoint_step, complete_checkpoints, save_checkpoint,
                             save_replicated, save_sharded, to_cpu, verify, why)
from gspo.errors import UserError
from gspo.parallel import comm
from gspo.train.sentinel import best_window_end, reward_drop, rollback_limit
from gspo.runtime import rng_state, seed_everything, set_rng_state

log = logging.getLogger("gspo")


@dataclass
class TrainState:
    """The loop's counters: where the run is, and what it has been through."""

    step: int = 0  # optimizer steps done
    rollout_batch: int = 0  # rollout batches done
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    elapsed: float = 0.0  # wall-clock seconds of earlier sessions of a resumed run
    rollbacks: int = 0  # collapse-sentinel rollbacks done


def checkpoint_batch(ckpt: Path) -> int:
    """The rollout batch a checkpoint resumes at (from its state.json); unreadable ones are never rollback targets."""
    try:
        return int(json.loads((ckpt / "state.json").read_text())["rollout_batch"])
    except (OSError, ValueError, KeyError):
        return 1 << 30


def checkpoints_through(run_dir: Path, batch: int) -> list[Path]:
    """The run's complete checkpoints, oldest first, that resume at rollout batch ``batch`` or earlier."""
    return [c for c in complete_checkpoints(run_dir / "checkpoints") if checkpoint_batch(c) <= batch]


def metrics_cover(rows: list[dict[str, Any]] | None) -> int | None:
    """The largest step ``s`` such that the ``metrics.jsonl`` rows hold a line for every step 1..s (None without the
    file): a checkpoint past it would resume with a hole in the metrics (a line lost to a full disk or a kill)."""
    if rows is None:
        return None
    steps = {row.get("step") for row in rows}
    covered = 0
    while covered + 1 in steps:
        covered += 1
    return covered


def newest_checkpoint(run_dir: Path) -> str | None:
    """Name of the newest complete checkpoint (for messages that say what is intact), or None."""
    done = complete_checkpoints(run_dir / "checkpoints")
    return done[-1].name if done else None


def _payload(state: TrainState, parts: dict[str, Any], t_start: float) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.pt``: the run's counters, elapsed time, every RNG and ``parts``, copied to the
    CPU (an optimizer state on the GPU, a LoRA run's under torchrun too, must not load back onto one device)."""
    return to_cpu({**asdict(state), "elapsed": time.time() - t_start, "rng": rng_state(), **parts})


class CheckpointWriter:
    """Writes checkpoints off the training loop's critical path: ``submit`` takes a CPU snapshot of everything the
    checkpoint holds (a device-to-host copy, the only part the loop waits for) and writes, fsyncs and renames it in a
    background thread while training goes on. One write at a time: ``submit`` and ``wait`` first finish the previous
    one and raise its error, if it had one, as the one-line message a synchronous write would have given. A process
    killed mid-write leaves a ``.tmp`` directory that is never taken for a checkpoint (see :mod:`gspo.checkpoint`)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Path | None = None  # the newest checkpoint this writer completed
        self.seconds = 0.0  # time the loop spent waiting for checkpoints (snapshots and waits), cumulative
        self.phases: dict[str, float] = {}  # the last checkpoint's snapshot, write and fsync seconds
        self.pinned: int | None = None  # a checkpoint's step that pruning spares (set by the loop before a write)

    def submit(self, state: TrainState, parts: dict[str, Any], model, tokenizer, keep: int, t_start: float) -> None:
        """Start writing checkpoint ``step-<state.step>`` with the model, ``parts`` (the actor's and collect stage's
        state) and every RNG, as they are now."""
        self.wait()
        t0 = time.perf_counter()
        payload = _payload(state, parts, t_start)
        # A LoRA policy (a PeftModel) is checkpointed as its adapter: peft's save_pretrained keeps the lora_ tensors.
        weights = to_cpu({k: v for k, v in model.state_dict().items() if "lora_" in k} if hasattr(model, "peft_config")
                         else model.state_dict())
        self.phases = {"snapshot_s": round(time.perf_counter() - t0, 3)}
        step = state.step
        self._thread = threading.Thread(target=self._write, args=(step, model, tokenizer, payload, keep, weights,
                                                                  self.pinned),
                                        name=f"gspo-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.seconds += time.perf_counter() - t0

    def _write(self, step, model, tokenizer, payload, keep, weights, pinned) -> None:
        try:
            self.last = save_checkpoint(self.run_dir / "checkpoints", step, model, tokenizer, payload, keep, weights,
                                        self.phases, pinned=pinned)
        except (OSError, RuntimeError) as e:  # no space (torch.save reports it as a RuntimeError), a read-only or
            # vanished directory: the previous checkpoints are untouched
            self._error = self._failed(step, e)
        except BaseException as e:  # anything else is a bug: re-raised as it is in the loop's thread
            self._error = e

    def _failed(self, step: int, e: BaseException) -> UserError:
        newest = newest_checkpoint(self.run_dir)
        kept = f"the last complete one, {newest}, is intact" if newest else "no earlier checkpoint exists"
        why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:200]
        try:  # torch's writer reports a full disk as "unexpected pos 704 vs 598": the free space says what it was
            why += f"; {shutil.disk_usage(self.run_dir).free / 2**20:.1f} MiB free there"
        except OSError:
            pass
        error = UserError(f"Writing the checkpoint of step {step} to {str(self.run_dir / 'checkpoints')!r} failed "
                          f"({why}); {kept}. Free disk space or fix the directory, then --resume.")
        error.__cause__ = e
        return error

    def write_sharded(self, state: TrainState, parts: dict[str, Any], model, optimizer, tokenizer, keep: int,
                      t_start: float) -> None:
        """Write checkpoint ``step-<state.step>`` of a sharded policy now, with every process (a collective; see
        :func:`gspo.checkpoint.save_sharded`)."""
        self._write_collectively(state, parts, t_start, lambda payload, own: save_sharded(
            self.run_dir / "checkpoints", state.step, model, optimizer, tokenizer, payload, own, keep,
            self.pinned))

    def write_replicated(self, state: TrainState, parts: dict[str, Any], model, tokenizer, keep: int,
                         t_start: float) -> None:
        """Write checkpoint ``step-<state.step>`` of a policy every process holds alike (LoRA under torchrun) now, with
        every process (a collective; see :func:`gspo.checkpoint.save_replicated`)."""
        self._write_collectively(state, parts, t_start, lambda payload, own: save_replicated(
            self.run_dir / "checkpoints", state.step, model, tokenizer, payload, own, keep, self.pinned))

    def _write_collectively(self, state: TrainState, parts: dict[str, Any], t_start: float, save) -> None:
        t0 = time.perf_counter()
        payload = _payload(state, parts, t_start)
        own = {"rng": payload["rng"], "generator": payload["generator"]}  # this process's own, in its rank file
        try:
            self.last = save(payload, own)
        except OSError as e:
            raise self._failed(state.step, e) from e
        self.seconds += time.perf_counter() - t0

    def wait(self, raise_error: bool = True) -> Path | None:
        """Finish the write in flight (if any); raise its error (with ``raise_error=False`` it stays pending for the
        next call); return the newest checkpoint written."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.seconds += time.perf_counter() - t0
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error
        return self.last

    def poll(self) -> None:
        """Raise the error of a write that has finished and failed; never waits."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()


def load(run_dir: Path, read, before_batch: int | None = None,
         metrics: list[dict[str, Any]] | None = None) -> tuple[Path, TrainState, dict[str, Any]]:
    """The newest checkpoint that loads (with ``before_batch``: the newest written before that rollout batch), loaded
    by ``read(ckpt)`` (everything the run restores from it, RNGs included; returns the ``trainer_state.pt`` payload);
    returns it, its counters and the payload. One boundary: a checkpoint either loads or is skipped with its reason in
    a warning -- files not as its manifest recorded them (checked first, before anything is loaded from it), or any
    error ``read`` raises, of whatever kind -- and the previous one is tried; under ``torchrun`` every process skips
    it if any process could not load it. So does one whose steps ``metrics`` (the rows of ``metrics.jsonl``, None
    without the file) no longer cover (a line lost), so that the replayed steps fill the hole."""
    root = run_dir / "checkpoints"
    ckpts = complete_checkpoints(root) if before_batch is None else checkpoints_through(run_dir, before_batch - 1)
    covered = metrics_cover(metrics)
    if covered is not None and ckpts and checkpoint_step(ckpts[-1]) > covered:
        usable = [c for c in ckpts if checkpoint_step(c) <= covered]
        log.warning("metrics.jsonl has lines for steps 1..%d only; resuming from %s instead of %s so the missing steps "
                    "are trained and logged again", covered, usable[-1].name if usable else "the start", ckpts[-1].name)
        if not usable:
            raise UserError(f"metrics.jsonl in {str(run_dir)!r} has lines for steps 1..{covered} only, before every "
                            "checkpoint, so a resumed run would leave a hole in it; start a new run in another "
                            "directory (the old one stays as it is).")
        ckpts = usable
    if not ckpts:
        if (run_dir / "metrics.jsonl").exists() and before_batch is None:
            raise UserError(f"--resume found no complete checkpoint in {str(root)!r}: the run stopped before its first "
                            "one; move the directory aside (or choose another log.run_dir) and start again without "
                            "--resume.")
        raise UserError(f"--resume found no complete checkpoint in {str(root)!r}; start a new run without --resume.")
    rank, world = comm.rank_world()
    reasons = []
    for ckpt in reversed(ckpts):
        found, error = attempt(verify, ckpt, (rank, world))
        reason = _agreed_reason(why(error) if error is not None else found)
        if reason is None:
            payload, error = attempt(read, ckpt)
            reason = _agreed_reason(None if error is None else why(error))
        if reason is None:
            break
        reasons.append(f"{ckpt.name}: {reason}")
        if rank == 0:
            log.warning("checkpoint %s cannot be read (%s)%s", ckpt, reason,
                        "; trying the previous one" if ckpt != ckpts[0] else "")
    else:
        raise UserError(f"--resume found no checkpoint in {str(root)!r} that loads (all {len(ckpts)} failed; "
                        f"{reasons[0]}); start a new run without --resume, or in another directory.")
    state = TrainState(**{f.name: payload.get(f.name, getattr(TrainState, f.name)) for f in fields(TrainState)})
    return ckpt, state, payload


def _agreed_reason(reason: str | None) -> str | None:
    """This process's reason why a checkpoint cannot be loaded, or the first other process's: every process skips a
    checkpoint that any of them cannot load (they must load the same one, or the collectives of the load would part)."""
    return next((text for text in comm.gather_objects(reason) if text is not None), None)


class _MovedClasses(pickle.Unpickler):
    """Reads a payload that names a class where an earlier version of gspo kept it: an asynchronous run's queued
    batches (``async_queue``) were pickled as ``gspo.train.pipeline.Queued`` before :mod:`gspo.feed` (issue 50)."""

    MOVED = {("gspo.train.pipeline", "Queued"): "gspo.feed.base"}

    def find_class(self, module: str, name: str):
        return super().find_class(self.MOVED.get((module, name), module), name)


# torch.load takes a pickle module: this one is pickle with the unpickler above
_moved_classes = types.SimpleNamespace(Unpickler=_MovedClasses, load=pickle.load, __name__="pickle")


class Checkpoints:
    """The checkpoints of one training job in ``run_dir``: :meth:`save` collects the actor's, the collector's and the
    feed's ``state_dict()`` (and the counters) into one checkpoint, which the policy's holding writes (in the background, or
    with every process); :meth:`restore` loads the newest (or one written before a rollout batch) back into each."""

    def __init__(self, run_dir: Path, cfg, runtime, actor, collector, feed, tokenizer):
        self.run_dir, self.cfg, self.runtime = run_dir, cfg, runtime
        self.actor, self.collector, self.feed, self.tokenizer = actor, collector, feed, tokenizer
        self.writer = CheckpointWriter(run_dir)

    def save(self, state: TrainState, t_start: float, pinned: int | None) -> None:
        """Start writing a checkpoint of the run as it is now; pruning keeps checkpoint ``pinned`` (a step) however old
        it gets."""
        self.writer.pinned = pinned
        parts = {**self.actor.state_dict(), **self.collector.state_dict(), "world_size": self.runtime.world_size,
                 **self.feed.state_dict()}
        self.actor.holding.save(self.writer, state, parts, self.tokenizer, self.cfg.log.keep_checkpoints, t_start)

    def restore(self, before_batch: int | None, metrics: list[dict] | None) -> tuple[Path, TrainState]:
        """Load the newest readable checkpoint (with ``before_batch``: the newest written before that rollout batch)
        into the actor, the collector and the feed, with this process's RNGs; returns it and its counters."""
        ckpt, state, _ = load(self.run_dir, self._read, before_batch, metrics)
        return ckpt, state

    def _read(self, ckpt: Path) -> dict[str, Any]:
        """Everything the run restores from checkpoint ``ckpt``, into the actor, the collector and the feed; its
        payload."""
        self.actor.holding.load_weights(ckpt)
        payload = torch.load(ckpt / "trainer_state.pt", weights_only=False, pickle_module=_moved_classes)
        set_rng_state(payload["rng"])
        self.actor.load_state_dict(payload)
        self.collector.load_state_dict(payload)
        self.feed.load_state_dict(payload)
        self._restore_process_rng(ckpt, payload, int(payload["step"]))
        return payload

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
                if self.collector.generator is not None:  # (decode processes sample: theirs are in the payload)
                    self.collector.generator.set_state(own["generator"])
            return
        seed = self.cfg.seed + 1_000_003 * step + rank
        seed_everything(seed)
        if self.collector.generator is not None:
            self.collector.generator.manual_seed(seed)
        if self.runtime.is_main:
            log.warning("resumed on %d process(es) from a checkpoint written by %d: weights, optimizer, data position "
                        "and minibatch shuffles are exact; the sampling streams are new (seeded from seed, step and "
                        "rank), so the rollouts differ from those of an uninterrupted run", world, saved)

    def newest(self) -> str | None:
        """The newest complete checkpoint, once the write in flight (if any) has finished (a failed write stays
        pending: the next ``wait`` raises it)."""
        self.writer.wait(raise_error=False)
        return newest_checkpoint(self.run_dir)

    def through(self, batch: int) -> list[Path]:
        """The complete checkpoints written before rollout batch ``batch + 1``, once the write in flight finished."""
        self.writer.wait()
        return checkpoints_through(self.run_dir, batch)

    def rollback_target(self, rewards_seen: dict[int, float | None]) -> int | None:
        """The step of the checkpoint a reward drop would roll back to (the newest holding a policy no later than the
        one that sampled the last batch of the best reward window so far: see ``sentinel.rollback_limit``), which
        pruning must keep however old it gets; None unless the sentinel rolls back on reward drops."""
        sc = self.cfg.sentinel
        peak = best_window_end(sc, rewards_seen) if sc.action == "rollback" else None
        # waits for the write in flight: it may be the one
        kept = self.through(peak - self.lag) if peak is not None else []
        return checkpoint_step(kept[-1]) if kept else None

    def before_collapse(self, trigger: int, rewards_seen: dict[int, float | None]) -> list[Path]:
        """The checkpoints a rollback after a collapse found at rollout batch ``trigger`` may go to, newest last: those
        rollback_limit allows, from before the batch before the trigger and, after a reward drop, from before the
        decline; when the reward peaked before the first checkpoint, those before the batch before the trigger, as
        for the other detectors."""
        sc = self.cfg.sentinel
        peak = best_window_end(sc, rewards_seen, before_newest=True) if reward_drop(sc, rewards_seen) else None
        lag = self.lag
        return self.through(rollback_limit(trigger, peak) - lag) or self.through(rollback_limit(trigger, None) - lag)

    @property
    def lag(self) -> int:
        """Batches between a checkpoint's policy and the batches it samples: a checkpoint resuming at batch b holds the
        weights that sample batch b + rollout.max_staleness (the ones before it are saved in it, already sampled)."""
        return self.cfg.rollout.max_staleness

    def abandon_after(self, step: int) -> None:
        """A rollback abandons the timeline after ``step``: its checkpoints are renamed out of the way (to
        ``rolled-back-step-N``, never taken for a checkpoint), so neither --resume nor a message can pick them."""
        for ckpt in complete_checkpoints(self.run_dir / "checkpoints"):
            if checkpoint_step(ckpt) > step:
                ckpt.rename(aside(ckpt, f"rolled-back-{ckpt.name}-{int(time.time())}"))
