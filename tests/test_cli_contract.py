"""The command line's contract for bad input, by construction and by fuzzing: whatever a user types, a mistake ends in
one line `gspo: error: ...` and exit code 2, never a traceback.

Hand-picked neighbours of the documented cases first, then property-based tests (hypothesis) that throw arbitrary
override values, malformed TOML files and broken data rows at `gspo train` and `gspo config` parsing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gspo.runlog.metrics import read_jsonl

from test_trainer import tiny_dir  # noqa: F401,E402  (the module fixture)

from gspo.cli import main

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, example, given, settings, strategies as st  # noqa: E402


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err[-1500:])
    assert "Traceback" not in err and err.count("gspo: error:") == 1, err[-1500:]
    return err


BAD_OVERRIDES = [
    "train.lr=nan", "loss.eps_high=nan", "train.lr=inf", "rewards.timeout_s=inf", "train.logprob_chunk=0",
    "train.adam_betas=[0.9]", "train.adam_betas=[0.9, 1.5]", "model.device='gpu'", "log.run_dir='runs/{algo}'",
    "log.run_dir='runs/{0}'", "train.lr=-1", "train.lr=1e999", "rewards.workers=-1", "train.weight_decay=-0.1",
    "train.steps=10**400", "=5", "rollout.top_p=nan", "seed=1.5", "data.max_prompt_tokens=0",
    "train.max_nonfinite_steps=0", "log.keep_checkpoints=-1", "sentinel.lr_factor=nan", "seed=18446744073709551616",
    "log.run_dir='runs/{seed[0]}'", "log.run_dir='runs/{algorithm.upper}'",
]


@pytest.mark.parametrize("override", BAD_OVERRIDES)
def test_bad_values_that_pass_the_type_check_end_in_one_line(override, capsys, tmp_path):
    """Numbers that type-check but mean nothing (NaN, inf, 0 chunks, one Adam beta), misnamed devices and placeholders."""
    _one_line_error(capsys, ["train", "--run-dir", str(tmp_path / "r"), override])


def test_config_files_that_are_not_what_they_claim(capsys, tmp_path):
    """A config in Latin-1, a binary file, overrides that are not tables, a value nested thousands deep."""
    cases = {"latin1.toml": "name = 'caf\xe9'\n".encode("latin-1"), "binary.toml": bytes(range(256)),
             "overrides.toml": b"overrides = 5\n", "nested.toml": ("a = " + "[" * 5000 + "]" * 5000 + "\n").encode()}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        _one_line_error(capsys, ["train", str(tmp_path / name), "--run-dir", str(tmp_path / f"r-{name}")])


def test_other_subcommands_refuse_bad_flags(capsys, tmp_path):
    """eval with --n 0 or --batch-size 0, summary of an empty directory, report into a file, compare with an unknown
    or empty algorithm list: each one line, before any work."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for argv in (["eval", "--n", "0"], ["eval", "--batch-size", "0"], ["eval", "--samples", "-1"],
                 ["summary", str(tmp_path / "empty")], ["summary", str(tmp_path / "nowhere")],
                 ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "file")],
                 ["compare", "--algos", "gspo,nosuch", "--out", str(tmp_path / "c")],
                 ["compare", "--algos", ",", "--out", str(tmp_path / "c2")],
                 ["compare", "--seeds", "one", "--out", str(tmp_path / "c3")]):
        _one_line_error(capsys, argv)


def _subcommands():
    import argparse

    from gspo.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _value_actions():
    """(subcommand, option string or positional name, action) for every argument that takes a value."""
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.nargs != 0:
                yield name, (action.option_strings[0] if action.option_strings else action.dest), action


