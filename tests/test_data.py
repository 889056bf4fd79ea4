"""Generated tasks, JSONL loaders (GSM8K, MATH, any schema), build_dataset and the resumable DataStream."""
import json
import os

import pytest

from gspo.data import (
    ArithmeticTask,
    DataStream,
    build_dataset,
    default_reward,
    gsm8k,
    last_boxed,
    load_jsonl,
    math_jsonl,
)
from gspo.errors import UserError
from gspo.rewards import resolve

GSM8K_TEST = "/work/shared/data/gsm8k/test.jsonl"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_arithmetic_deterministic():
    """The same seed gives the same examples at every index; another seed gives different ones."""
    a, b, c = ArithmeticTask(seed=1), ArithmeticTask(seed=1), ArithmeticTask(seed=2)
    idx = [0, 1, 7, 123456, 2**31 - 2]
    assert [a[i] for i in idx] == [b[i] for i in idx]
    assert [a[i].prompt for i in range(20)] != [c[i].prompt for i in range(20)]
    assert len(a) >= 2**30


def test_arithmetic_answers():
    """Every op's answer is the integer result of the numbers in meta, and the numbers stay in range."""
    task = ArithmeticTask(seed=0, ops=("+", "-", "*"), a_range=(-5, 30), b_range=(2, 9))
    seen = set()
    for i in range(300):
        e = task[i]
        a, b, op = e.meta["a"], e.meta["b"], e.meta["op"]
        seen.add(op)
        assert -5 <= a <= 30 and 2 <= b <= 9
        assert int(e.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert f"{a} {op} {b}" in e.prompt
    assert seen == {"+", "-", "*"}
    e = ArithmeticTask(seed=0, ops=("*",), a_range=(7, 7), b_range=(6, 6))[3]
    assert (e.prompt, e.answer) == ("What is 7 * 6? Put the final answer after 'Answer:'.", "42")
    assert ArithmeticTask(seed=0, ops=("-",), a_range=(3, 3), b_range=(10, 10))[0].answer == "-7"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ops": ("/",)}, "ops"),
        ({"ops": ()}, "ops"),
        ({"a_range": (5, 1)}, "a_range"),
        ({"b_range": (1,)}, "b_range"),
        ({"template": "What is {x}?"}, "template"),
    ],
)
def test_arithmetic_validation(kwargs, match):
    """Unsupported ops, reversed or malformed ranges and bad templates raise a UserError naming the argument."""
    with pytest.raises(UserError, match=match):
        ArithmeticTask(seed=0, **kwargs)


def test_gsm8k_real_file():
    """The shared GSM8K test split loads fully, with the number after #### as the answer."""
    data = gsm8k(GSM8K_TEST)
    assert len(data) == 1319
    assert data[0].answer == "18"
    assert data[0].prompt.startswith("Janet")
    assert "Answer:" in data[0].prompt
    assert data[0].meta["answer"].endswith("#### 18")
    assert all(e.answer.lstrip("-").replace(".", "", 1).isdigit() for e in data)


def test_gsm8k_small_file(tmp_path):
    """GSM8K answers lose their commas, and a custom template formats the question."""
    rows = [{"question": "Q1?", "answer": "5*200=1000\n#### 1,000"}, "", {"question": "Q2?", "answer": "#### -3"}]
    p = write_jsonl(tmp_path / "g.jsonl", rows)
    data = gsm8k(p, template="Solve: {question}")
    assert [(e.prompt, e.answer) for e in data] == [("Solve: Q1?", "1000"), ("Solve: Q2?", "-3")]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b^{2}}}} end", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("$\\boxed{ \\{1, 2\\} }$", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("the answer is $\\boxed 5$.", "5"),
        ("no box here", None),
        ("truncated \\boxed{\\frac{1}{2", None),
    ],
)
def test_last_boxed(text, expected):
    """last_boxed returns the content of the last box with nested braces balanced, or None."""
    assert last_boxed(text) == expected


def test_math_jsonl_solution_and_answer(tmp_path):
    """MATH rows use the last \\boxed{} of the solution; MATH-500 rows with an answer field use it as is."""
    row = {"problem": "P", "solution": "x=\\boxed{2} so \\boxed{\\frac{3}{\\sqrt{4}}}", "level": "Level 2"}
    sol = write_jsonl(tmp_path / "m.jsonl", [row])
    [e] = math_jsonl(sol)
    assert e.answer == "\\frac{3}{\\sqrt{4}}" and e.meta["level"] == "Level 2"
    assert e.prompt.startswith("P\n") and "\\boxed{}" in e.prompt
    ans = write_jsonl(tmp_path / "m500.jsonl", [{"problem": "P", "solution": "long", "answer": "\\pi"}])
    assert math_jsonl(ans)[0].answer == "\\pi"


