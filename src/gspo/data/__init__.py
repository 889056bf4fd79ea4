"""Training data: built-in tasks and file loaders (``build_dataset``), and a resumable shuffled stream (``DataStream``).

``build_dataset`` takes a plain dict so the config layer stays independent of this package. Keys (all optional
except ``task``; ``None`` means the default):

=================  =====================================================================================
``task``           ``"arithmetic"`` | ``"running_sum"`` | ``"numbered_words"`` | ``"gsm8k"`` | ``"math"`` | ``"jsonl"`` | ``"hf"``
``path``           JSONL file, or a folder holding ``{split}.jsonl``; for ``"hf"`` the dataset name
``split``          ``"train"`` by default; picks ``{split}.jsonl`` in a folder, or the HF split
``seed``           generated tasks only (0)
``ops``            arithmetic operators, e.g. ``["+", "-", "*"]`` (``["+"]``)
``a_range``        inclusive ``[lo, hi]`` of the first operand (``[1, 20]``); running_sum: of every number
``terms``          running_sum / numbered_words: inclusive ``[lo, hi]`` of how many numbers a prompt adds
                   (``[16, 48]``) / words it numbers (``[20, 40]``)
``b_range``        inclusive ``[lo, hi]`` of the second operand (``[1, 20]``)
``prompt_field``   row field holding the question (``"question"``; ``"problem"`` for math)
``answer_field``   row field holding the answer (``"answer"``; math picks ``answer`` or ``solution``)
``answer_format``  ``"raw"`` | ``"gsm8k"`` | ``"boxed"`` (jsonl/hf; ``"raw"``)
``template``       ``str.format`` template with ``{question}`` (``{a} {op} {b}`` for arithmetic)
=================  =====================================================================================
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

from gspo.data.loaders import ANSWER_FORMATS, gsm8k, last_boxed, load_hf_dataset, load_jsonl, math_jsonl
from gspo.data.tasks import ArithmeticTask, GuessNumberTask, NumberedWordsTask, RunningSumTask
from gspo.errors import UserError
from gspo.types import Example

__all__ = [
    "ANSWER_FORMATS",
    "ArithmeticTask",
    "NumberedWordsTask",
    "GuessNumberTask",
    "RunningSumTask",
    "DataStream",
    "TASKS",
    "build_dataset",
    "dataset_args",
    "default_reward",
    "gsm8k",
    "last_boxed",
    "load_hf_dataset",
    "load_jsonl",
    "math_jsonl",
]

TASKS = ("arithmetic", "running_sum", "numbered_words", "guess_number", "gsm8k", "math", "jsonl", "hf")
_KEYS = (
    "task", "path", "split", "seed", "ops", "a_range", "b_range", "terms",
    "prompt_field", "answer_field", "answer_format", "template",
)  # fmt: skip
_DEFAULT_REWARDS = {
    "arithmetic": "gspo.rewards.builtin:last_number",
    "running_sum": "gspo.rewards.builtin:last_number",
    "numbered_words": "gspo.rewards.builtin:last_number",
    "gsm8k": "gspo.rewards.builtin:gsm8k_number",
    "math": "gspo.rewards.builtin:math_verify_boxed",
}
INFINITE = 2**30
"""A dataset at least this long is a generated stream: it is read in index order, never permuted."""


def _file(cfg: dict[str, Any], split: str) -> str:
    """The JSONL file a file-based task reads: ``path`` itself, or ``{path}/{split}.jsonl`` for a folder."""
    path = cfg.get("path")
    if not path:
        raise UserError(f"task {cfg['task']!r} needs a data path; set path to a JSONL file or a folder of them.")
    path = os.fspath(path)
    return os.path.join(path, f"{split}.jsonl") if os.path.isdir(path) else path


def build_dataset(cfg: dict[str, Any]) -> Sequence[Example]:
    """The dataset a config dict describes (keys in the module docstring); unknown tasks or keys raise UserError."""
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown:
        raise UserError(f"data config keys {unknown} are not known; use only {list(_KEYS)}.")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    task = cfg.get("task")
    if task not in TASKS:
        raise UserError(f"data task {task!r} is not known; set task to one of {list(TASKS)}.")
    split = cfg.get("split", "train")
    if task == "arithmetic":
        kwargs = {k: cfg[k] for k in ("ops", "a_range", "b_range", "template") if k in cfg}
        return ArithmeticTask(seed=cfg.get("seed", 0), **kwargs)
    if task == "running_sum":
        kwargs = {k: cfg[k] for k in ("terms", "template") if k in cfg}
        return RunningSumTask(seed=cfg.get("seed", 0), values=cfg.get("a_range", (1, 20)), **kwargs)
    if task == "numbered_words":
        return NumberedWordsTask(seed=cfg.get("seed", 0), **{k: cfg[k] for k in ("terms", "template") if k in cfg})
    if task == "guess_number":
        return GuessNumberTask(seed=cfg.get("seed", 0), **{k: cfg[k] for k in ("terms", "template") if k in cfg})
    if task == "gsm8k":
        return gsm8k(_file(cfg, split), template=cfg.get("template"))
    if task == "math":
        return math_jsonl(
            _file(cfg, split),
            template=cfg.get("template"),
            prompt_field=cfg.get("prompt_field", "problem"),
            answer_field=cfg.get("answer_field"),
        )
    fields = {k: cfg[k] for k in ("prompt_field", "answer_field", "answer_format", "template") if k in cfg}
    if task == "jsonl":
        return load_jsonl(_file(cfg, split), **fields)
    if not cfg.get("path"):
        raise UserError("task 'hf' needs a dataset name; set path to it, e.g. 'openai/gsm8k'.")
    return load_hf_dataset(cfg["path"], split, **fields)


def dataset_args(data_cfg, seed: int) -> dict[str, Any]:
    """The ``[data]`` section as :func:`build_dataset` takes it (the prompt-side fields stay with the collect stage)."""
    skip = {"system_prompt", "max_prompt_tokens", "long_prompts"}
    return {**{k: v for k, v in vars(data_cfg).items() if v is not None and k not in skip}, "seed": seed}


def default_reward(task: str) -> str:
    """The import path (``module:function``) of the reward that fits built-in ``task``."""
    if task in _DEFAULT_REWARDS:
        return _DEFAULT_REWARDS[task]
    if task in TASKS:
        raise UserError(
            f"task {task!r} has no default reward; name one explicitly, e.g. {_DEFAULT_REWARDS['gsm8k']!r}."
        )
    raise UserError(f"data task {task!r} is not known; set task to one of {list(TASKS)}.")


class DataStream:
    """Examples of ``dataset`` in a seeded shuffled order, epoch after epoch, resumable from ``state_dict()``.

    Epoch ``e`` visits a permutation drawn from ``(seed, e)``, so a resume recomputes it instead of storing it.
    A generated stream (``len >= 2**30``) is read in index order, since its examples are already random.
    """

    def __init__(self, dataset: Sequence[Example], seed: int = 0):
        if len(dataset) == 0:
            raise UserError("the dataset is empty; point the data config at a file or task with at least one example.")
        self.dataset = dataset
        self.seed = seed
        self.position = 0  # examples consumed since the start of training; the whole resume state with the seed
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def epoch(self) -> int:
        """The epoch the next example belongs to (always 0 for a generated stream)."""
        return 0 if len(self.dataset) >= INFINITE else self.position // len(self.dataset)

    def _index(self, position: int) -> int:
        """The dataset index served at stream ``position``."""
        n = len(self.dataset)
        if n >= INFINITE:
            return position % n
        epoch, offset = divmod(position, n)
        if epoch != self._perm_epoch:
            perm = list(range(n))
            random.Random(self.seed * 2**32 + epoch).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm[offset]

    def next_batch(self, k: int) -> list[Example]:
        """The next ``k`` examples (crossing epoch boundaries as needed); advances ``position`` by ``k``."""
        if k < 1:
            raise UserError(f"batch size {k} must be at least 1; set the number of prompts per step to 1 or more.")
        batch = [self.dataset[self._index(self.position + j)] for j in range(k)]
        self.position += k
        return batch

    def __iter__(self) -> Iterator[Example]:
        while True:
            yield self.next_batch(1)[0]

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to continue the stream exactly: the position, the seed and the dataset size."""
        return {"position": self.position, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a ``state_dict()``; the saved seed wins so the order matches the interrupted run."""
        if state.get("size") != len(self.dataset):
            raise UserError(
                f"the checkpoint's data stream was over {state.get('size')} examples but this dataset has "
                f"{len(self.dataset)}; resume with the same data (path, split, task) as the original run."
            )
        self.seed = int(state["seed"])
        self.position = int(state["position"])
        self._perm_epoch = -1
