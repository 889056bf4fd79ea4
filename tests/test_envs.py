"""Multi-turn rows, token-exact: the appended ids of each turn (a fixed-base suffix diff of the real SmolLM2 chat
template), the separator after the end-of-turn token kept, and the start-up check that refuses a template which
re-renders earlier turns."""
import copy
import random

import pytest

from gspo.envs.turns import Turns, build_row, check_template, random_conversation
from gspo.errors import UserError
from gspo.models.load import load_model, stop_token_ids


@pytest.fixture
def turns(tokenizer):
    return Turns(tokenizer, stop_token_ids(tokenizer))


def test_appended_ids_keep_the_separator_after_the_end_of_turn_token(turns, tokenizer):
    """After a sampled turn ends with <|im_end|>, the appended ids start with the template's "\\n" (verl PR #6921 lost
    that token at every tool boundary) and end with the opening of the next assistant turn."""
    ids = turns.after([{"role": "tool", "content": "12"}])
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_ids_to_tokens(turns.end_id) == "<|im_end|>"


def test_rows_built_turn_by_turn_are_the_templates_rendering(turns, tokenizer):
    """Over random conversations (unicode, markup, JSON, braces, tool and user replies, 1-4 turns), the row built turn
    by turn is, id for id, what the template renders for the whole conversation when each assistant content is
    tokenized alone; the start-up check passes."""
    rng = random.Random(1)
    for _ in range(200):
        conversation = random_conversation(rng)
        whole = turns.encode(conversation, generation_prompt=True)
        assert tokenizer.decode(build_row(turns, conversation)) == tokenizer.decode(whole)
    check_template(turns, samples=300)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    """A template that drops <think> blocks of earlier assistant turns (as Qwen3's does) would make the rows other than
    the conversation the model is shown at inference: refused in one line, quoting where they part."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "message['content']",
        "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' and not loop.last "
        "else message['content'])")
    turns = Turns(tok, stop_token_ids(tok))
    with pytest.raises(UserError, match="does not keep earlier turns"):
        check_template(turns, samples=300)


def test_a_tokenizer_without_template_or_end_of_turn_is_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(UserError, match="chat template"):
        Turns(tok, stop_token_ids(tokenizer))
    with pytest.raises(UserError, match="none of the stop tokens"):
        Turns(tokenizer, [tokenizer.convert_tokens_to_ids("a")])


# --- the engine's side: rows that go on in their own KV cache ---------------------------------------------------------

import torch  # noqa: E402

from gspo.rollout import HFEngine  # noqa: E402
from gspo.rollout.graph import GraphEngine  # noqa: E402
from gspo.train.passes import sequence_logprobs  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402


class Answers:
    """A TurnEnds that answers each row's turn with fixed appended ids, ``turns_per_row[r]`` times, and records every
    call (rows, their turn ids)."""

    def __init__(self, turns_per_row, appended):
        self.left = list(turns_per_row)
        self.appended = appended
        self.calls = []

    def __call__(self, rows, turn_ids):
        self.calls.append((list(rows), [list(t) for t in turn_ids]))
        out = []
        for r in rows:
            self.left[r] -= 1
            out.append(self.appended(r) if self.left[r] > 0 else None)
        return out


def _prompts(tokenizer):
    return [tokenizer.encode(t) for t in ["Hello there, how are you?", "Hi", "What is 2 + 3? Answer please."]]


def _biased(model, tokenizer, stop, bias):
    """The tiny model with its LM head biased towards the stop token, so turns end after a few tokens."""
    model.lm_head.bias = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight[:, 0]))
    with torch.no_grad():
        model.lm_head.bias[stop] = bias
    return model


# The engines that run multi-turn rows: the simple one; the graph engine's module step; its fused step (Triton's
# interpreter on a CPU) with rows compacted at every host check (12 rows in a bucket of 16 go to 8 once 8 are left).
ENGINES = {
    "hf": lambda model, tokenizer, stop: HFEngine(model, tokenizer, stop_ids=stop),
    "graph": lambda model, tokenizer, stop: GraphEngine(model, tokenizer, stop_ids=stop, compact=False),
    "graph-fused-compact": lambda model, tokenizer, stop: GraphEngine(model, tokenizer, stop_ids=stop, fused=True,
                                                                      compact=True, sync_every=1),
}
ENGINE_PARAMS = ["hf", "graph", pytest.param("graph-fused-compact", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors: with CUDA, test_gpu.py runs the fused step on the device"))]


@pytest.mark.parametrize("engine", ["hf", "graph"])
def test_rows_that_end_after_one_turn_are_the_single_turn_rollout_bit_for_bit(tiny_model, tokenizer, engine):
    """With a TurnEnds that finishes every row at its first turn, the multi-turn path draws, feeds and records exactly
    what the single-turn loop does (same seed): tokens, log-probs, masks, finish reasons. (The fused step with
    compaction: test_gpu.py, on CUDA graphs; in Triton's interpreter it took 45 s of CI.)"""
    stop = stop_token_ids(tokenizer)
    engine = ENGINES[engine](_biased(tiny_model, tokenizer, stop[-1], 11.0), tokenizer, stop)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    single = engine.generate(_prompts(tokenizer), 4, params, torch.Generator().manual_seed(5))
    multi = engine.generate(_prompts(tokenizer), 4, params, torch.Generator().manual_seed(5),
                            turns=Answers([1] * 12, lambda r: [1, 2]))
    assert torch.equal(single.completion_ids, multi.completion_ids[:, :single.completion_ids.shape[1]])
    assert torch.equal(single.logprobs, multi.logprobs[:, :single.logprobs.shape[1]])
    assert torch.equal(single.completion_mask, multi.completion_mask[:, :single.completion_mask.shape[1]])
    assert torch.equal(multi.sampled, multi.completion_mask)
    assert single.finish_reasons == multi.finish_reasons and single.texts == multi.texts
    assert "stop" in single.finish_reasons and "length" in single.finish_reasons


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_later_turns_continue_the_rows_kv_cache_exactly(tiny_model, tokenizer, engine):
    """Rows of 1-3 turns with appended ids of different lengths per row: each row is its prompt, its sampled ids and
    the appended ids, in order (token-in, token-out); the appended ids are out of the sampled mask; and the log-probs
    the engine recorded for every sampled token of every turn equal the trainer's recomputation over the whole row
    (the continued KV cache, its masked padding and its positions are right; in the fused step, rows whose turn
    ended were compacted away and come back in a later turn)."""
    stop = stop_token_ids(tokenizer)
    model = _biased(tiny_model, tokenizer, stop[-1], 12.0)
    engine = ENGINES[engine](model, tokenizer, stop)
    rows = 12
    appended = {r: list(range(100 + r, 100 + r + 1 + r % 4)) for r in range(rows)}  # 1-4 ids, different per row
    answers = Answers([3, 2, 3, 1, 2, 3, 1, 3, 2, 2, 1, 3], lambda r: appended[r])
    params = SamplingParams(max_new_tokens=36, temperature=1.0, max_turn_tokens=8)
    compacted = []
    if getattr(engine, "compact", False):  # the rows moved by each compaction (the step's rows, in their new order)
        move = engine._compact
        engine._compact = lambda b, v, rows, live: compacted.append(rows) or move(b, v, rows, live)
    rollout = engine.generate(_prompts(tokenizer), 4, params, torch.Generator().manual_seed(0), turns=answers)
    assert bool(compacted) == getattr(engine, "compact", False)
    sampled_turns = {r: [] for r in range(rows)}
    for rows_called, turn_ids in answers.calls:
        for r, ids in zip(rows_called, turn_ids):
            sampled_turns[r].append(ids)
    assert len(answers.calls) >= 2
    for r in range(rows):
        row = rollout.completion_ids[r][rollout.completion_mask[r]].tolist()
        expected, flags = [], []
        for k, ids in enumerate(sampled_turns[r]):
            expected += ids
            flags += [True] * len(ids)
            if k + 1 < len(sampled_turns[r]) or answers.left[r] > 0:
                expected += appended[r]
                flags += [False] * len(appended[r])
        n = len(expected)
        assert row[:n] == expected, r  # a row cut short by its turn limit has sampled ids after the last turn end
        assert rollout.sampled[r][:n].tolist() == flags, r
    logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                pad_id=engine.pad_id)
    mask = rollout.sampled
    assert (~rollout.sampled & rollout.completion_mask).any()
    torch.testing.assert_close(rollout.logprobs[mask], logp.detach()[mask], atol=2e-5, rtol=0)


