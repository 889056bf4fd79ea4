"""Built-in tools and environments (standard library only: they run in the environment workers).

- :func:`calculator`, a tool: exact arithmetic the 135M model cannot do in its head (3-digit products). With
  ``data.task = "arithmetic"``, ``data.ops = ["*"]`` and 3-digit ranges, the task's verifier scores the final answer.
- :class:`GuessNumber`, an environment: guess a whole number with "higher" / "lower" feedback; the fewer guesses, the
  higher the reward (``data.task = "guess_number"`` draws the numbers).
- :class:`RunningTotal`, an environment whose turns earn their own rewards: add one number a turn to a running total
  (``data.task = "running_sum"`` draws the numbers), each right total paying its share, so per-turn credit
  (``loss.step_credit = "env"``) has a signal that a trajectory's one reward does not carry.
"""
from __future__ import annotations

import ast
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_NUMBER = re.compile(r"-?\d+")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponents above 64 are not computed")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "123 * 456".
    """
    if len(expression) > 200:
        return "error: the expression is longer than 200 characters"
    try:
        value = _evaluate(ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class GuessNumber:
    """Guess the example's number (its ``answer``): each reply's last whole number is the guess, answered "higher",
    "lower" or, when right, done with reward ``1 - 0.1 * (guesses - 1)`` (at least 0.1). A reply without a number
    is told to give one, and counts as a guess."""

    def reset(self, example) -> None:
        self.secret = int(example.answer)
        self.guesses = 0

    def step(self, reply: str):
        self.guesses += 1
        numbers = _NUMBER.findall(reply)
        if not numbers:
            return "Reply with one whole number.", 0.0, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, max(0.1, 1.0 - 0.1 * (self.guesses - 1)), True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False


class RunningTotal:
    """Keep a running total, one number a turn: the example's numbers (``meta["numbers"]``, from ``data.task =
    "running_sum"``) are given one at a time, and each reply's last whole number is read as the new total. A right one
    earns ``1 / n`` (``n`` numbers), a wrong or missing one 0; either way the next message states the true total and
    the next number, so a mistake costs its own turn only. Done after the last number."""

    def reset(self, example) -> str:
        self.numbers = [int(x) for x in example.meta["numbers"]]
        self.turn, self.total = 0, 0
        return (f"Keep a running total, starting at 0. I give you one number at a time; reply with the new total "
                f"only. Add {self.numbers[0]}.")

    def step(self, reply: str):
        self.total += self.numbers[self.turn]
        self.turn += 1
        numbers = _NUMBER.findall(reply)
        reward = 1.0 / len(self.numbers) if numbers and int(numbers[-1]) == self.total else 0.0
        if self.turn == len(self.numbers):
            return None, reward, True
        return f"The total is {self.total}. Add {self.numbers[self.turn]}.", reward, False