def test_load_jsonl_custom_fields(tmp_path):
    """Any schema loads with named fields; the template may use other row fields; chat prompts pass through."""
    p = write_jsonl(tmp_path / "c.jsonl", [{"q": "2+2?", "a": 4, "topic": "sums"}])
    [e] = load_jsonl(p, prompt_field="q", answer_field="a", template="[{topic}] {question}")
    assert (e.prompt, e.answer, e.meta) == ("[sums] 2+2?", "4", {"a": 4, "topic": "sums"})
    chat = [{"role": "user", "content": "hi"}]
    p2 = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    [e2] = load_jsonl(p2, prompt_field="messages", answer_field=None)
    assert e2.prompt == chat and e2.answer is None


@pytest.mark.parametrize(
    "rows, kwargs, match",
    [
        ([{"question": "a", "answer": "1"}, "{not json"], {}, r":2: .*not valid JSON"),
        ([{"question": "a", "answer": "1"}, "", {"question": "b"}], {}, r":3: .*no field 'answer'"),
        ([[1, 2]], {}, r":1: .*not a JSON object"),
        ([{"question": "a", "answer": "no hashes"}], {"answer_format": "gsm8k"}, r":1: .*####"),
        ([{"question": "a", "answer": "no box"}], {"answer_format": "boxed"}, r":1: .*boxed"),
        ([{"question": "a", "answer": "1"}], {"answer_format": "latex"}, "answer_format"),
        ([{"question": "a", "answer": "1"}], {"template": "{nope}"}, r":1: .*template"),
        (["", "  "], {}, "no rows"),
    ],
)
def test_bad_jsonl(tmp_path, rows, kwargs, match):
    """A bad row raises a UserError with the file and line number; an empty file and bad options are named too."""
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=match):
        load_jsonl(p, **kwargs)


def test_missing_file(tmp_path):
    """A missing data file raises a UserError naming the path."""
    with pytest.raises(UserError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_build_dataset(tmp_path):
    """build_dataset dispatches on task, reads {split}.jsonl from a folder, and rejects unknown tasks and keys."""
    task = build_dataset({"task": "arithmetic", "seed": 3, "ops": ["*"], "a_range": [2, 2], "b_range": [5, 5]})
    assert task[0].answer == "10"
    assert build_dataset({"task": "arithmetic", "seed": 3, "template": None})[4] == ArithmeticTask(seed=3)[4]
    data = build_dataset({"task": "gsm8k", "path": os.path.dirname(GSM8K_TEST), "split": "test"})
    assert len(data) == 1319 and data[0].answer == "18"
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "P", "solution": "\\boxed{1}"}])
    assert build_dataset({"task": "math", "path": str(tmp_path)})[0].answer == "1"
    write_jsonl(tmp_path / "x.jsonl", [{"q": "Q", "sol": "#### 9"}])
    cfg = {"task": "jsonl", "path": str(tmp_path / "x.jsonl"), "prompt_field": "q", "answer_field": "sol"}
    cfg["answer_format"] = "gsm8k"
    assert build_dataset(cfg)[0].answer == "9"
    with pytest.raises(UserError, match="arithmetic"):
        build_dataset({"task": "poetry"})
    with pytest.raises(UserError, match="seeed"):
        build_dataset({"task": "arithmetic", "seeed": 1})
    with pytest.raises(UserError, match="path"):
        build_dataset({"task": "gsm8k"})


def test_hf_without_datasets_or_name():
    """The hf task needs a dataset name, and says how to install datasets when it is missing."""
    with pytest.raises(UserError, match="path"):
        build_dataset({"task": "hf"})
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="pip install datasets"):
            build_dataset({"task": "hf", "path": "openai/gsm8k"})


def test_default_reward():
    """Each built-in task's default reward is an importable path; tasks without one say so."""
    for task in ("arithmetic", "gsm8k", "math"):
        assert callable(resolve(default_reward(task)))
    with pytest.raises(UserError, match="no default reward"):
        default_reward("jsonl")
    with pytest.raises(UserError, match="not known"):
        default_reward("poetry")


def small(n=5):
    return [ArithmeticTask(seed=0)[i] for i in range(n)]


def test_stream_shuffles_every_epoch():
    """Each epoch visits every example once, in an order that depends on the seed and changes between epochs."""
    data = small(10)
    s = DataStream(data, seed=0)
    e0, e1 = s.next_batch(10), s.next_batch(10)
    assert sorted(x.prompt for x in e0) == sorted(x.prompt for x in data) == sorted(x.prompt for x in e1)
    assert e0 != e1 and e0 != data
    assert DataStream(data, seed=1).next_batch(10) != e0
    assert s.position == 20 and s.epoch == 2