# --- the environment driver: tools and environments in real worker processes ----------------------------------------

from gspo.config.schema import EnvConfig  # noqa: E402
from gspo.envs.episodes import Episodes, Trajectory  # noqa: E402
from gspo.types import Example  # noqa: E402

from test_trainer import tiny_dir  # noqa: E402,F401  (the module fixture)


def _episodes(tokenizer, workers=1, **env):
    return Episodes(EnvConfig(**{"workers": workers, "timeout_s": 3.0, **env}), tokenizer, stop_token_ids(tokenizer))


def _turn(tokenizer, episodes, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [episodes.turns.end_id]


def test_tool_calls_run_in_the_workers_and_every_failure_is_a_message(tokenizer):
    """Hermes-style calls of the built-in calculator and of tools that raise, hang, return a huge text or a dict, a
    malformed call and an unknown tool: each becomes a tool message the model reads (and a counted error), never a
    failure of the trajectory; a turn without a call is the answer and ends it."""
    ep = _episodes(tokenizer, tools=["gspo.envs.builtin:calculator", "env_fixtures:sleepy", "env_fixtures:huge",
                                     "env_fixtures:broken", "env_fixtures:structured"])
    try:
        call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format
        texts = [call("calculator", '{"expression": "123 * 456"}'), call("sleepy", '{"seconds": 30}'),
                 call("huge", '{"n": 100000}'), call("broken", '{"x": 1}'), '<tool_call>{"name": calc</tool_call>',
                 call("nope", "{}"), call("structured", '{"x": 21}'), "The answer is 56088."]
        ep.rows = [Trajectory(i, Example(prompt="q", answer="1")) for i in range(len(texts))]
        out = ep(list(range(len(texts))), [_turn(tokenizer, ep, t) for t in texts])
        said = [tokenizer.decode(ids) if ids else None for ids in out]
        assert said[0] == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
        assert "error: timed out after 3 s" in said[1]
        assert "[cut: 100000 characters]" in said[2] and len(said[2]) < 2200
        assert "error: RuntimeError: the tool broke" in said[3]
        assert "not valid JSON" in said[4] and "no tool named 'nope'" in said[5]
        assert '{"twice": 42}' in said[6]
        assert said[7] is None  # an answer: the trajectory is over
        assert [t.tool_errors for t in ep.rows] == [0, 1, 0, 1, 1, 1, 0, 0]
        assert all(t.error is None for t in ep.rows)
    finally:
        ep.close()


@pytest.mark.parametrize("path,expect", [
    ("env_fixtures:Raises", "step: ValueError: the environment broke"),
    ("env_fixtures:Hangs", "step: timed out after 3 s"),
    ("env_fixtures:Crashes", "step: the worker process died (exit code 3)"),
    ("env_fixtures:BadObservation", "step: ValueError: step returned 42"),
])
def test_an_environment_that_fails_ends_its_trajectory_not_the_run(tokenizer, path, expect):
    """An environment whose step raises, hangs, kills its process or breaks the contract: that trajectory ends with a
    NaN reward and the reason; the next batch gets a working worker."""
    ep = _episodes(tokenizer, path=path)
    try:
        ep.rows = [Trajectory(0, Example(prompt="q", answer="1"))]
        ep.pool.call([(0, "reset", ep.rows[0].example)])
        assert ep([0], [_turn(tokenizer, ep, "hello")]) == [None]
        assert ep.rows[0].error.startswith(expect), ep.rows[0].error
        assert torch.isnan(ep._result().rewards[0])
        ep.pool.forget([0])
        ep.rows = [Trajectory(1, Example(prompt="q", answer="1"))]
        assert ep.pool.call([(1, "reset", ep.rows[0].example)]) == [("ok", None)]
    finally:
        ep.close()


def test_a_whole_multi_turn_run_trains_only_on_sampled_tokens(tiny_dir, tmp_path):  # noqa: F811
    """`gspo train` with an environment (env_fixtures:Echo, 3 turns, reward 1 per step) on the tiny model: rows hold
    several turns, the appended tokens are out of the loss mask, env/* metrics are logged, the run directory passes
    check_run_dir, and gspo report shows the conversations with the trained tokens marked."""
    from gspo.runlog.metrics import read_jsonl
    from gspo.train import Trainer
    from test_faults import check_run_dir
    from test_trainer import tiny_config

    cfg = tiny_config(tiny_dir, "env.path='env_fixtures:Echo'", "env.workers=1", "env.max_turn_tokens=4",
                      "rollout.engine='hf'",  # the LM-head bias below is added to the trainer's model only
                      "rollout.max_new_tokens=40", "rewards.functions=[]", "rewards.workers=0")
    trainer = Trainer(cfg, tmp_path / "run")
    _biased(trainer.actor.model, trainer.tokenizer, stop_token_ids(trainer.tokenizer)[-1], 12.0)  # turns that end
    batch = trainer.collector.collect()
    r = batch.rollout
    assert (r.completion_mask & ~r.sampled).any()  # appended tokens are in the rows
    assert torch.equal(batch.loss_mask, r.sampled & batch.loss_mask) and not (batch.loss_mask & ~r.sampled).any()
    assert batch.metrics["env/turns_mean"] > 1 and batch.metrics["env/appended_tokens_mean"] > 0
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows and all("env/turns_mean" in row for row in rows)
    turns = [s["turns"] for s in read_jsonl(tmp_path / "run" / "samples.jsonl")]
    assert turns and any(any(not p["trained"] and "again" in p["text"] for p in t) for t in turns)
    check_run_dir(tmp_path / "run", len(rows))
    # gspo report shows the conversations, the sampled (trained) pieces marked, the appended ones plain
    from gspo.commands.report import write_report

    page = write_report([tmp_path / "run"], tmp_path / "report").read_text()
    assert "<h2>Conversations</h2>" in page and "<span class='trained'>" in page and "again" in page


def test_eval_plays_the_environment_and_reports_its_reward_and_turns(tiny_dir, monkeypatch):  # noqa: F811
    """`gspo eval` with an environment runs whole trajectories: env_fixtures:Echo pays 1 a step and ends after 3, and
    turns that end (the LM head biased to the stop token) give every trajectory, greedy or sampled, 3 turns and 3."""
    import gspo.commands.evaluate as evaluation
    from test_trainer import tiny_config

    def biased_model(*args, **kwargs):
        model, tokenizer = load_model(*args, **kwargs)
        return _biased(model, tokenizer, stop_token_ids(tokenizer)[-1], 12.0), tokenizer

    monkeypatch.setattr(evaluation, "load_model", biased_model)
    cfg = tiny_config(tiny_dir, "env.path='env_fixtures:Echo'", "env.workers=1", "env.max_turn_tokens=4",
                      "rollout.max_new_tokens=40", "rewards.functions=[]", "rewards.workers=0")
    out = evaluation.evaluate(cfg, n=3, samples=2, batch_size=2)
    assert out["greedy_turns"] == out["turns"] == 3.0 and out["greedy_reward"] == out["reward"] == 3.0
    assert out["greedy_accuracy"] == out["pass@1"] == 1.0  # a score >= 1 counts as correct


def test_a_renderer_named_in_env_renderer_builds_the_rows(tiny_dir, tmp_path):  # noqa: F811
    """env.renderer = env_fixtures:chatml (SmolLM2's format by hand, without its template's default system message):
    the prompts and the appended ids are the renderer's, the run trains; a factory that returns no renderer, one
    set without an environment, and one not written 'module:name' are refused in one line."""
    from gspo.config import build_config
    from gspo.train import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tiny_dir, "env.path='env_fixtures:Echo'", "env.renderer='env_fixtures:chatml'", "env.workers=1",
                      "env.max_turn_tokens=4", "rollout.engine='hf'", "rollout.max_new_tokens=40",
                      "rewards.functions=[]", "rewards.workers=0")
    trainer = Trainer(cfg, tmp_path / "run")
    tok = trainer.tokenizer
    _biased(trainer.actor.model, tok, stop_token_ids(tok)[-1], 12.0)
    batch = trainer.collector.collect()
    r = batch.rollout
    assert tok.decode(r.prompt_ids[0]).startswith("<|im_start|>user\n")  # the template would open with its system
    appended = [tok.decode([t for t, s, m in zip(row, sampled, mask) if m and not s])
                for row, sampled, mask in zip(r.completion_ids.tolist(), r.sampled.tolist(), r.completion_mask.tolist())]
    assert any("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n" in a for a in appended)
    trainer.train()
    for settings, match in (({"env": {"path": "env_fixtures:Echo", "renderer": "env_fixtures:not_a_renderer"}},
                             "returned object, which has no render, tokenize, decode"),
                            ({"env": {"renderer": "env_fixtures:chatml"}}, "there are none"),
                            ({"env": {"path": "env_fixtures:Echo", "renderer": "chatml"}}, "must be 'module:name'")):
        with pytest.raises(UserError, match=match) as err:
            cfg = build_config(settings, [f"model.name='{tiny_dir}'", "rollout.max_new_tokens=8"], device="cpu")
            Trainer(cfg, tmp_path / "refused")
        assert "\n" not in str(err.value)


