"""Built-in reward functions, each ``fn(completion: str, example: Example) -> float``.

Name them in a config as ``"gspo.rewards.builtin:<function>"``. They return 1.0 or 0.0 and raise only on a
broken example (e.g. no reference answer), which the runner counts as a failure.
"""
from __future__ import annotations

import math
import re
import threading

from gspo.example import Example

# A number is an integer with optional thousands separators ("1,000") and an optional decimal part. A minus sign
# counts only where it cannot be a binary minus ("10-3" ends in 3, not -3).
_NUMBER = r"(?:(?<![\d.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_MONEY_RE = re.compile(r"(?:(?<![\d.])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FINAL_MARK_RE = re.compile(r"Answer:|####")
_ANSWER_TAG_RE = re.compile(r"Answer:\s*[*_]*\s*\$?\s*-?\s*\d")

# math-verify limits per call, in whole seconds (it uses signal.alarm). Two parses plus one verify stay under the
# runner's default 10 s hard limit, so a slow sympy call scores 0.0 instead of being killed.
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 3


def _to_float(token: str) -> float:
    """A matched number token as a float: ``"$1,000.50"`` -> ``1000.5``."""
    return float(token.replace(",", "").replace("$", ""))


def _gold(example: Example) -> str:
    """The example's reference answer, or a ValueError saying the example needs one."""
    if example.answer is None:
        raise ValueError("the example has no reference answer; this reward needs Example.answer set")
    return example.answer


def last_number(completion: str, example: Example) -> float:
    """1.0 if the last number in ``completion`` equals the integer ``example.answer``, else 0.0.

    Thousands separators are read (``1,000`` is 1000); a decimal counts only if it is a whole number (``12.0``).
    """
    gold = int(_gold(example).replace(",", "").strip())
    numbers = _NUMBER_RE.findall(completion)
    if not numbers:
        return 0.0
    return float(_to_float(numbers[-1]) == gold)


_STEP_RE = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)\s*=\s*(-?\d+)")


def running_sum_step_spans(completion: str, example: Example) -> list[tuple[int, float]]:
    """The ``running_sum`` task's steps: ``(end, credit)`` for each ``x + y = z`` line of ``completion``, in order,
    ``end`` the character index just past it. Line ``i`` is right (credit 1) when ``x`` is the true total of the
    numbers before ``i``, ``y`` is number ``i`` and ``z = x + y``; a skipped or extra line shifts the ones after it,
    which then count as wrong. Lines past the last number are not steps."""
    numbers = example.meta.get("numbers")
    if not numbers:
        raise ValueError("the example has no meta['numbers']; running_sum_steps scores the running_sum task")
    total, steps = 0, []
    for match, term in zip(_STEP_RE.finditer(completion), numbers):
        x, y, z = (int(v) for v in match.groups())
        steps.append((match.end(), float(x == total and y == term and z == total + term)))
        total += term
    return steps


def running_sum_steps(completion: str, example: Example) -> float:
    """Partial credit for the ``running_sum`` task: the fraction of its numbers whose line is right, in order (see
    :func:`running_sum_step_spans`)."""
    return sum(c for _, c in running_sum_step_spans(completion, example)) / len(example.meta["numbers"])


_NUMBERED_LINE_RE = re.compile(r"^\s*(\d+)\s*[.)]\s*(.*)$", re.MULTILINE)


def numbered_words_line_spans(completion: str, example: Example) -> list[tuple[int, float]]:
    """The ``numbered_words`` task's steps: ``(end, credit)`` for each numbered line, in order, ``end`` the character
    index just past it. Line ``k`` (the ``k``-th line that starts with a number and ``.`` or ``)``) is right when that
    number is ``k`` and the line holds word ``k`` as a whole word (any case); a skipped or extra line shifts the ones
    after it."""
    words = example.meta.get("words")
    if not words:
        raise ValueError("the example has no meta['words']; numbered_words_lines scores the numbered_words task")
    steps = []
    for k, (match, word) in enumerate(zip(_NUMBERED_LINE_RE.finditer(completion), words), start=1):
        number, text = match.groups()
        right = int(number) == k and re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None
        steps.append((match.end(), float(right)))
    return steps


def numbered_words_lines(completion: str, example: Example) -> float:
    """Partial credit for the ``numbered_words`` task: the fraction of its words whose line is right, in order (see
    :func:`numbered_words_line_spans`)."""
    return sum(c for _, c in numbered_words_line_spans(completion, example)) / len(example.meta["words"])


def gsm8k_number(completion: str, example: Example) -> float:
    """1.0 if the completion's final number equals ``example.answer`` numerically, else 0.0.

    The final number is the first one after the last ``Answer:`` or ``####`` when that text holds one (so
    ``Answer: 18 eggs in 2 days`` reads 18), else the last in the whole completion; ``$``, commas and decimals
    are allowed (``$1,200.00`` equals ``1200``).
    """
    gold = _to_float(_gold(example).strip())
    marks = list(_FINAL_MARK_RE.finditer(completion))
    found = _MONEY_RE.search(completion, marks[-1].end()) if marks else None
    if found is not None:
        pred = _to_float(found.group())
    else:
        numbers = _MONEY_RE.findall(completion)
        if not numbers:
            return 0.0
        pred = _to_float(numbers[-1])
    return float(math.isclose(pred, gold, rel_tol=1e-9, abs_tol=1e-6))


_GOLD_CACHE: dict[str, list] = {}


def _parse_gold(gold: str, parsing_timeout: int | None) -> list:
    """The parsed reference answer; cached because each prompt's answer is scored once per sampled completion."""
    if gold in _GOLD_CACHE:
        return _GOLD_CACHE[gold]
    from math_verify import parse

    # Boxing the gold makes math-verify read it as LaTeX ("\frac{1}{2}") and as a plain number ("0.5") alike.
    text = gold if "\\boxed" in gold or "$" in gold else f"\\boxed{{{gold}}}"
    parsed = parse(text, parsing_timeout=parsing_timeout)
    if parsed:  # a failed (e.g. timed-out) parse is retried next time rather than remembered
        if len(_GOLD_CACHE) >= 4096:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[gold] = parsed
    return parsed


def math_verify_boxed(completion: str, example: Example) -> float:
    """1.0 if math-verify finds the completion's final answer (its last ``\\boxed{}``, else a final expression)
    mathematically equal to ``example.answer``, else 0.0.

    math-verify's own time limits use ``signal.alarm``, which works only in the main thread: they are on there
    (as in the runner's worker processes) and off elsewhere, where the runner's hard limit is the only guard.
    """
    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout = PARSE_TIMEOUT_S if on_main else None
    gold = _parse_gold(_gold(example).strip(), parse_timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the reference answer {example.answer!r}")
    pred = parse(completion, parsing_timeout=parse_timeout)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=VERIFY_TIMEOUT_S if on_main else None))


def _warm_up_math_verify() -> None:
    """Pay math-verify's one-off set-up (about a second of sympy and LaTeX-grammar loading) before any timed call."""
    math_verify_boxed("\\boxed{\\frac{1}{2}}", Example(prompt="", answer="0.5"))


# The runner's workers call a reward's warm_up once at start-up, outside the per-call time limit.
math_verify_boxed.warm_up = _warm_up_math_verify  # type: ignore[attr-defined]


def format_answer_tag(completion: str, example: Example) -> float:
    """1.0 if the completion contains ``Answer:`` followed by a number, else 0.0: a small shaping reward."""
    return float(_ANSWER_TAG_RE.search(completion) is not None)