def test_stream_resume():
    """Consume 7, save, load into a new stream: the next examples equal those of the uninterrupted stream."""
    data = small(5)
    s = DataStream(data, seed=4)
    s.next_batch(3)
    s.next_batch(4)
    state = s.state_dict()
    assert state["position"] == 7
    resumed = DataStream(data, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert resumed.next_batch(9) == s.next_batch(9)


def test_stream_resume_exactly_at_an_epoch_boundary():
    """Saved right after the last example of an epoch (verl #7401: such a resume trained 0 steps), the resumed stream
    goes on with the next epoch, exactly as the uninterrupted one."""
    data = small(4)
    s = DataStream(data, seed=2)
    s.next_batch(2)
    s.next_batch(2)  # the epoch ends here
    r = DataStream(data, seed=2)
    r.load_state_dict(s.state_dict())
    nxt = r.next_batch(4)
    assert len(nxt) == 4 and nxt == s.next_batch(4) and r.epoch == s.epoch == 2


def test_stream_infinite_task_in_order():
    """A generated stream is read in index order (no permutation of 2**31 items), and resumes the same way."""
    task = ArithmeticTask(seed=5)
    s = DataStream(task, seed=0)
    s.next_batch(7)
    assert s.next_batch(3) == [task[7], task[8], task[9]]
    r = DataStream(task, seed=0)
    r.load_state_dict(s.state_dict())
    assert r.next_batch(1) == [task[10]]


def test_stream_errors():
    """An empty dataset, a zero batch and a checkpoint from different data raise UserError."""
    with pytest.raises(UserError, match="empty"):
        DataStream([], seed=0)
    s = DataStream(small(5), seed=0)
    with pytest.raises(UserError, match="at least 1"):
        s.next_batch(0)
    with pytest.raises(UserError, match="same data"):
        DataStream(small(6), seed=0).load_state_dict(s.state_dict())


def test_running_sum_task_is_a_deterministic_stream_of_long_sums():
    """Example i depends on (seed, i) only; it adds between terms[0] and terms[1] numbers drawn from a_range, lists
    them all in the prompt, and its answer is their sum; the default reward is the final number."""
    task = build_dataset({"task": "running_sum", "seed": 3, "terms": [5, 9], "a_range": [2, 4]})
    again = build_dataset({"task": "running_sum", "seed": 3, "terms": [5, 9], "a_range": [2, 4]})
    for i in range(50):
        ex = task[i]
        numbers = ex.meta["numbers"]
        assert ex == again[i] and 5 <= len(numbers) <= 9 and all(2 <= x <= 4 for x in numbers)
        assert ex.answer == str(sum(numbers)) and ", ".join(map(str, numbers)) in ex.prompt
        assert f"Add these {len(numbers)} numbers" in ex.prompt
    assert {len(task[i].meta["numbers"]) for i in range(200)} == set(range(5, 10))
    assert build_dataset({"task": "running_sum", "seed": 4})[0] != task[0]
    assert default_reward("running_sum") == "gspo.rewards.builtin:last_number"


@pytest.mark.parametrize("cfg, match", [
    ({"terms": [0, 3]}, "terms=.*start at 1"),
    ({"terms": [9, 5]}, "lo > hi"),
    ({"terms": "many"}, "not a pair of integers"),
    ({"template": "{question}"}, "cannot be formatted"),
])
def test_running_sum_task_refuses_bad_settings_in_one_line(cfg, match):
    with pytest.raises(UserError, match=match):
        build_dataset({"task": "running_sum", **cfg})


def test_numbered_words_task_is_a_deterministic_stream_of_word_lists():
    """Example i depends on (seed, i) only; it lists between terms[0] and terms[1] words of the embedded list and
    its answer is how many there are, which the prompt does not say (RL learned to copy it when it did)."""
    from gspo.data.tasks import WORDS

    task = build_dataset({"task": "numbered_words", "seed": 3, "terms": [5, 9]})
    for i in range(50):
        ex = task[i]
        words = ex.meta["words"]
        assert ex == build_dataset({"task": "numbered_words", "seed": 3, "terms": [5, 9]})[i]
        assert 5 <= len(words) <= 9 and set(words) <= set(WORDS) and ex.answer == str(len(words))
        assert ex.prompt.endswith("Words: " + ", ".join(words)) and str(len(words)) not in ex.prompt.split("Words:")[0]
    assert len(WORDS) == len(set(WORDS)) == 64
    assert {len(build_dataset({"task": "numbered_words"})[i].meta["words"]) for i in range(300)} <= set(range(20, 41))
    assert default_reward("numbered_words") == "gspo.rewards.builtin:last_number"
    with pytest.raises(UserError, match="cannot be formatted"):
        build_dataset({"task": "numbered_words", "template": "{question}"})


def test_encode_prompts_in_one_call_equals_one_call_per_prompt(tokenizer):
    """The batched encoding gives each prompt the ids the template-then-tokenize path gives it alone: string and
    message-list prompts, with and without a system prompt, one that has its own system turn, and non-ASCII text."""
    from gspo.prompts import encode_prompts, messages_for
    from gspo.types import Example

    examples = [Example("What is 12 + 34?"), Example([{"role": "user", "content": "Zähle: eins, zwei, drei — 🙂"}]),
                Example([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 * 3?"}]),
                Example("  leading and trailing spaces  \n")]
    for system in (None, "You are a careful solver."):
        alone = [tokenizer(tokenizer.apply_chat_template(messages_for(ex, system), add_generation_prompt=True,
                                                         tokenize=False), add_special_tokens=False)["input_ids"]
                 for ex in examples]
        assert encode_prompts(tokenizer, examples, system) == alone
    assert encode_prompts(tokenizer, []) == []