def test_running_total_pays_each_right_total_its_share():
    """gspo.envs.builtin:RunningTotal by hand, numbers 3, 4, 3: a right total earns 1/3, a wrong one 0 and the true
    total is told, so the next turn's reward is its own doing; done after the last number."""
    from gspo.envs.builtin import RunningTotal

    env = RunningTotal()
    first = env.reset(Example(prompt="", answer="10", meta={"numbers": [3, 4, 3]}))
    assert first.startswith("Keep a running total, starting at 0.") and first.endswith("Add 3.")
    assert env.step("3") == ("The total is 3. Add 4.", 1 / 3, False)
    assert env.step("It is 8.") == ("The total is 7. Add 3.", 0.0, False)
    assert env.step("10") == (None, 1 / 3, True)
    env.reset(Example(prompt="", answer="5", meta={"numbers": [5]}))
    assert env.step("no number") == (None, 0.0, True)


def test_environment_and_tool_modules_that_cannot_load_end_in_one_line(tokenizer, monkeypatch):
    """A tool whose docstring and hints cannot describe it, an environment module that blocks at import (never in the
    trainer's own process), an environment that is not a class: one line at start-up or at the first call."""
    import sys

    from gspo.envs import pool

    with pytest.raises(UserError, match="env.tools entry 'env_fixtures:undocumented' cannot be described"):
        _episodes(tokenizer, tools=["env_fixtures:undocumented"])
    with pytest.raises(UserError, match="is not a class with a step"):
        _episodes(tokenizer, workers=0, path="gspo.envs.builtin:calculator")
    monkeypatch.setattr(pool, "STARTUP_TIMEOUT_S", 2.0)
    ep = _episodes(tokenizer, path="reward_fixtures_hang:f")
    try:
        with pytest.raises(UserError, match="did not finish within 2 s to load"):
            ep.pool.call([(0, "reset", Example(prompt="q", answer="1"))])
        assert "reward_fixtures_hang" not in sys.modules
    finally:
        ep.close()