def test_every_flag_of_every_subcommand_is_validated_where_it_enters():
    """By construction: each value-taking argument has a gspo.cli validator as its type, or choices, or is one of the
    few values checked at their single point of use (CHECKED_DOWNSTREAM). A flag added later without a check fails
    here, not in a user's hands."""
    from gspo.cli import CHECKED_DOWNSTREAM

    unchecked = [(cmd, flag) for cmd, flag, action in _value_actions()
                 if not action.choices and getattr(action.type, "__module__", None) != "gspo.cli"
                 and flag not in CHECKED_DOWNSTREAM]
    assert not unchecked, unchecked
    assert {cmd for cmd, _, _ in _value_actions()} >= {"train", "eval", "summary", "compare", "report", "probe", "upcycle"}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths of every kind a flag can be given: a run directory, an empty directory, a file, an empty file, a path
    under a file, a missing one, a read-only directory, a path with a NUL, one with a byte that is not UTF-8 (as
    Python decodes it from the command line), an empty and a blank one."""
    root = tmp_path_factory.mktemp("places")
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "empty").mkdir()
    (root / "file").write_text("x")
    (root / "empty_file").write_text("")
    (root / "ro").mkdir(mode=0o555)
    (root / "c.toml").write_text("seed = 1\n")
    return {"toml": str(root / "c.toml"), "run": str(root / "run"), "empty": str(root / "empty"), "file": str(root / "file"),
            "empty_file": str(root / "empty_file"), "under_file": str(root / "file" / "x"),
            "missing": str(root / "no" / "such"), "ro": str(root / "ro" / "x"), "json": str(root / "out.json"),
            "root": str(root), "nul": str(root / "a\x00b"), "not_utf8": str(root / "caf\udce9"), "blank": " "}


FLAG_VALUES = st.one_of(
    st.text(max_size=16), st.integers(-10**20, 10**20).map(str), st.floats().map(str),
    st.sampled_from(["", " ", ",", ",,", "-", "--", "nan", "inf", "1e999", "0", "-1", "1,", "gspo,", "noise", "\x00",
                     "a\nb", "1,1", "gspo,gspo", "gspo,,grpo", "run", "empty", "file", "empty_file", "under_file",
                     "missing", "ro", "json", "nul", "not_utf8", "blank"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(target=("train", "--run-dir"), raw="nul")  # parsed, then a ValueError traceback when the directory was made
@example(target=("compare", "--algos"), raw="gspo,gspo")
@given(target=st.sampled_from([(c, f) for c, f, _ in _value_actions() if f not in ("config", "overrides")]),
       raw=FLAG_VALUES)
def test_fuzzed_flags_of_every_subcommand_parse_or_end_in_one_line(target, raw, places, capsys):
    """Any value for any flag of any subcommand (paths of every kind among them): the command line parses, or `gspo`
    ends in one line and exit 2 before doing any work."""
    from gspo.cli import parse_args
    from gspo.errors import UserError

    cmd, flag = target
    value = places.get(raw, raw)
    argv = _argv_with(cmd, flag, value, places)
    try:
        parse_args(argv)
    except UserError as e:
        assert "\n" not in str(e).strip() and str(e).strip(), (argv, str(e))
        _one_line_error(capsys, argv)
    else:  # no argument takes a NUL or a byte that is not UTF-8: each fails later, in the middle of the work
        assert "\x00" not in value and "\udce9" not in value, argv


def _argv_with(cmd: str, flag: str, value: str, places: dict) -> list[str]:
    """A command line of ``cmd`` whose argument ``flag`` is ``value`` and whose other required arguments are valid."""
    required = {"train": [places["toml"]], "summary": [places["run"]], "report": [places["run"], "--out", places["empty"]],
                "compare": ["--out", places["empty"]], "probe": ["noise", "--out", places["empty"]],
                "upcycle": ["--out", places["missing"]], "export": [places["run"], "--out", places["missing"]]}.get(cmd, [])
    if flag.startswith("--"):
        return [cmd, *required, f"{flag}={value}"]
    if flag == "run_dirs":
        return [cmd, "--", value] if cmd == "summary" else [cmd, "--out", places["empty"], "--", value]
    if flag == "what":  # probe's
        return [cmd, value, "--out", places["empty"]]
    if flag == "checkpoint":  # export's
        return [cmd, "--out", places["missing"], "--", value]
    # the config file of a subcommand
    out = required[-2:] if cmd in ("compare", "probe", "upcycle") else []
    return [cmd, *(["noise"] if cmd == "probe" else []), value, *out]


# What each kind of path argument (gspo.cli._path) must refuse, besides what every path refuses (an empty or blank
# path, a NUL, a byte that is not UTF-8): an input missing or of the wrong kind, an output that cannot be made.
REFUSED = {"in file": ["missing", "empty", "empty_file"], "run dir": ["missing", "file", "empty", "empty_file"],
           "checkpoint": ["missing", "file", "empty_file"], "out dir": ["file", "empty_file", "under_file", "ro"],
           "out file": ["empty", "under_file", "ro"], "new dir": ["empty", "file", "under_file", "ro"]}
EVERY_PATH_REFUSES = ["", "blank", "nul", "not_utf8"]


def _path_arguments():
    """(subcommand, argument, kind) for every argument whose validator is a gspo.cli path (its ``path`` kind)."""
    return [(cmd, flag, action.type.path) for cmd, flag, action in _value_actions() if hasattr(action.type, "path")]


def test_every_path_argument_refuses_the_paths_it_cannot_use(places, capsys):
    """By construction, over every subcommand: each path argument (found by its validator's kind, so a new one is
    covered when it is added) refuses, in one line before any work, a path that is empty, blank, has a NUL or a byte
    that is not UTF-8, and the paths of the wrong kind for it: a missing or empty input, a directory where a file is
    wanted and a file where a directory is, an output under a file or in a read-only directory."""
    targets = _path_arguments()
    kinds = {kind for _, _, kind in targets}
    assert kinds == set(REFUSED), kinds  # a new kind of path says here what it refuses
    assert {cmd for cmd, _, _ in targets} >= {"train", "eval", "summary", "compare", "report", "probe", "upcycle",
                                                "export"}
    from gspo.cli import parse_args
    from gspo.errors import UserError

    for cmd, flag, kind in targets:
        for name in EVERY_PATH_REFUSES + REFUSED[kind]:
            if name == "ro" and os.access(Path(places["ro"]).parent, os.W_OK):  # root writes anywhere
                continue
            argv = _argv_with(cmd, flag, places.get(name, name), places)
            with pytest.raises(UserError):  # refused by the parser (main would start the work)
                parse_args(argv)
            err = _one_line_error(capsys, argv)
            assert flag.lstrip("-").replace("-", "_") in err.replace("-", "_") or flag in err, (argv, err)


def test_an_unknown_flag_anywhere_ends_in_one_line(places, capsys):
    """Every subcommand: an unknown flag before, between or after valid arguments (with or without a value) is one
    line naming it, before any work."""
    from gspo.cli import parse_args
    from gspo.errors import UserError

    for cmd in _subcommands():
        valid = _argv_with(cmd, "--x", "", places)[:-1] if cmd != "config" else [cmd, "--markdown"]
        for bogus in (["--bogus"], ["--bogus=1"], ["-z"], ["--bogus=x=1"]):
            with pytest.raises(UserError, match="unrecognized arguments: .*(--bogus|-z)"):
                parse_args([*valid, *bogus])
            _one_line_error(capsys, [*valid, *bogus])
            with pytest.raises(UserError, match="unrecognized arguments"):
                parse_args([valid[0], *bogus, *valid[1:]])
            _one_line_error(capsys, [valid[0], *bogus, *valid[1:]])


def _keys() -> list[str]:
    from gspo.config import field_docs

    return [key for key, _, _ in field_docs()] + ["no.such_key", "sentinel", "lora.rank.x"]


KEYS = _keys()  # every key of the schema, so a key added later is fuzzed without editing this list
VALUES = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.booleans(), st.lists(st.floats(allow_nan=True), max_size=3), st.lists(st.text(max_size=6), max_size=3),
                   st.sampled_from(["task", "x:y", "gspo.rewards.builtin:last_number", "", "rollback", "stop", "auto",
                                    "all-linear", "embed_tokens", "fsdp", "rollout", "old"]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_fuzzed_overrides_keep_the_contract(key, value, capsys, tmp_path):
    """Any value for any key: the config either builds (then `gspo config`-level parsing is done) or the command ends
    in one line. `train` is refused before loading a model because the run directory is not given a model that loads:
    the check is that parsing never escapes as a traceback."""
    from gspo.config import build_config
    from gspo.errors import UserError

    text = f"{key}={json.dumps(value) if not isinstance(value, str) else repr(value)}"
    try:
        build_config({}, [text], device="cpu")
    except UserError:
        return
    # Built: a valid config. Nothing more to check here (training it is the trainer tests' business).


@settings(max_examples=80, deadline=None)
@given(body=st.text(max_size=200))
def test_fuzzed_toml_files_keep_the_contract(body, tmp_path_factory):
    """Arbitrary text as a config file: it loads and builds, or fails with a UserError (the CLI's one line)."""
    from gspo.config import build_config, load_toml
    from gspo.errors import UserError

    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text(body, encoding="utf-8", errors="surrogatepass") if "\ud800" not in body else path.write_bytes(b"\xff")
    try:
        build_config(load_toml(path), device="cpu")
    except UserError:
        pass


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.one_of(
    st.dictionaries(st.sampled_from(["question", "answer", "prompt", "x"]),
                    st.one_of(st.none(), st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3),
                              st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.text(max_size=5)),
                                       max_size=2)), max_size=4),
    st.integers(), st.text(max_size=10)), min_size=1, max_size=6))
