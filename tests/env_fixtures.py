"""Environments and tools that misbehave, for the fault tests of gspo.envs (imported by the environment workers)."""
import os
import time


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def huge(n: int) -> str:
    """Return a very long text.

    Args:
        n: How many characters.
    """
    return "x" * n


def broken(x: int) -> int:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


def structured(x: int) -> dict:
    """Return a dict.

    Args:
        x: A number.
    """
    return {"twice": 2 * x}


def spawns(path: str) -> str:
    """Start a process that outlives any call (its pid written to ``path``), then hang.

    Args:
        path: Where to write the child's pid.
    """
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(1.0)


class Echo:
    """Answers every reply with "again" and reward 1 per step; done after 3 steps."""

    def reset(self, example):
        self.steps = 0

    def step(self, reply):
        self.steps += 1
        return "again", 1.0, self.steps >= 3


class Raises:
    def step(self, reply):
        raise ValueError("the environment broke")


class Hangs:
    def step(self, reply):
        while True:
            time.sleep(1.0)


class Crashes:
    def step(self, reply):
        os._exit(3)


class BadObservation:
    def step(self, reply):
        return 42, 0.0, False


class NeverDone:
    def step(self, reply):
        return "go on", 0.0, False


class DifferentPrompts:
    """reset returns another first message every time: refused (a group shares its prompt)."""

    count = 0

    def reset(self, example):
        DifferentPrompts.count += 1
        return f"prompt {DifferentPrompts.count} {time.time_ns()}"

    def step(self, reply):
        return None, 0.0, True


def undocumented(x):
    return x


class ChatML:
    """SmolLM2's chat format written out by hand, without the template's default system message: a renderer for
    ``env.renderer`` (``env_fixtures:chatml``)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def render(self, messages, tools, generation_prompt):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.tokenize(text + ("<|im_start|>assistant\n" if generation_prompt else ""))

    def tokenize(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids):
        return self.tok.decode(ids)


def chatml(tokenizer):
    return ChatML(tokenizer)


def not_a_renderer(tokenizer):
    return object()


class OddRole:
    """Answers with a message of a role no chat template renders after an assistant turn."""

    def step(self, reply):
        return [{"role": "environment", "content": "the door opens"}], 0.5, False


class Verbose:
    """Answers with a megabyte of text: cut before it reaches the trainer."""

    def step(self, reply):
        return "y" * 1_000_000, 0.0, False


def calculator(expression: str) -> str:
    """A second tool named calculator, from another module.

    Args:
        expression: Anything.
    """
    return expression
