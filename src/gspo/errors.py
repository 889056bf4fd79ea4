"""The one exception type for mistakes a user can make (bad config, bad data row, missing model...)."""


class UserError(Exception):
    """An error the user caused; its message names the input and the fix."""