def test_fuzzed_data_rows_keep_the_contract(rows, tmp_path_factory):
    """Arbitrary JSONL rows (missing fields, null answers, numbers, message lists of the wrong shape) for the gsm8k and
    jsonl tasks: the dataset builds and every example renders to a prompt, or a UserError names the row."""
    from gspo.data import build_dataset
    from gspo.errors import UserError
    from gspo.prompts import encode_prompts

    path = tmp_path_factory.mktemp("data") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer()
    for task, extra in (("gsm8k", {}), ("jsonl", {"prompt_field": "question", "answer_field": "answer"})):
        try:
            ds = build_dataset({"task": task, "path": str(path), "seed": 0, **extra})
            encode_prompts(tok, [ds[i] for i in range(len(ds))])
        except UserError:
            pass


_NASTY = [b"\x00", b"\xe9", b"\xef\xbb\xbf", b"\xff\xfe", b"\r", b"\\ud800", b"\\udfff", b"[", b'"', b"\n", b"\x85",
          b"\xc3", b"\xf0\x9f", b"NaN", b"1" * 5000, b"[" * 3000]


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries({"question": st.text(max_size=12), "answer": st.text(max_size=8)}),
                     min_size=1, max_size=4),
       edits=st.lists(st.tuples(st.floats(0, 1), st.one_of(st.sampled_from(_NASTY), st.binary(max_size=4))),
                      max_size=3))
