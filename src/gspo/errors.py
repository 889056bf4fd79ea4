"""The one exception type for mistakes a user can make (bad config, bad data row, missing model...)."""


class UserError(Exception):
    """An error the user caused; its message names the input and the fix."""


class RunStopped(UserError):
    """A run that stopped itself by one of its own rules (the collapse sentinel, ``train.max_nonfinite_steps``): a
    result to report, not a fault to fix and retry (``gspo compare`` keeps such a run, marked, in its report)."""


STOPPED_FILE = "stopped.json"  # in a run directory: the step and reason of a RunStopped, until the run is resumed
