"""Built-in generated tasks: infinite, deterministic streams of examples with a known answer.

Example ``i`` of a task depends only on ``(seed, i)``, so any position of the stream can be regenerated after a
resume without storing the examples.
"""
from __future__ import annotations

import operator
import random
from collections.abc import Sequence

from gspo.errors import UserError
from gspo.types import Example

STREAM_LEN = 2**31 - 1
"""``len()`` of a generated task: the stream is infinite, but ``Sequence`` consumers need a finite length."""

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operators ``ArithmeticTask`` can draw, by the symbol shown in the prompt."""

DEFAULT_TEMPLATE = "What is {a} {op} {b}? Put the final answer after 'Answer:'."


def _check_range(name: str, value: Sequence[int]) -> tuple[int, int]:
    """``value`` as an inclusive ``(lo, hi)`` pair of ints, or a UserError naming ``name``."""
    try:
        lo, hi = value
        if int(lo) != lo or int(hi) != hi:
            raise ValueError
        lo, hi = int(lo), int(hi)
    except (TypeError, ValueError):
        raise UserError(f"{name}={value!r} is not a pair of integers; pass it as [lo, hi], e.g. [1, 20].") from None
    if lo > hi:
        raise UserError(f"{name}={value!r} has lo > hi; pass it as [lo, hi] with lo <= hi.")
    return lo, hi


class _GeneratedTask(Sequence[Example]):
    """An infinite stream whose example ``i`` is ``self.make(rng)`` with ``rng`` seeded from ``(seed, i)`` only."""

    seed: int

    def __len__(self) -> int:
        return STREAM_LEN

    def __getitem__(self, i: int) -> Example:  # type: ignore[override]
        """Example ``i`` of the stream; the same ``(seed, i)`` always gives the same example."""
        if isinstance(i, slice):
            raise TypeError(f"{type(self).__name__} is an infinite stream and cannot be sliced; index one position at "
                            "a time.")
        if not 0 <= i < STREAM_LEN:
            raise IndexError(f"index {i} is outside the stream [0, {STREAM_LEN})")
        # (seed, i) -> one integer without collisions for i < 2**32; random.Random(int) is stable across runs.
        return self.make(random.Random(self.seed * 2**32 + i))

    def make(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def _setup(self, seed: int, terms: Sequence[int], template: str, **fields: str) -> None:
        """Check and keep the seed, the ``terms`` range (how many items a prompt lists) and a template with ``{n}``
        and the task's own ``fields``."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed={seed!r} is not an integer; pass an int such as 0.")
        self.terms = _check_range("terms", terms)
        if self.terms[0] < 1:
            raise UserError(f"terms={terms!r} must start at 1 or more; pass it as [lo, hi], e.g. [20, 40].")
        try:
            template.format(n=2, **fields)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            names = " and ".join("{" + k + "}" for k in ("n", *fields))
            raise UserError(f"template {template!r} cannot be formatted ({type(e).__name__}: {e}); use only the "
                            f"fields {names} and double any literal braces.") from None
        self.seed = seed
        self.template = template


class ArithmeticTask(_GeneratedTask):
    """``a op b`` questions with ``a``, ``b`` drawn uniformly from inclusive ranges and ``op`` from ``ops``.

    The answer is the integer result as a string; ``meta`` holds ``{"a", "b", "op"}``.
    """

    def __init__(
        self,
        seed: int,
        ops: Sequence[str] = ("+",),
        a_range: Sequence[int] = (1, 20),
        b_range: Sequence[int] = (1, 20),
        template: str = DEFAULT_TEMPLATE,
    ):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed={seed!r} is not an integer; pass an int such as 0.")
        # A string such as "+-*" is a convenient way to list single-character operators.
        ops = tuple(ops)
        if not ops:
            raise UserError(f"ops is empty; pass one or more of {sorted(OPS)}.")
        bad = [op for op in ops if op not in OPS]
        if bad:
            raise UserError(f"ops {bad} are not supported; use only {sorted(OPS)}.")
        try:
            template.format(a=1, b=2, op="+")
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise UserError(
                f"template {template!r} cannot be formatted ({type(e).__name__}: {e}); "
                "use only the fields {a}, {op} and {b} and double any literal braces."
            ) from None
        self.seed = seed
        self.ops = ops
        self.a_range = _check_range("a_range", a_range)
        self.b_range = _check_range("b_range", b_range)
        self.template = template

    def make(self, rng: random.Random) -> Example:
        a = rng.randint(*self.a_range)
        b = rng.randint(*self.b_range)
        op = rng.choice(self.ops)
        return Example(
            prompt=self.template.format(a=a, b=b, op=op),
            answer=str(OPS[op](a, b)),
            meta={"a": a, "b": b, "op": op},
        )

    def __repr__(self) -> str:
        return f"ArithmeticTask(seed={self.seed}, ops={self.ops}, a_range={self.a_range}, b_range={self.b_range})"


