"""A reward for the `gspo compare --jobs` fault tests: faults in chosen runs, picked by their run directory.

With ``rewards.workers = 0`` rewards are scored in the trainer's own process, whose command line names its run
directory (``--run-dir <out>/<arm>-seed<seed>``), so each run of one compare command can be told apart:

- ``GSPO_TEST_FAIL_RUN=<run>``: every call raises in that run (its first batch fails: a broken verifier).
- ``GSPO_TEST_HOLD_RUNS=<run>,<run>`` and ``GSPO_TEST_HOLD=<file>``: in those runs, from the second rollout batch of
  the process (call 9 of the tiny config's 8 a batch), the call creates ``<file>.<run>`` and waits while ``<file>``
  exists: the test acts on the run at that moment (the first batch trained and checkpointed), then releases it.
"""
import os
import sys
import time

_CALLS = []


def _run() -> str:
    return os.path.basename(sys.argv[sys.argv.index("--run-dir") + 1])


def text_length_unless(completion, example):
    """Text length, with the faults above in the runs the environment names."""
    run = _run()
    if os.environ.get("GSPO_TEST_FAIL_RUN") == run:
        raise RuntimeError(f"broken verifier in {run}")
    _CALLS.append(1)
    hold = os.environ.get("GSPO_TEST_HOLD")
    if hold and run in os.environ.get("GSPO_TEST_HOLD_RUNS", "").split(",") and len(_CALLS) > 8:
        open(f"{hold}.{run}", "w").close()
        while os.path.exists(hold):
            time.sleep(0.05)
    return len(completion) / 100.0