def test_reset_must_give_a_group_one_prompt(tokenizer):
    """reset returning other first messages for the trajectories of one example: one line (they share a prefill)."""
    ep = _episodes(tokenizer, workers=0, path="env_fixtures:DifferentPrompts")
    ep.rows = [Trajectory(i, Example(prompt="q", answer="1")) for i in range(2)]
    with pytest.raises(UserError, match="reset returned different messages"):
        ep._reset([ep.rows[0].example], [[1, 2]], 2)


def test_a_batch_whose_every_trajectory_failed_stops_the_run_in_one_line(tiny_dir, tmp_path):  # noqa: F811
    """An environment that fails on every trajectory of a rollout batch is broken, not unlucky: one line naming it."""
    from gspo.train import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tiny_dir, "env.path='env_fixtures:Raises'", "env.workers=0", "rewards.functions=[]",
                      "rollout.max_new_tokens=12", "rollout.engine='hf'")  # the bias below: the trainer's model
    trainer = Trainer(cfg, tmp_path / "run")
    _biased(trainer.actor.model, trainer.tokenizer, stop_token_ids(trainer.tokenizer)[-1], 12.0)
    with pytest.raises(UserError, match="Every trajectory of a rollout batch failed in env.path = 'env_fixtures:Raises'"):
        trainer.collector.collect()
    trainer.collector.close()