def test_fuzzed_data_file_bytes_keep_the_contract(rows, edits, tmp_path_factory):
    """A data file's bytes, not just its rows: valid JSONL with bytes inserted anywhere (Latin-1 letters, NUL, byte-order
    marks of UTF-8 and UTF-16, carriage returns, lone surrogate escapes, nesting and numbers past the parser's limits,
    truncated UTF-8). The dataset builds and every prompt encodes, or one line names the file (and the line, when one
    line is at fault, with a number the file has)."""
    import re

    from gspo.data import build_dataset
    from gspo.errors import UserError
    from gspo.prompts import encode_prompts

    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    for where, chunk in sorted(edits, reverse=True):
        at = int(where * len(data))
        data = data[:at] + chunk + data[at:]
    path = tmp_path_factory.mktemp("data") / "d.jsonl"
    path.write_bytes(data)
    for task, extra in (("gsm8k", {}), ("jsonl", {"prompt_field": "question", "answer_field": "answer"})):
        try:
            ds = build_dataset({"task": task, "path": str(path), "seed": 0, **extra})
            encode_prompts(_tokenizer(), [ds[i] for i in range(len(ds))])
        except UserError as e:
            msg = str(e)
            assert "\n" not in msg and str(path) in msg, msg
            line = re.match(re.escape(str(path)) + r":(\d+):", msg)
            assert line is None or 1 <= int(line.group(1)) <= data.count(b"\n") + 1, msg


