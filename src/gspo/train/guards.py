"""What stands between the loop and the ways a run ends badly: stop signals, GPU out-of-memory, non-finite steps."""
from __future__ import annotations

import _thread
import contextlib
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch

from gspo.errors import RunStopped, UserError
from gspo.runtime import gpu_memory_cap

log = logging.getLogger("gspo")


class StopSignals:
    """While active, SIGINT / SIGTERM set ``received`` (the loop finishes the rollout batch being trained, writes a
    checkpoint and returns); a second signal stops at once. Checkpoints sit at rollout-batch boundaries, so that is
    where a resumed run continues bit for bit. Outside the main thread (where handlers cannot be set) it does nothing.

    Why a watcher thread: Python runs a signal handler only between bytecodes of the main thread, and a long native
    call (a backward pass: one update took 116 s on a CPU emulating bf16, issue 33) holds it off that long. The
    C-level handler also writes the signal's number to a pipe (``signal.set_wakeup_fd``), which the watcher reads at
    once: it acknowledges the first signal when it comes, and after a second it interrupts the main thread
    (``KeyboardInterrupt`` at its next bytecode) and, if the main thread is still inside native code ``grace_s``
    later, flushes the log and ends the process (exit 130 / 143). Every line written so far is flushed per line and
    checkpoints are complete or absent, so the run directory stays valid.

    A SIGTERM repeated within ``repeat_s`` of the first is the same request delivered twice, not a second one: GNU
    ``timeout`` signals the command and then its whole process group, and a job manager may do the same. Taken as a
    second signal, it stopped ``timeout 300 gspo train ...`` without its checkpoint. (Ctrl-C reaches each process once,
    so two SIGINTs are always two presses.)"""

    def __init__(self, describe=lambda: "the current rollout batch", grace_s: float = 5.0, repeat_s: float = 1.0,
                 kept: Callable[[], str] | None = None):
        """``kept``: what the run directory holds to go on from, said when the process must exit from here (the
        command's own last line, which says it otherwise, never comes then)."""
        self.received: str | None = None
        self._describe = describe
        self._kept = kept
        self._grace_s = grace_s
        self._repeat_s = repeat_s
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._count = 0
        self._interrupted = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._old_wakeup = -1

    def _handler(self, signum, frame):
        # The count is the watcher's (it sees every signal; Python coalesces repeats of one signal into one call).
        with self._lock:
            raise_now = self._count >= 2 and not self._interrupted
            self._interrupted = self._interrupted or raise_now
        if raise_now:
            raise KeyboardInterrupt

    def _seen(self, signum: int) -> None:
        """The watcher's reaction to one signal."""
        name = signal.Signals(signum).name
        with self._lock:
            if (self._count == 1 and signum == signal.SIGTERM and self.received == name
                    and time.monotonic() - self._first_at < self._repeat_s):
                return  # the first SIGTERM delivered again (to the process and to its group)
            self._count += 1
            count = self._count
            if count == 1:
                self._first_at = time.monotonic()
        if count == 1:
            self.received = name
            log.warning("%s: finishing %s, then writing a checkpoint (%s again to stop now)", name, self._describe(),
                        "Ctrl-C" if name == "SIGINT" else name)
            return
        if count == 2:
            # (what the run directory keeps is said once, when it is known: by the command's last line, or below)
            log.warning("%s again: stopping now, without writing a checkpoint", name)
            _thread.interrupt_main(signum)
            if not self._done.wait(self._grace_s):  # still inside one native call: end the process from here
                log.warning("the running computation did not return within %.0f s; exiting%s", self._grace_s,
                            f": the run directory {self._kept()}" if self._kept is not None else "")
                for handler in logging.getLogger().handlers + log.handlers:
                    handler.flush()
                os._exit(130 if signum == signal.SIGINT else 143)

    def _watch(self, fd: int) -> None:
        """Read signal numbers until the write end closes (the guard is over), then close the read end."""
        try:
            while data := os.read(fd, 64):
                for signum in data:
                    if signum in (signal.SIGINT, signal.SIGTERM) and not self._done.is_set():
                        self._seen(signum)
        finally:
            os.close(fd)

    def __enter__(self) -> "StopSignals":
        self.received = None
        self._count, self._interrupted = 0, False
        self._done.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
            r, w = os.pipe()
            os.set_blocking(w, False)  # the C handler must never block on a full pipe
            self._pipe = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, args=(r,), name="gspo-signals", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._pipe[1])  # the watcher's read returns empty: it closes the read end and ends
            self._pipe = None
            # Gone before the guard is: a daemon thread still running when the interpreter finalises is ended with
            # pthread_exit, whose forced unwinding aborted the process ("terminate called without an active
            # exception", exit 134) in about one run in three.
            self._watcher.join(timeout=5)
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()