def test_tool_calls_are_read_in_each_familys_format():
    """Hermes (any number of <tool_call> blocks, an unclosed last one), Llama 3 (the turn is one JSON object, after an
    optional <|python_tag|>), Mistral ([TOOL_CALLS] and a JSON list); arguments given as a JSON string are read; a turn
    without a call is an answer; the format follows the template's own text."""
    from gspo.envs.tools import detect_format, parse_calls

    tools = {"calculator", "search"}
    hermes = parse_calls('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> b '
                         '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}', "hermes", tools)
    assert [(c.name, c.arguments, c.error) for c in hermes] == [("calculator", {"expression": "1+2"}, None),
                                                                ("search", {"q": "x"}, None)]
    llama = parse_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}', "llama3", tools)
    assert [(c.name, c.arguments) for c in llama] == [("calculator", {"expression": "2*3"})]
    mistral = parse_calls('[TOOL_CALLS][{"name": "search", "arguments": {"q": "y"}}, {"name": "nope"}]', "mistral",
                          tools)
    assert mistral[0].arguments == {"q": "y"} and "no tool named 'nope'" in mistral[1].error
    assert parse_calls("The answer is 6.", "llama3", tools) == parse_calls("6", "mistral", tools) == []
    assert parse_calls("[TOOL_CALLS] not json", "mistral", tools)[0].error.startswith("the tool call is not valid JSON")
    assert (detect_format("{{ '[TOOL_CALLS]' }}"), detect_format("<|python_tag|>"), detect_format("")) == \
        ("mistral", "llama3", "hermes")


