"""Built-in rewards on hand-picked strings, and the runner's weighting, failure isolation and hard time limit."""
import math
import time
import threading

import pytest
import torch

from gspo.errors import UserError
from gspo.rewards import RewardRunner, RewardSpec, resolve
from gspo.rewards.builtin import format_answer_tag, gsm8k_number, last_number, math_verify_boxed
from gspo.types import Example


def ex(answer):
    return Example(prompt="q", answer=answer)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is 12.", "12", 1.0),
        ("12 apples, so 13", "12", 0.0),
        ("I have no idea.", "12", 0.0),
        ("Answer: 1,000", "1000", 1.0),
        ("It is -7.", "-7", 1.0),
        ("10-3=7", "7", 1.0),
        ("3 minus 10 is -7, Answer: 7", "-7", 0.0),
        ("Answer: 12.0", "12", 1.0),
        ("Answer: 12.5", "12", 0.0),
    ],
)
def test_last_number(completion, answer, expected):
    """last_number scores 1 exactly when the last number (commas and sign read) equals the integer answer."""
    assert last_number(completion, ex(answer)) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18", 1.0),
        ("The cost is high. Answer: $1,200.00", "1200", 1.0),
        ("Answer: 18 eggs over 2 days", "18", 1.0),
        ("Answer: 17", "18", 0.0),
        ("First 18, then the total is 20", "18", 0.0),
        ("The change is -3.5 degrees", "-3.5", 1.0),
        ("I don't know", "18", 0.0),
        ("Answer: unsure. Maybe 18", "18", 1.0),
    ],
)
def test_gsm8k_number(completion, answer, expected):
    """gsm8k_number compares the number after the final marker (else the last number) numerically with the answer."""
    assert gsm8k_number(completion, ex(answer)) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [("Answer: 5", 1.0), ("Answer: -5", 1.0), ("Answer: **42**", 1.0), ("Answer: five", 0.0), ("5", 0.0)],
)
def test_format_answer_tag(completion, expected):
    """format_answer_tag rewards an 'Answer:' followed by a number and nothing else."""
    assert format_answer_tag(completion, ex(None)) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("The answer is 0.5", "\\frac{1}{2}", 1.0),
        ("So the result is \\boxed{\\frac{1}{3}}.", "0.5", 0.0),
        ("so x = \\boxed{3}", "3", 1.0),
        ("no idea", "3", 0.0),
    ],
)
def test_math_verify_boxed(completion, answer, expected):
    """math_verify_boxed judges mathematical equality, so \\frac{1}{2} equals 0.5."""
    assert math_verify_boxed(completion, ex(answer)) == expected


def test_math_verify_boxed_off_main_thread():
    """math_verify_boxed works outside the main thread, where math-verify's signal timeouts cannot be used."""
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify_boxed("\\boxed{\\frac{1}{2}}", ex("0.5"))))
    t.start()
    t.join()
    assert out == [1.0]


def test_builtin_without_answer_raises():
    """A reward that needs a reference answer raises (and so is counted as a failure) when the example has none."""
    with pytest.raises(ValueError, match="no reference answer"):
        last_number("Answer: 3", ex(None))


def test_weighted_sum_in_process():
    """total is the weighted sum of the per-function scores, worked out by hand."""
    specs = [RewardSpec("gspo.rewards.builtin:last_number"), RewardSpec("gspo.rewards.builtin:format_answer_tag", 0.1)]
    with RewardRunner(specs, workers=0) as runner:
        res = runner.score(["Answer: 3", "3", "Answer: 4"], [ex("3")] * 3)
    # last_number: [1, 1, 0]; format_answer_tag: [1, 0, 1]; total = last + 0.1 * tag.
    assert res.per_function["last_number"].tolist() == [1.0, 1.0, 0.0]
    assert res.per_function["format_answer_tag"].tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(res.total, torch.tensor([1.1, 1.0, 0.1]))
    assert res.total.dtype == torch.float32
    assert res.failures == {"last_number": 0, "format_answer_tag": 0} and res.errors == []


def test_spec_forms():
    """Specs may be RewardSpec objects, bare paths or dicts; anything else is a UserError."""
    with RewardRunner({"path": "gspo.rewards.builtin:last_number", "weight": 2.0, "name": "acc"}, workers=0) as r:
        assert r.score(["7"], [ex("7")]).per_function["acc"].tolist() == [1.0]
        assert r.score(["7"], [ex("7")]).total.tolist() == [2.0]
    with pytest.raises(UserError, match="not understood"):
        RewardRunner([{"fn": "x:y"}], workers=0)


