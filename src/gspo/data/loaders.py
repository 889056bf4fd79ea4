"""Datasets from files: JSONL rows (GSM8K, MATH or any schema) and Hugging Face datasets, as lists of ``Example``.

A row becomes ``Example(prompt=template.format(question=row[prompt_field], **row), answer=<extracted>, meta=row
without the prompt field)``. How the reference answer is extracted from ``row[answer_field]``:

- ``"raw"``: the field as a string (``None`` stays ``None``).
- ``"gsm8k"``: the number after the final ``#### ``, commas removed (``"... #### 1,200"`` -> ``"1200"``).
- ``"boxed"``: the content of the last ``\\boxed{...}`` (braces balanced), as in MATH solutions.

A prompt field that already holds chat messages (a list of ``{"role", "content"}`` dicts) is used as is.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gspo.errors import UserError
from gspo.types import Example

ANSWER_FORMATS = ("raw", "gsm8k", "boxed")

GSM8K_TEMPLATE = "{question}\nSolve the problem step by step, then give the final number after 'Answer:'."
MATH_TEMPLATE = "{question}\nSolve the problem step by step and put the final answer in \\boxed{{}}."

_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text`` with braces balanced, else ``None``.

    ``\\boxed 5`` (no braces, seen in some MATH solutions) gives ``"5"``. An unclosed last box gives ``None``.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":
        token = text[i:].split(None, 1)
        return token[0].rstrip("$.") if token else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(value: Any, answer_format: str) -> str | None:
    """The reference answer in ``value`` under ``answer_format``; raises ``ValueError`` when it has none."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if answer_format == "raw":
        return text.strip()
    if answer_format == "gsm8k":
        m = _GSM8K_FINAL.search(text)
        if m is None:
            raise ValueError("has no final '#### <number>'")
        return m.group(1).replace(",", "").strip()
    if answer_format == "boxed":
        boxed = last_boxed(text)
        if boxed is None:
            raise ValueError("has no complete \\boxed{...}")
        return boxed
    raise UserError(f"answer_format={answer_format!r} is not known; use one of {list(ANSWER_FORMATS)}.")


def _check_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise UserError(f"answer_format={answer_format!r} is not known; use one of {list(ANSWER_FORMATS)}.")


def _row_to_example(
    row: Any, where: str, prompt_field: str, answer_field: str | None, answer_format: str, template: str
) -> Example:
    """One source row as an ``Example``; ``where`` (e.g. ``file:line``) prefixes every error message."""
    if not isinstance(row, Mapping):
        raise UserError(f"{where}: the row is a {type(row).__name__}, not a JSON object; write one object per line.")
    for field in (prompt_field, answer_field):
        if field is not None and field not in row:
            raise UserError(
                f"{where}: the row has no field {field!r} (it has {sorted(row)}); "
                "fix the row or set prompt_field/answer_field to the right names."
            )
    question = row[prompt_field]
    if isinstance(question, list):
        if not question or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in question):
            raise UserError(f"{where}: field {prompt_field!r} is a list but not a non-empty list of chat messages "
                            "{'role': ..., 'content': ...} with string values; fix the row, or give the question as a "
                            "string.")
        prompt: str | list[dict[str, str]] = [dict(m) for m in question]
    elif question is None or isinstance(question, (dict, bool)):
        raise UserError(f"{where}: field {prompt_field!r} is {json.dumps(question)[:40]}, not a question; give it a "
                        "string (or a list of chat messages).")
    else:
        try:
            prompt = template.format_map({**row, "question": question})
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise UserError(
                f"{where}: template {template!r} cannot be formatted ({type(e).__name__}: {e}); "
                "use {question} and the row's field names only, and double any literal braces."
            ) from None
    answer = None
    if answer_field is not None:
        if row[answer_field] is None and answer_format != "raw":
            raise UserError(f"{where}: field {answer_field!r} is null, but answer_format {answer_format!r} reads a "
                            "reference answer from it; give the row its answer, or drop the row.")
        try:
            answer = extract_answer(row[answer_field], answer_format)
        except ValueError as e:
            raise UserError(
                f"{where}: field {answer_field!r} {e}; fix the row or choose another answer_format "
                f"(one of {list(ANSWER_FORMATS)})."
            ) from None
    meta = {k: v for k, v in row.items() if k != prompt_field}
    return Example(prompt=prompt, answer=answer, meta=meta)


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # also the start of UTF-32's
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_line(raw: bytes, where: str) -> Any:
    """One JSONL line's value, or one line naming ``where`` (``file:line``) and what is wrong with its bytes or JSON.

    Here, not in the callers, because a line can fail in more ways than ``json.loads`` names: bytes that are not
    UTF-8 (a Latin-1 or Windows-1252 export), NUL bytes (a binary file, UTF-16), nesting deep enough to exhaust the
    parser's recursion, an integer past Python's 4,300-digit limit."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8; save the file as "
                        "UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW).") from None
    if "\x00" in line:
        raise UserError(f"{where}: the line holds a NUL byte at column {line.index(chr(0)) + 1}, which JSON text "
                        "cannot (a binary file?); pass a UTF-8 JSONL file.")
    try:
        value = json.loads(line.lstrip("\ufeff"))  # a byte-order mark (Windows editors write one): JSON may ignore it
        if _SURROGATE_ESCAPE.search(line):  # "\ud800" alone parses to a string no tokenizer can encode
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except UnicodeEncodeError:
        raise UserError(f"{where}: the line escapes half of a UTF-16 surrogate pair (\\ud800-\\udfff without its "
                        "partner), which is no character; fix the escape or delete that line.") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: the line is not valid JSON ({e.msg} at column {e.colno}); fix or delete that "
                        "line.") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{where}: the line cannot be read as JSON ({type(e).__name__}: {str(e)[:80]}); fix or delete "
                        "that line.") from None


def _read_jsonl(path: str | os.PathLike) -> Iterable[tuple[int, Any]]:
    """``(line number, parsed row)`` for every non-blank line of ``path``; UserError on a missing file or bad line.

    The one place a data file's bytes enter: everything that can be wrong with them ends in one line naming the file
    and the line (a row that parses but is not an object is named by the row's own check)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UserError(f"data file {path!r} does not exist; pass the path of a JSONL file (one JSON object per line).")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"data file {path!r} cannot be read ({e.strerror}); check its permissions.") from None
    with f:
        for lineno, raw in enumerate(_lines(f, path), 1):
            if lineno == 1 and raw.startswith(_UTF16_BOMS):
                raise UserError(f"data file {path!r} is UTF-16 or UTF-32 (it starts with that byte-order mark); save "
                                "it as UTF-8 (e.g. iconv -f utf-16 -t utf-8 FILE > NEW).")
            if not raw.strip(b" \t\r\n\x0b\x0c"):
                continue
            yield lineno, _parse_line(raw, f"{path}:{lineno}")


def _lines(f, path: str) -> Iterable[bytes]:
    """The file's lines (split at newlines only, as JSONL counts them); a read error mid-file is one line too."""
    try:
        yield from f
    except OSError as e:
        raise UserError(f"data file {path!r} could not be read to the end ({e.strerror}); check the disk or copy the "
                        "file again.") from None


def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "question",
    answer_field: str | None = "answer",
    answer_format: str = "raw",
    template: str = "{question}",
) -> list[Example]:
    """Every row of the JSONL file ``path`` as an ``Example`` (see the module docstring for the mapping).

    ``answer_field=None`` gives examples without a reference answer (for reward functions that need none).
    """
    _check_format(answer_format)
    examples = [
        _row_to_example(row, f"{os.fspath(path)}:{lineno}", prompt_field, answer_field, answer_format, template)
        for lineno, row in _read_jsonl(path)
    ]
    if not examples:
        raise UserError(f"data file {os.fspath(path)!r} has no rows; pass a JSONL file with one JSON object per line.")
    return examples