def test_multi_turn_runs_on_every_engine_and_what_cannot_is_refused_in_one_line():
    from gspo.config import build_config

    for engine in ("auto", "graph", "hf", "vllm"):
        build_config({"env": {"tools": ["gspo.envs.builtin:calculator"]}, "rollout": {"engine": engine}})
    r3 = {"env": {"tools": ["gspo.envs.builtin:calculator"]}, "moe": {"routing_replay": "rollout"}}
    for engine in ("auto", "graph", "hf"):  # both of gspo's engines record multi-turn rows' routes
        build_config({**r3, "rollout": {"engine": engine}})


def test_an_environment_that_never_says_done_stops_at_max_turns_or_at_the_token_limit(tiny_model, tokenizer):
    """env_fixtures:NeverDone answers every turn and never ends the episode: with room, each trajectory stops after
    env.max_turns assistant turns (the last one's answer is not appended); with rollout.max_new_tokens too small for
    that, the row ends when the completion is full -- mid-turn (finish reason "length") or when the next answer no
    longer fits (its last turn complete: "stop"). Either way the reward is what the trajectory earned (0 here), never
    a failure."""
    stop = stop_token_ids(tokenizer)
    model = _biased(tiny_model, tokenizer, stop[-1], 14.0)  # turns of a token or two
    engine = HFEngine(model, tokenizer, stop_ids=stop)
    ep = _episodes(tokenizer, path="env_fixtures:NeverDone", max_turns=3)
    try:
        examples = [Example(prompt="Say something.", answer="0")]
        for max_new in (200, 12):
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0)
            rollout, result = ep.run(engine, examples, ep.encode(examples), 4, params, torch.Generator().manual_seed(0))
            assert result.first_error is None and torch.equal(result.rewards, torch.zeros(4))
            assert (rollout.lengths <= max_new).all()
            texts = [tokenizer.decode(rollout.completion_ids[i][rollout.completion_mask[i]]) for i in range(4)]
            if max_new == 200:
                assert set(rollout.finish_reasons) == {"stop"} and all(t.turns == 3 for t in result.trajectories)
                assert all(text.count("go on") == 2 for text in texts)
            else:  # the answers ("go on" and the template: ~10 ids) fit once at most
                assert all(t.turns < 3 and text.count("go on") <= 1 for t, text in zip(result.trajectories, texts))
    finally:
        ep.close()


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
               "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_whose_roles_must_alternate_gets_its_replies_joined(tokenizer):
    """A template that takes only user and assistant turns, alternating (Gemma's, Llama 2's): rendering finds that, two
    replies in a row become one user turn (a blank line apart) in the rows and in the whole rendering alike, the rows
    stay exact, and env.tools is refused in one line (no tool turns to answer a call with)."""
    import copy

    from gspo.envs.turns import Turns, check_template

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ALTERNATING
    turns = Turns(tok, stop_token_ids(tok))
    assert turns.renderer.roles == ("user",) and turns.renderer.alternates
    joined = tok.decode(turns.after([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert joined == "\n<|im_start|>user\na\n\nb<|im_end|>\n<|im_start|>assistant\n"
    check_template(turns, samples=200, roles=turns.renderer.roles)
    plain = Turns(tokenizer, stop_token_ids(tokenizer))  # SmolLM2's own: any order, tool turns
    assert plain.renderer.roles == ("user", "tool") and not plain.renderer.alternates
    with pytest.raises(UserError, match=r"the chat template has no tool turns .* leave env.tools empty") as err:
        Episodes(EnvConfig(tools=["gspo.envs.builtin:calculator"], workers=1, timeout_s=3.0), tok, stop_token_ids(tok))
    assert "\n" not in str(err.value)


def test_a_trajectory_cut_in_a_later_turn_is_truncated_and_dapo_counts_only_its_sampled_tokens(tokenizer):
    """A trajectory whose first turn ended on the stop token and whose second ran out of tokens is cut off: finish
    reason "length" (it used to stay "stop", so loss.mask_truncated trained on it); and DAPO's overlong penalty counts
    the tokens the policy sampled, not the tool results appended between its turns."""
    from types import SimpleNamespace

    from gspo.rollout.turns import TurnRows
    from gspo.collect.stage import Collector

    stop = stop_token_ids(tokenizer)[-1]
    book = TurnRows(1, SamplingParams(max_new_tokens=20, max_turn_tokens=4), lambda ended, ids: [[7] * 9] * len(ended),
                    [stop])
    assert book.sampled(0, [5, stop], [-0.1, -0.2])  # turn 1 ends on the stop token
    assert book.answer([0]) == {0: [7] * 9}  # 9 ids of tool results appended
    assert not book.sampled(0, [5, 5, 5, 5], [-0.1] * 4)  # turn 2 runs out of env.max_turn_tokens
    rollout = book.rollout(tokenizer, 0, [[1, 2]], 1)
    assert rollout.finish_reasons == ["length"] and int(rollout.lengths[0]) == 15
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=20), dapo=SimpleNamespace(overlong_cache=10))
    assert float(Collector.overlong(SimpleNamespace(cfg=cfg), rollout)[0]) == 0.0  # 6 sampled tokens: no penalty


def test_a_timed_out_tool_takes_the_processes_it_started_with_it(tokenizer, tmp_path):
    """A tool that started a process of its own and hangs past env.timeout_s: the worker is killed with its whole
    process group, so the child does not live on (it used to, re-parented, for as long as it liked)."""
    import os
    import time

    ep = _episodes(tokenizer, tools=["env_fixtures:spawns"])
    try:
        pid_file = tmp_path / "child.pid"
        text = '<tool_call>{"name": "spawns", "arguments": {"path": "%s"}}</tool_call>' % pid_file
        ep.rows = [Trajectory(0, Example(prompt="q", answer="1"))]
        said = tokenizer.decode(ep([0], [_turn(tokenizer, ep, text)])[0])
        assert "error: timed out after 3 s" in said
        child = int(pid_file.read_text())
        for _ in range(50):  # killed at once; reaped by init a moment later
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the tool's child process {child} outlived its worker")
    finally:
        ep.close()


def test_observations_the_template_cannot_render_fail_their_trajectory_and_huge_ones_are_cut(tokenizer):
    """An observation of a role SmolLM2's template does not render after an assistant turn ends its trajectory with
    a reward of NaN and a message naming the roles to use (it used to render to nothing, or raise mid-run under a
    stricter template); a megabyte observation reaches the trainer cut, saying so."""
    for path, check in (("env_fixtures:OddRole", "odd"), ("env_fixtures:Verbose", "cut")):
        ep = _episodes(tokenizer, path=path)
        try:
            ep.rows = [Trajectory(0, Example(prompt="q", answer="1"))]
            ep.pool.call([(0, "reset", ep.rows[0].example)])
            out = ep([0], [_turn(tokenizer, ep, "I open the door.")])
            t = ep.rows[0]
            if check == "odd":
                assert out == [None] and "role 'environment'" in t.error and "return the observation as user" in t.error
            else:
                said = tokenizer.decode(out[0])
                assert t.error is None and "[cut: 1000000 characters]" in said and len(said) < 21_000
        finally:
            ep.close()


def test_a_prompt_with_its_own_system_message_still_describes_the_tools(tokenizer):
    """A chat-format prompt that brings its own system message replaces data.system_prompt, as in single-turn
    training, but keeps the tools' description (SmolLM2's template renders no tools=): without it the model is never
    told the tools exist."""
    ep = _episodes(tokenizer, tools=["gspo.envs.builtin:calculator"])
    try:
        own = ep.turns.prompt([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}])
        text = tokenizer.decode(own)
        assert "You are terse." in text and "calculator" in text
        assert text.count("<|im_start|>system") == 1
    finally:
        ep.close()