def test_bool_is_cast():
    """A reward returning a bool scores 1.0/0.0."""
    with RewardRunner([RewardSpec("reward_fixtures:is_true")], workers=0) as runner:
        assert runner.score(["yes", "no"], [ex(None)] * 2).total.tolist() == [1.0, 0.0]


def test_raise_in_process_is_nan():
    """In-process, a raising reward gives NaN for that completion only and is counted."""
    with RewardRunner(["reward_fixtures:boom"], workers=0) as runner:
        res = runner.score(["a", "BOOM", "b"], [ex(None)] * 3)
    assert res.total[0] == 0.5 and math.isnan(res.total[1]) and res.total[2] == 0.5
    assert res.failures == {"boom": 1} and "boom on purpose" in res.errors[0]


@pytest.mark.parametrize(
    "path", ["no_such_module_xyz:f", "gspo.rewards.builtin:no_such_fn", "last_number", "reward_fixtures:NOT_A_FUNCTION"]
)
def test_bad_path(path):
    """A reward path that does not name an importable function raises a UserError naming it: in-process at once, with
    workers at once for a module that does not exist, else when the workers load it (the trainer's process never runs
    a reward module's code)."""
    with pytest.raises(UserError, match=path):
        resolve(path)
    with pytest.raises(UserError, match=path):
        RewardRunner([RewardSpec(path)], workers=0)
    with pytest.raises(UserError, match=path):
        with RewardRunner([RewardSpec(path)], workers=2) as runner:
            runner.score(["1"], [ex("1")])


def test_a_reward_module_that_hangs_at_import_ends_in_one_line(monkeypatch):
    """A reward module that blocks when imported never runs in the trainer's process: the workers' start-up limit
    ends it in one line naming the reward and the fix (it used to hang training forever)."""
    import sys

    from gspo.rewards import runner as runner_module

    monkeypatch.setattr(runner_module, "STARTUP_TIMEOUT_S", 3.0)
    start = time.monotonic()
    with pytest.raises(UserError, match="'reward_fixtures_hang:f' in the workers did not finish within 3 s"):
        with RewardRunner([RewardSpec("reward_fixtures_hang:f")], workers=1) as runner:
            runner.score(["1"], [ex("1")])
    assert time.monotonic() - start < 60 and "reward_fixtures_hang" not in sys.modules


def test_duplicate_names_rejected():
    """Two rewards with the same name would overwrite each other's scores, so they are refused."""
    with pytest.raises(UserError, match="distinct name"):
        RewardRunner(["gspo.rewards.builtin:last_number", "gspo.rewards.builtin:last_number"], workers=0)


@pytest.mark.parametrize("path", ["reward_fixtures:nan_reward", "reward_fixtures:none_reward"])
def test_non_number_in_process(path):
    """A reward returning NaN or None is a bug in that function: UserError naming it."""
    with RewardRunner([path], workers=0) as runner, pytest.raises(UserError, match=path.split(":")[1]):
        runner.score(["a"], [ex(None)])


@pytest.fixture(scope="module")
def pool():
    """Two workers scoring a hanging, a raising and a process-killing reward, with a 2 s limit per call (room for a
    loaded machine: the tests run two at a time)."""
    specs = [RewardSpec("reward_fixtures:hang"), RewardSpec("reward_fixtures:boom"), RewardSpec("reward_fixtures:die")]
    with RewardRunner(specs, workers=2, timeout_s=2.0) as runner:
        yield runner


def test_pool_isolates_failures(pool):
    """A hung, a raising and a dying call are NaN for their completion only; every other completion is scored."""
    completions = [f"ok {i}" for i in range(40)]
    completions[5], completions[20], completions[33] = "HANG", "BOOM", "DIE"
    res = pool.score(completions, [ex(None)] * 40)
    nan_rows = {i for i, v in enumerate(res.total.tolist()) if math.isnan(v)}
    assert nan_rows == {5, 20, 33}
    assert math.isnan(res.per_function["hang"][5]) and math.isnan(res.per_function["boom"][20])
    assert math.isnan(res.per_function["die"][33])
    # Elsewhere: hang 1.0 + boom 0.5 + die 1.0.
    assert all(v == 2.5 for i, v in enumerate(res.total.tolist()) if i not in nan_rows)
    assert res.failures == {"hang": 1, "boom": 1, "die": 1}
    text = " | ".join(res.errors)
    assert "timed out" in text and "boom on purpose" in text and "died" in text


