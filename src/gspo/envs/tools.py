"""Tool calls in the model's own format, parsed from a turn's text, and tools described to templates that have no
``tools=`` support.

Formats (what the families were tuned on):

- ``hermes`` (Qwen 2.5 / 3, Hermes, SmolLM3, and gspo's choice for templates without tool support):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn;
- ``llama3``: the turn is one JSON object ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``);
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}``.

A call that cannot be read (bad JSON, no name, arguments that are not an object, an unknown tool) is not an error of
the run: it becomes a tool message saying what was wrong, which the model sees in its next turn (and a metric).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "hermes", "llama3", "mistral")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call as the model wrote it: ``name`` and ``arguments``, or ``error`` when it could not be read."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template's own text implies; ``hermes`` where it names none."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def _one(obj: Any, args_key: str, tools: set[str]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, "a tool call must be a JSON object with a \"name\" string, got "
                        f"{json.dumps(obj)[:80]}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} must be a JSON object")
    if obj["name"] not in tools:
        return ToolCall(obj["name"], args, f"there is no tool named {obj['name']!r}; the tools are {sorted(tools)}")
    return ToolCall(obj["name"], args)


def _json(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as e:
        return None, f"the tool call is not valid JSON ({str(e)[:60]}): {text.strip()[:80]!r}"


def parse_calls(text: str, fmt: str, tools: set[str]) -> list[ToolCall]:
    """The tool calls in one assistant turn's text (none: the turn is an answer)."""
    if fmt == "hermes":
        calls = []
        for body in _HERMES.findall(text):
            obj, error = _json(body)
            calls.append(ToolCall(None, {}, error) if error else _one(obj, "arguments", tools))
        return calls
    if fmt == "mistral":
        if "[TOOL_CALLS]" not in text:
            return []
        obj, error = _json(text.split("[TOOL_CALLS]", 1)[1])
        if error:
            return [ToolCall(None, {}, error)]
        return [_one(o, "arguments", tools) for o in (obj if isinstance(obj, list) else [obj])]
    body = text.replace("<|python_tag|>", "").strip()  # llama3: the whole turn is the call, or it is an answer
    if not body.startswith("{"):
        return []
    obj, error = _json(body)
    return [ToolCall(None, {}, error) if error else _one(obj, "parameters", tools)]


def system_text(schemas: list[dict], fmt: str) -> str:
    """Tool descriptions for a system message, where the template cannot render ``tools=`` itself."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    how = {"hermes": 'wrap each call in <tool_call></tool_call> tags as {"name": <tool>, "arguments": {...}}',
           "llama3": 'reply with only {"name": <tool>, "parameters": {...}}',
           "mistral": 'reply with [TOOL_CALLS] and a JSON list of {"name": <tool>, "arguments": {...}}'}[fmt]
    return (f"You can call these tools:\n<tools>\n{listing}\n</tools>\nTo call a tool, {how}. A tool's result comes "
            "back in the next message; when you have the answer, give it without a tool call.")