def test_a_first_call_larger_than_a_pipe_waits_for_the_worker_to_load(tokenizer, monkeypatch):
    """The first chunk of calls (a rollout batch's resets: here ~1 MB, past a pipe's buffer) is sent only once the
    worker has loaded the user's code, so an environment module that blocks at import ends in its one line at the
    start-up limit, and one that raises in its own line (they used to hang in the send, or end in a BrokenPipeError
    traceback)."""
    from gspo.envs import pool

    monkeypatch.setattr(pool, "STARTUP_TIMEOUT_S", 2.0)
    big = [(i, "reset", Example(prompt=f"{i} " + "x" * 4000, answer="1")) for i in range(256)]  # distinct strings
    for path, match in (("reward_fixtures_hang:f", "did not finish within 2 s to load"),
                        ("env_fixtures_raises:Env", "this module cannot be imported")):
        ep = _episodes(tokenizer, path=path)
        try:
            with pytest.raises(UserError, match=match) as e:
                ep.pool.call(big)
            assert "\n" not in str(e.value)
        finally:
            ep.close()


def test_a_trajectory_whose_environment_was_lost_fails_even_while_it_calls_tools(tokenizer):
    """Worker 0 is killed for a tool call past env.timeout_s, and with it the environment of another trajectory it
    held. That trajectory's next turn, a tool call, ends it with a NaN reward (it used to read "its environment was
    lost" as a tool result and go on, ending with a partial reward counted in the baseline)."""
    ep = _episodes(tokenizer, path="env_fixtures:Echo", tools=["env_fixtures:sleepy", "gspo.envs.builtin:calculator"])
    try:
        call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format
        ep.rows = [Trajectory(i, Example(prompt="q", answer="1")) for i in range(2)]
        assert [s for s, _ in ep.pool.call([(t.id, "reset", t.example) for t in ep.rows])] == ["ok", "ok"]
        said = tokenizer.decode(ep([0], [_turn(tokenizer, ep, call("sleepy", '{"seconds": 30}'))])[0])
        assert "timed out after 3 s" in said and ep.rows[0].error is None  # a tool's failure is the model's to read
        out = ep([1], [_turn(tokenizer, ep, call("calculator", '{"expression": "1 + 1"}'))])
        assert out == [None] and "its environment was lost" in ep.rows[1].error
    finally:
        ep.close()