def test_pool_works_after_failures(pool):
    """After workers were killed and replaced, the runner scores a fresh batch fully."""
    pool.score(["HANG", "fine"], [ex(None)] * 2)
    res = pool.score([f"fine {i}" for i in range(64)], [ex(None)] * 64)
    assert res.total.tolist() == [2.5] * 64 and sum(res.failures.values()) == 0
    assert pool.workers == 2


def test_math_verify_in_worker_under_short_limit():
    """math_verify_boxed scores in a worker under a 1 s limit, since its ~1 s set-up runs at worker start-up."""
    with RewardRunner(["gspo.rewards.builtin:math_verify_boxed"], workers=1, timeout_s=1.0) as runner:
        res = runner.score(["\\boxed{\\frac{1}{2}}", "\\boxed{3}"], [ex("0.5"), ex("4")])
    assert res.total.tolist() == [1.0, 0.0] and res.failures == {"math_verify_boxed": 0}


@pytest.mark.parametrize("fn", ["nan_reward", "huge_int"])
@pytest.mark.parametrize("workers", [0, 1])
def test_pool_non_number_raises(fn, workers):
    """In process and in worker processes, a reward returning NaN or an int too large for a float (10**400) raises a
    UserError naming the function (the large int used to kill the worker with an OverflowError)."""
    with RewardRunner([f"reward_fixtures:{fn}"], workers=workers) as runner:
        with pytest.raises(UserError, match=fn):
            runner.score(["a", "b"], [ex(None)] * 2)


def test_user_module_and_close(tmp_path, monkeypatch):
    """A reward in the user's own module (found through sys.path) runs in the workers, which close() stops."""
    (tmp_path / "my_reward_mod.py").write_text("def length(c, e):\n    return len(c)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = RewardRunner(["my_reward_mod:length"], workers=2)
    procs = [w.proc for w in runner._pool.handles]
    assert runner.score(["ab", "abcd"], [ex(None)] * 2).total.tolist() == [2.0, 4.0]
    runner.close()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="close"):
        runner.score(["a"], [ex(None)])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_module_in_the_current_folder_is_found(user_folder, workers):
    """`my_reward.py` in the folder the command runs in is imported by path `my_reward:score`, in process and in the
    workers (the trainer's process used to refuse it as a module that does not exist)."""
    module = f"cwd_reward_{workers}"
    (user_folder / f"{module}.py").write_text("def score(c, e):\n    return len(c)\n")
    with RewardRunner([f"{module}:score"], workers=workers) as runner:
        assert runner.score(["ab", "abc"], [ex(None)] * 2).total.tolist() == [2.0, 3.0]


@pytest.mark.parametrize("source, path, says", [
    (None, "cwd_absent:f", "no module named 'cwd_absent' in the current folder"),
    ("import not_installed_dep_xyz\n", "cwd_needs_dep:f", "imports 'not_installed_dep_xyz', which is not installed"),
    ("1 / 0\n", "cwd_raises:f", "raised ZeroDivisionError: division by zero; fix that module"),
    ("def f(:\n", "cwd_syntax:f", "raised SyntaxError"),
    ("def f(c, e):\n    return 1\n", "cwd_has_f:g", "has no attribute 'g'; check the function name"),
    ("def f(c, e):\n    return 1\n", "json:f", "that module is not .*json.py: an installed one of the same name comes "
                                              "first, so rename your file"),
])
def test_an_import_failure_says_what_failed(user_folder, source, path, says):
    """A reward module that is not there, that needs a package that is not installed, whose code fails, that lacks the
    function, or whose name an installed module takes: each message names that cause, not a generic one."""
    module = path.split(":")[0]
    if source is not None:
        (user_folder / f"{module}.py").write_text(source)
    with pytest.raises(UserError, match=says):
        resolve(path)


