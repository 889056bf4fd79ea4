"""A reward module whose import holds the trainer's start-up (``rewards.workers = 0`` imports it in the trainer's own
process, before the model is trained on): it creates the file ``$GSPO_TEST_HOLD.import`` and waits while
``$GSPO_TEST_HOLD`` exists, so a test can signal the process at that moment."""
import os
import time

_HOLD = os.environ.get("GSPO_TEST_HOLD")
if _HOLD:
    open(f"{_HOLD}.import", "w").close()
    while os.path.exists(_HOLD):
        time.sleep(0.05)


def text_length(completion, example):
    return len(completion) / 100.0
