"""Reward functions and the runner that scores completions with them.

A reward function is any importable callable ``fn(completion: str, example: gspo.types.Example) -> float``:

- ``completion`` is the decoded model output (special tokens removed); ``example`` is the task instance it
  answers, with the reference ``example.answer`` (may be ``None``) and the source row's fields in ``example.meta``.
- It returns a finite number (a bool is read as 0/1). Returning ``None``, a string, NaN or inf is a bug in the
  function and stops training with a UserError naming it; raising marks just that completion as failed (NaN).
- Name it in a config as ``"module:function"``; the module is imported in each worker process, so it must be
  importable from the directory training starts in (or from ``PYTHONPATH``). A script that starts training must
  guard its entry point with ``if __name__ == "__main__":``, as workers re-import the main module (they start
  from a ``forkserver``, like ``spawn``).
- It runs in the main thread of a worker process and is killed if it exceeds the runner's ``timeout_s``.
- Optional: a ``warm_up`` attribute (a callable taking no arguments) is called once when each worker starts,
  outside the time limit, to pay one-off set-up costs (``math_verify_boxed`` uses it to load sympy).

Built-ins live in ``gspo.rewards.builtin``: ``last_number``, ``gsm8k_number``, ``math_verify_boxed``,
``format_answer_tag``.
"""
__all__ = ["RewardFn", "RewardResult", "RewardRunner", "RewardSpec", "resolve"]


def __getattr__(name: str):
    # Lazy: reward worker processes import gspo.rewards.* and must not pay for the runner's torch import.
    if name in __all__:
        from gspo.rewards import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'gspo.rewards' has no attribute {name!r}")