RUNNING_SUM_TEMPLATE = ("Add these {n} numbers one at a time: {numbers}. Write one line per number, 'total + number = "
                        "new total', starting from 0. Then write 'Answer:' and the final total.")


class RunningSumTask(_GeneratedTask):
    """A long-response task: add ``n`` numbers (``n`` uniform in ``terms``, each uniform in ``values``) one at a time,
    writing every running total, then the final one after ``Answer:``. A correct response is ``n`` lines of
    ``total + number = new total`` (about 10 tokens each) and the answer, so its length grows with ``n``.

    The answer is the sum as a string; ``meta`` holds ``{"numbers": [...]}`` (what the per-step reward
    :func:`gspo.rewards.builtin.running_sum_steps` checks each line against).
    """

    def __init__(self, seed: int, terms: Sequence[int] = (16, 48), values: Sequence[int] = (1, 20),
                 template: str = RUNNING_SUM_TEMPLATE):
        self._setup(seed, terms, template, numbers="1, 2")
        self.values = _check_range("a_range", values)

    def make(self, rng: random.Random) -> Example:
        numbers = [rng.randint(*self.values) for _ in range(rng.randint(*self.terms))]
        return Example(prompt=self.template.format(n=len(numbers), numbers=", ".join(map(str, numbers))),
                       answer=str(sum(numbers)), meta={"numbers": numbers})

    def __repr__(self) -> str:
        return f"RunningSumTask(seed={self.seed}, terms={self.terms}, values={self.values})"


# The prompt does not say how many words there are: stated, the count is copied and the numbering skipped (the first
# GPU runs on it learned exactly that: "Answer: 27" alone, full reward, no lines).
NUMBERED_WORDS_TEMPLATE = ('Number these words in the order given, one per line ("1. first word", "2. second word", '
                           'and so on), then write "Answer:" and how many words there are.\nWords: {words}')
WORDS = tuple(
    "apple river stone cloud tiger pencil garden window bread candle forest rabbit mirror violin coffee planet ladder "
    "button rocket dragon island pepper shadow silver turtle wallet yellow basket castle dinner eagle feather guitar "
    "hammer jacket kettle lemon magnet napkin orange parrot pillow puzzle quartz saddle tomato umbrella valley wagon "
    "zebra anchor bottle carpet desert engine falcon ginger helmet igloo jungle koala honey mountain spoon".split())
"""The 64 common nouns ``numbered_words`` draws from."""


class NumberedWordsTask(_GeneratedTask):
    """A long-response task: number ``n`` words (``n`` uniform in ``terms``, drawn with repetition from
    :data:`WORDS`) one per line in the order given, then say how many there are after ``Answer:``. A correct response
    is ``n`` lines of ``k. word`` and the count, so its length grows with ``n``; the count is what numbering the lines
    gives, so the model can get it right by doing the task rather than by arithmetic.

    The answer is ``n`` as a string; ``meta`` holds ``{"words": [...]}`` (what the per-line reward
    :func:`gspo.rewards.builtin.numbered_words_lines` checks).
    """

    def __init__(self, seed: int, terms: Sequence[int] = (20, 40), template: str = NUMBERED_WORDS_TEMPLATE):
        self._setup(seed, terms, template, words="apple, river")

    def make(self, rng: random.Random) -> Example:
        words = [rng.choice(WORDS) for _ in range(rng.randint(*self.terms))]
        return Example(prompt=self.template.format(n=len(words), words=", ".join(words)), answer=str(len(words)),
                       meta={"words": words})

    def __repr__(self) -> str:
        return f"NumberedWordsTask(seed={self.seed}, terms={self.terms})"


GUESS_TEMPLATE = ("I am thinking of a whole number from 1 to {n}. Guess it: reply with one number, and I will say "
                  "higher or lower.")


class GuessNumberTask(_GeneratedTask):
    """A multi-turn task for :class:`gspo.envs.builtin.GuessNumber`: a number uniform in 1..``hi`` (``hi`` uniform in
    ``terms``) to guess with higher / lower feedback. The answer is the number as a string."""

    def __init__(self, seed: int, terms: Sequence[int] = (10, 10), template: str = GUESS_TEMPLATE):
        self._setup(seed, terms, template)

    def make(self, rng: random.Random) -> Example:
        hi = rng.randint(*self.terms)
        return Example(prompt=self.template.format(n=hi), answer=str(rng.randint(1, hi)), meta={"hi": hi})

    def __repr__(self) -> str:
        return f"GuessNumberTask(seed={self.seed}, terms={self.terms})"