@pytest.mark.parametrize("name,data", [
    ("latin1", b'{"question": "caf\xe9?", "answer": "1"}\n'),
    ("utf16", '{"question": "q", "answer": "1"}\n'.encode("utf-16")),
    ("nul", b'{"question": "q", "answer": "1"}\n\x00\x00\n'),
    ("not-an-object", b'{"question": "q", "answer": "1"}\n[1, 2]\n'),
    ("surrogate", b'{"question": "\\ud800", "answer": "1"}\n'),
], ids=lambda v: v if isinstance(v, str) else "")
def test_data_files_in_any_encoding_end_in_one_line(name, data, capsys, tmp_path, tiny_dir):  # noqa: F811
    """`gspo train` on a data file that is not UTF-8 JSON objects: one line naming the file and the line (a Latin-1
    byte used to end in a UnicodeDecodeError traceback)."""
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(data)
    err = _one_line_error(capsys, ["train", "--run-dir", str(tmp_path / "r"), f"model.name='{tiny_dir}'",
                                   "data.task='jsonl'", f"data.path='{path}'", "rewards.workers=0",
                                   "rewards.functions=[{path='gspo.rewards.builtin:last_number'}]"])
    assert str(path) in err, err


_TOK = []


def _tokenizer():
    if not _TOK:
        from conftest import ASSETS
        from transformers import AutoTokenizer

        _TOK.append(AutoTokenizer.from_pretrained(ASSETS))
    return _TOK[0]