@contextlib.contextmanager
def out_of_memory(phase: str, step: Callable[[], int], newest_checkpoint: Callable[[], str | None]):
    """GPU out-of-memory in a phase of the loop ends in one line naming the knobs of that phase, the step it happened
    at and the newest checkpoint (both asked for only then)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        knobs = ("rollout.prompts_per_batch x rollout.group_size or rollout.max_new_tokens" if phase == "the rollout"
                 else "train.micro_batch_size (or turn on model.gradient_checkpointing)")
        newest = newest_checkpoint()
        last = f"the last checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"
        share = gpu_memory_cap()
        if share is not None:  # the cap, not the GPU, may be what ran out
            knobs += (f", or give the run more than model.gpu_memory = {share} of the GPU (gspo compare --jobs sets it "
                      "when runs share a GPU: run fewer at once; rollout.decode_gpu = 'shared' splits a GPU among its "
                      "processes: set model.gpu_memory yourself)")
        raise UserError(f"The GPU ran out of memory in {phase} at step {step()}; lower {knobs}; {last}.") from e


class NonFiniteSteps:
    """Counts optimizer steps whose loss or gradient norm was not finite (the actor skipped them) and stops the run
    after ``limit`` in a row."""

    def __init__(self, limit: int, total: int = 0):
        self.limit = limit
        self.total = total
        self.in_row = 0

    def record(self, finite: bool, step: int) -> None:
        """Count optimizer step ``step`` (1-based); raise once ``limit`` non-finite steps came in a row."""
        if finite:
            self.in_row = 0
            return
        self.total += 1
        self.in_row += 1
        log.warning("non-finite loss or gradient at step %d: optimizer step skipped", step)
        if self.in_row >= self.limit:
            raise RunStopped(f"{self.in_row} optimizer steps in a row had a non-finite loss or gradient (last at step "
                             f"{step}); lower train.lr or try model.precision = 'fp32'. The last checkpoint is intact.")


LOCK_FILE = ".lock"


def lock_run_dir(run_dir):
    """An exclusive lock on ``run_dir`` for this process (released when the returned file is closed, or by the OS when
    the process dies): two processes training in one directory (a requeued job whose predecessor still runs) would
    interleave their metrics lines and delete each other's temporary checkpoints."""
    import os

    f = open(run_dir / LOCK_FILE, "a+")
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks to take
        return f
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # Lustre without flock, NFS without a lock daemon: no lock to take, but no reason to refuse the run.
            log.warning("%s cannot be locked on this file system (%s); nothing stops a second process from using it",
                        run_dir, e.strerror or e)
            return f
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise UserError(f"Run directory {str(run_dir)!r} is in use by another gspo process (pid {holder}); wait for it "
                        "to finish or stop it, or choose another log.run_dir.") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError:  # the pid is only for the message of a second process; the lock itself holds
        pass
    return f


_COLLECTIVE_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                     "pair closure")


def _raised_in_a_collective(e: BaseException) -> bool:
    """Whether ``e`` came out of a torch.distributed collective (gloo words a lost peer in many ways: "Connection closed
    by peer", "Application timeout caused pair closure", ...): its innermost frames are torch.distributed's."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and "torch/distributed" in last.replace("\\", "/")


@contextlib.contextmanager
def dist_failures(trainer):
    """Under ``torchrun``: a collective that failed because another process is gone (crashed, killed: its connection
    closed) or hangs (no answer within ``dist.timeout_s``) ends the run in one line that names the last complete
    checkpoint, instead of a traceback from deep inside torch.distributed."""
    from gspo.parallel import comm

    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        if not comm.in_job() or not (isinstance(e, torch.distributed.DistError) or _raised_in_a_collective(e)
                                     or any(s in text for s in _COLLECTIVE_SIGNS)):
            raise
        newest = trainer.checkpoints.newest()
        last = f"the last complete checkpoint is {newest}" if newest else "no checkpoint was written yet"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()  # in the job (decoders too)
        raise comm.PeerLost(f"Process {rank} of {world} lost the others in a "
                            f"collective ({first}): another process crashed, was killed, or hung longer than "
                            f"dist.timeout_s = {trainer.cfg.dist.timeout_s:g} s; {last}. Fix the cause (the error of the "
                            "process that failed first), then --resume.",
                            waited="timed out" in text or "timeout" in text) from e
