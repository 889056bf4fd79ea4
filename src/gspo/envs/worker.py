"""The environment worker process's side: build the user's environment class and tools, keep one environment object
per trajectory, and answer the trainer's calls one by one (:func:`load`, run by :func:`gspo.workers.child.main`;
:class:`Host` holds them, in the parent too with ``env.workers = 0``). Standard library only (and gspo's torch-free
modules), so the fork server that starts the workers (:mod:`gspo.workers`, shared with the reward workers) is ready
in a fraction of a second.

A call is ``(call id, trajectory id, op, payload)``:

- ``"reset"``, payload the example: make the trajectory's environment and call ``reset(example)``; answers its
  messages (``None``: the example's own prompt);
- ``"step"``, payload the assistant's reply text: ``step(reply)``; answers ``(messages, reward, done)``;
- ``"tool"``, payload ``(name, arguments)``: the tool's result as text;
- ``"schemas"``: the tools' JSON schemas, from their type hints and docstrings, for the chat template's ``tools=``;
- ``"drop"``: forget the trajectory's environment (no answer).

Each answer is ``(call id, "ok", value)`` or ``(call id, "err", message)`` for a call that raised or returned
something outside the contract; a call that hangs is the parent's to time out (it kills this process).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from gspo import user_code
from gspo.errors import UserError

ENV_EXAMPLE = "gspo.envs.builtin:GuessNumber"
TOOL_EXAMPLE = "gspo.envs.builtin:calculator"
MAX_TOOL_CHARS = 2000  # a tool's result past this is cut (and says so): the model's context is not the tool's log
MAX_OBSERVATION_CHARS = 20_000  # an observation message past this is cut too (rendering megabytes would stall the run)


def resolve_env(path: str) -> Any:
    """The environment class ``"module:Class"`` names (the current folder is searched too)."""
    cls = user_code.load_function(path, f"env.path = {path!r}", ENV_EXAMPLE)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise UserError(f"env.path = {path!r} is not a class with a step(reply) method; point it at one (see "
                        f"{ENV_EXAMPLE}).")
    return cls


def resolve_tool(path: str) -> Callable:
    """The tool function ``"module:function"`` names."""
    return user_code.load_function(path, f"env.tools entry {path!r}", TOOL_EXAMPLE)


def as_messages(value: Any, what: str, role: str) -> list[dict[str, str]]:
    """A string (one message of ``role``) or a list of ``{"role", "content"}`` string dicts; else ValueError."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{what} returned {value!r:.80}; return a string or a non-empty list of "
                     "{'role': ..., 'content': ...} messages with string values")


def _step_result(value: Any) -> tuple[list[dict[str, str]], float, bool]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"step returned {value!r:.80}; return (observation, reward, done)")
    observation, reward, done = value
    messages = [] if observation is None or observation == "" else as_messages(observation, "step", "user")
    messages = [{**m, "content": _cut(m["content"], MAX_OBSERVATION_CHARS)} for m in messages]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise ValueError(f"step returned the reward {reward!r:.40}; return a finite number")
    if not isinstance(done, bool):
        raise ValueError(f"step returned done = {done!r:.40}; return True or False")
    if not done and not messages:
        raise ValueError("step returned no observation for a trajectory that is not done; the model needs a message "
                         "to answer")
    return messages, float(reward), done


def tool_text(value: Any) -> str:
    """A tool's return value as the text of its message: strings as they are, anything else as JSON (or ``repr``);
    cut to MAX_TOOL_CHARS."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False, default=repr)
        except (TypeError, ValueError, RecursionError):
            value = repr(value)
    return _cut(value, MAX_TOOL_CHARS)


def _cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and a note of the whole length."""
    return text if len(text) <= limit else text[:limit] + f"... [cut: {len(text)} characters]"


def _schema(path: str, fn: Callable) -> dict:
    """The tool's JSON schema for the chat template's ``tools=``, read by transformers from its type hints and its
    Google-style docstring (transformers.utils imports no torch; at start-up, under the workers' loading limit)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' own parsing errors, and whatever a strange object raises
        raise UserError(f"env.tools entry {path!r} cannot be described to the model ({type(e).__name__}: {e}); give "
                        "it type hints and a Google-style docstring with an Args: section.") from e


class Host:
    """What one worker holds: the environment class, the tools by name, one environment per live trajectory."""

    def __init__(self, env_path: str | None, tool_paths: list[str]):
        self.env_cls = resolve_env(env_path) if env_path else None
        self.tools = {}
        self.schemas: list[dict] = []
        paths: dict[str, str] = {}
        for path in tool_paths:
            fn = resolve_tool(path)
            name = getattr(fn, "__name__", path.rpartition(":")[2])
            if name in paths:  # the model calls tools by name: one would answer for both
                raise UserError(f"env.tools entries {paths[name]!r} and {path!r} are both named {name!r}, so the "
                                "model could not tell them apart; rename one of the functions.")
            paths[name] = path
            self.tools[name] = fn
            self.schemas.append(_schema(path, fn))
        self.envs: dict[int, Any] = {}

    def call(self, op: str, traj: int, payload: Any) -> tuple[str, Any]:
        try:
            if op == "reset":
                env = self.envs[traj] = self.env_cls()
                reset = getattr(env, "reset", None)
                messages = reset(payload) if callable(reset) else None
                return "ok", None if messages is None else as_messages(messages, "reset", "user")
            if op == "step":
                return "ok", _step_result(self.envs[traj].step(payload))
            if op == "tool":
                name, arguments = payload
                return "ok", tool_text(self.tools[name](**arguments))
            if op == "schemas":
                return "ok", self.schemas
            if op == "drop":
                self.envs.pop(traj, None)
                return "ok", None
            return "err", f"unknown operation {op!r}"
        except Exception as e:  # the user's code can fail in any way: that trajectory fails, not the run
            return "err", f"{type(e).__name__}: {e}"[:300]


def load(env_path: str | None, tool_paths: list[str]) -> Callable[[tuple], tuple | None]:
    """In a worker (:func:`gspo.workers.child.main`): build the host, and give the function that answers one call."""
    host = Host(env_path, tool_paths)

    def answer(c: tuple) -> tuple | None:
        call_id, traj, op, payload = c
        status, value = host.call(op, traj, payload)
        return None if op == "drop" else (call_id, status, value)

    return answer