def test_workers_survive_a_process_group_sigterm():
    """A SIGTERM sent to the whole process group (Slurm, systemd) is the trainer's to handle: workers ignore it and keep
    scoring the batch the trainer finishes before it checkpoints."""
    import os
    import signal
    import time

    with RewardRunner([RewardSpec("gspo.rewards.builtin:last_number")], workers=1, timeout_s=5.0) as runner:
        ex = [Example("What is 1 + 1?", "2")]
        assert runner.score(["2"], ex).total.tolist() == [1.0]  # the worker is up, its handlers set
        os.kill(runner._pool.handles[0].proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert runner._pool.handles[0].proc.is_alive()
        assert runner.score(["3"], ex).total.tolist() == [0.0]


@pytest.mark.parametrize("completion, expected", [
    ("0 + 3 = 3\n3 + 5 = 8\n8 + 2 = 10\nAnswer: 10", 1.0),  # every line right
    ("0 + 3 = 3\n3 + 5 = 9\n8 + 2 = 10\nAnswer: 10", 2 / 3),  # line 2's sum wrong; line 3 starts from the true total
    ("0 + 3 = 3\n3 + 5 = 9\n9 + 2 = 11\nAnswer: 11", 1 / 3),  # an error carried on: line 3 starts from a wrong total
    ("0 + 3 = 3\n8 + 2 = 10\nAnswer: 10", 1 / 3),  # a skipped line shifts the ones after it
    ("3 + 5 = 8\n8 + 2 = 10", 0.0),  # not started from 0: line 1 is not '0 + 3 = 3'
    ("The sum is 10.", 0.0),
    ("0+3=3, 3 +5= 8 and 8 + 2 = 10 then 10 + 1 = 11", 1.0),  # spacing and extra lines past the last number
])
def test_running_sum_steps_gives_credit_per_right_line_in_order(completion, expected):
    from gspo.rewards.builtin import running_sum_steps

    ex = Example(prompt="", answer="10", meta={"numbers": [3, 5, 2]})
    assert running_sum_steps(completion, ex) == pytest.approx(expected)


def test_running_sum_steps_needs_the_numbers():
    from gspo.rewards.builtin import running_sum_steps

    with pytest.raises(ValueError, match="meta\\['numbers'\\]"):
        running_sum_steps("0 + 1 = 1", Example(prompt="", answer="1"))


@pytest.mark.parametrize("completion, expected", [
    ("1. apple\n2. river\n3. stone\nAnswer: 3", 1.0),
    ("1. First word: Apple\n2) river.\n  3. stone, the last\nAnswer: 3", 1.0),  # case, ')' and text around the word
    ("1. apple\n2. stone\n3. stone\nAnswer: 3", 2 / 3),  # line 2 has the wrong word
    ("1. apple\n3. stone\nAnswer: 2", 1 / 3),  # a skipped line shifts the ones after it
    ("1. 1. word\n2. 2. word\n3. 3. word\nAnswer: 3", 0.0),  # numbered lines without the words
    ("1. apples\n2. river\n3. stone", 2 / 3),  # a whole word only
    ("apple, river, stone: 3 words", 0.0),
])
def test_numbered_words_lines_gives_credit_per_right_line_in_order(completion, expected):
    from gspo.rewards.builtin import numbered_words_lines

    ex = Example(prompt="", answer="3", meta={"words": ["apple", "river", "stone"]})
    assert numbered_words_lines(completion, ex) == pytest.approx(expected)


def test_step_spans_end_where_each_line_ends_and_score_it():
    """The step functions behind the partial-credit rewards: one (end, credit) per line, the end just past the line's
    match; the scalar rewards are their credit over the task's length."""
    from gspo.rewards.builtin import (numbered_words_line_spans, numbered_words_lines, running_sum_step_spans,
                                      running_sum_steps)

    text = "0 + 3 = 3\n3 + 5 = 9\n9 + 2 = 11\nAnswer: 11"
    ex = Example(prompt="", answer="10", meta={"numbers": [3, 5, 2]})
    assert running_sum_step_spans(text, ex) == [(9, 1.0), (19, 0.0), (30, 0.0)]  # 3 + 5 is not 9; 9 is not the total
    assert text[:9] == "0 + 3 = 3" and text[10:19] == "3 + 5 = 9" and running_sum_steps(text, ex) == pytest.approx(1 / 3)
    words = "1. apple\n2. stone\n3. stone\nAnswer: 3"
    wex = Example(prompt="", answer="3", meta={"words": ["apple", "river", "stone"]})
    assert numbered_words_line_spans(words, wex) == [(8, 1.0), (17, 0.0), (26, 1.0)]
    assert numbered_words_lines(words, wex) == pytest.approx(2 / 3)