def test_two_tools_of_one_name_are_refused_in_one_line(tokenizer):
    """Tools are called by name: two functions of one name from different modules (the second used to answer for
    both, while both schemas reached the model) end in one line at start-up."""
    with pytest.raises(UserError, match="are both named 'calculator'") as e:
        _episodes(tokenizer, tools=["gspo.envs.builtin:calculator", "env_fixtures:calculator"])
    assert "\n" not in str(e.value)


def _docs_block(page: str, first_line: str) -> str:
    """The fenced code block of a docs page whose first line is ``first_line``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / page).read_text(encoding="utf-8")
    blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"docs/{page} has no single block starting {first_line!r}"
    return found[0]


def test_the_example_environment_of_the_docs_runs_as_the_page_says(tmp_path, monkeypatch):
    """docs/envs.md's my_env.py and run.toml: the class pays 0.5 a right turn over two turns (by hand), the tool adds,
    and `gspo train run.toml` collects a rollout batch with them from the folder it runs in, in worker processes: on a
    tiny model whose turns end, some trajectories reach the second turn, whose prompt is the page's question."""
    import tomllib

    from gspo.config import build_config
    from gspo.train import Trainer
    from gspo.types import Example
    from test_equivalence import build_turn_model

    (tmp_path / "my_env.py").write_text(_docs_block("envs.md", "# my_env.py"))
    data = tomllib.loads(_docs_block("envs.md", "# run.toml: gspo train run.toml"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_env

    assert my_env.add(123, 456) == "579"
    env = my_env.Confirm()
    assert env.reset(Example(prompt="What is 3 + 4?", answer="7", meta={})) is None
    assert env.step("It is 7.") == ("Are you sure? Give the final number again.", 0.5, False)
    assert env.step("8") == (None, 0.0, True)

    model = build_turn_model(tmp_path / "model")
    cfg = build_config(data, [f"model.name='{model}'", "model.device='cpu'", "rollout.prompts_per_batch=2",
                              "rollout.group_size=4", "rollout.max_new_tokens=24", "env.max_turn_tokens=4",
                              "env.workers=1", "rewards.workers=0", "log.progress=false", "rollout.engine='hf'",
                              "train.steps=2", "train.minibatches=2"], device="cpu")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        batch = trainer.collector.collect()
        texts = [trainer.tokenizer.decode(row) for row in batch.rollout.completion_ids]
        assert batch.metrics["env/turns_mean"] > 1 and any("Are you sure?" in t for t in texts), texts
        assert batch.metrics["env/failures"] == 0 and 0.0 <= batch.metrics["reward/mean"] <= 1.0
    finally:
        trainer.collector.close()
        trainer.release()