@st.composite
def _whole_run_overrides(draw):
    """Settings a user may combine freely, drawn so that most combinations are valid (the group shape divides into
    minibatches, steps are a multiple of them) and some are not (to check those end in one line)."""
    from gspo.algorithms.losses import AGGREGATIONS, LEVELS
    from gspo.config import PRESETS

    ppb, group = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    minibatches = draw(st.sampled_from([d for d in range(1, ppb * group + 1) if (ppb * group) % d == 0]))
    chosen = {
        "algorithm": draw(st.sampled_from(list(PRESETS))), "seed": draw(st.integers(0, 2**31)),
        "rollout.prompts_per_batch": ppb, "rollout.group_size": group, "train.minibatches": minibatches,
        "train.steps": minibatches * draw(st.integers(1, 2)),
        "rollout.max_new_tokens": (new := draw(st.integers(1, 8))), "rollout.temperature": draw(st.sampled_from([0.3, 1.0, 1.7])),
        "rollout.top_p": draw(st.sampled_from([0.05, 0.5, 1.0])), "rollout.top_k": draw(st.sampled_from([0, 1, 5])),
        "train.micro_batch_size": draw(st.sampled_from([0, *(d for d in range(1, ppb * group // minibatches + 1)
                                                             if (ppb * group // minibatches) % d == 0)])), "train.packing": draw(st.sampled_from(["auto", "on", "off"])),
        "train.logprob_chunk": draw(st.sampled_from([1, 7, 1024])), "train.warmup_steps": draw(st.integers(0, 3)),
        "train.schedule": draw(st.sampled_from(["constant", "cosine", "linear"])),
        "train.old_logprobs": draw(st.sampled_from(["recompute", "rollout"])),
        "loss.level": draw(st.sampled_from([None, *LEVELS])), "loss.aggregation": draw(st.sampled_from([None, *AGGREGATIONS])),
        "loss.allow_length_weighted_sequence": True,
        "loss.beta": draw(st.sampled_from([0.0, 0.04])), "loss.mask_truncated": draw(st.sampled_from([None, True, False])),
        "dapo.dynamic_sampling": draw(st.sampled_from([None, True, False])),
        "dapo.max_resample_rounds": draw(st.integers(1, 2)),
        "dapo.overlong_penalty": draw(st.sampled_from([None, True, False])), "dapo.overlong_cache": draw(st.integers(1, new)),
        "log.histograms": draw(st.booleans()), "log.trace_every": draw(st.integers(0, 2)),
        "log.samples_per_batch": draw(st.integers(0, 3)), "sentinel.reward_drop": draw(st.sampled_from([0.0, 0.5])),
        "sentinel.action": draw(st.sampled_from(["warn", "stop", "rollback"])),
        "sentinel.entropy_min": draw(st.sampled_from([0.0, 0.0, 0.5, 50.0])), "sentinel.window": draw(st.integers(1, 3)),
        "sentinel.seq_ratio_log_max": draw(st.sampled_from([0.0, 1e-6, 5.0])),
        "sentinel.truncated_max": draw(st.sampled_from([0.0, 0.0, 0.99])),
        "sentinel.lr_factor": draw(st.sampled_from([0.1, 0.5])), "sentinel.max_rollbacks": draw(st.integers(0, 2)),
        "log.profile_batch": draw(st.integers(0, 2)),
        "loss.step_credit": draw(st.sampled_from([None, None, "trainer_rewards:every_third_char"])),
    }
    if chosen["loss.step_credit"]:  # per-token advantages need a token-level ratio
        chosen["loss.level"] = draw(st.sampled_from(["token", "sequence_token"]))
    if draw(st.integers(0, 5)) == 0:  # now and then a neighbour of the valid space
        key, bad = draw(st.sampled_from([("train.steps", minibatches + 1 if minibatches > 1 else 0),
                                         ("rollout.group_size", 1), ("train.minibatches", ppb * group + 1),
                                         ("rollout.top_p", 0.0), ("dapo.overlong_cache", -1),
                                         ("rollout.temperature", 0.0), ("train.micro_batch_size", -1),
                                         ("sentinel.window", 0), ("sentinel.lr_factor", 1.5), ("log.profile_batch", -1),
                                         ("loss.step_credit", "trainer_rewards:nope"), ("sentinel.truncated_max", 1.5),
                                         ("loss.step_credit", "task")]))
        chosen[key] = bad
    return chosen


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@pytest.mark.slow
@given(chosen=_whole_run_overrides())
def test_fuzzed_whole_training_runs_finish_or_end_in_one_line(chosen, tiny_dir, tmp_path_factory, capsys):  # noqa: F811
    """Whole `gspo train` runs on a tiny model with settings drawn at random from everything a user may combine
    (algorithms, group shapes, packing, chunking, schedules, DAPO, KL, sentinel actions, engine log-probs): each run
    either finishes with exit 0 and a run directory that passes check_run_dir, or ends in one line with exit 2."""
    from test_faults import check_run_dir

    run = tmp_path_factory.mktemp("run") / "r"
    overrides = [f"{k}={_toml(v)}" for k, v in chosen.items() if v is not None]
    argv = ["train", f"model.name='{tiny_dir}'", "model.device='cpu'", "rewards.workers=0", "log.progress=false",
            "rewards.functions=[{path='trainer_rewards:text_length'}]", "log.checkpoint_every=1", *overrides,
            "--run-dir", str(run)]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    if code == 2:
        assert err.count("gspo: error:") == 1, err[-3000:]
        event("refused: " + err.split("gspo: error:")[1].strip()[:90])
        return
    assert code == 0, (argv, err[-3000:])
    rows = read_jsonl(run / "metrics.jsonl")
    event("trained" if rows and rows[-1]["step"] == chosen["train.steps"] else "stopped by the sentinel")
    check_run_dir(run, len(rows))


def _toml(value) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