def gsm8k(path: str | os.PathLike, template: str | None = None) -> list[Example]:
    """GSM8K rows (``question``; ``answer`` ending in ``#### <number>``) with the final number as the answer."""
    return load_jsonl(
        path, prompt_field="question", answer_field="answer", answer_format="gsm8k", template=template or GSM8K_TEMPLATE
    )


def math_jsonl(
    path: str | os.PathLike,
    template: str | None = None,
    *,
    prompt_field: str = "problem",
    answer_field: str | None = None,
) -> list[Example]:
    """MATH-style rows (``problem`` plus ``answer`` or a ``solution`` with ``\\boxed{}``) as examples.

    With ``answer_field=None`` the file's first row decides: a row with an ``answer`` field (as in MATH-500) uses it
    as is, otherwise the last ``\\boxed{}`` of ``solution`` is the answer. Naming a field: ``"answer"`` is taken raw,
    any other field is searched for its last ``\\boxed{}``.
    """
    if answer_field is None:
        first = next(iter(_read_jsonl(path)), (0, {}))[1]
        answer_field = "answer" if isinstance(first, Mapping) and "answer" in first else "solution"
    answer_format = "raw" if answer_field == "answer" else "boxed"
    return load_jsonl(
        path,
        prompt_field=prompt_field,
        answer_field=answer_field,
        answer_format=answer_format,
        template=template or MATH_TEMPLATE,
    )


def load_hf_dataset(
    name: str,
    split: str = "train",
    *,
    config: str | None = None,
    prompt_field: str = "question",
    answer_field: str | None = "answer",
    answer_format: str = "raw",
    template: str = "{question}",
) -> list[Example]:
    """The rows of Hugging Face dataset ``name`` (``split``, optional ``config``), mapped as JSONL rows are."""
    _check_format(answer_format)
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"loading the Hugging Face dataset {name!r} needs the datasets package; run `pip install datasets`."
        ) from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # the library raises many types (network, missing split, bad name)
        raise UserError(
            f"could not load Hugging Face dataset {name!r} (config={config!r}, split={split!r}): "
            f"{type(e).__name__}: {e}; check the name, config and split."
        ) from None
    examples = [
        _row_to_example(row, f"{name}[{split}] row {i}", prompt_field, answer_field, answer_format, template)
        for i, row in enumerate(rows)
    ]
    if not examples:
        raise UserError(f"Hugging Face dataset {name!r} split {split!r} has no rows; choose another split.")
    return examples
