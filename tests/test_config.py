"""Config building: presets, overrides, device tables and every guard's message."""
import logging
from pathlib import Path

import pytest

from gspo.config import PRESETS, build_config, field_docs, load_toml
from gspo.errors import UserError


def test_presets_fill_the_loss_knobs():
    """Each algorithm word sets its paper's level, clip range and aggregation."""
    gspo = build_config({"algorithm": "gspo"})
    assert (gspo.loss.level, gspo.loss.eps_low, gspo.loss.eps_high, gspo.loss.aggregation) == ("sequence", 3e-4, 4e-4, "seq-mean-token-mean")
    assert gspo.loss.beta == 0.0 and not gspo.dapo.dynamic_sampling
    grpo = build_config({"algorithm": "grpo"})
    assert (grpo.loss.level, grpo.loss.eps_low, grpo.loss.eps_high) == ("token", 0.2, 0.27)  # the GSPO paper's GRPO
    dapo = build_config({"algorithm": "dapo"})
    assert (dapo.loss.eps_low, dapo.loss.eps_high, dapo.loss.aggregation) == (0.2, 0.28, "token-mean")
    assert dapo.dapo.dynamic_sampling and dapo.dapo.overlong_penalty and dapo.loss.mask_truncated
    assert build_config({"algorithm": "gspo_token"}).loss.level == "sequence_token"
    assert build_config({"algorithm": "dr_grpo"}).loss.advantage_scale == "none"


def test_explicit_fields_override_the_preset():
    """A knob set in the file or on the command line wins over the preset."""
    cfg = build_config({"algorithm": "gspo", "loss": {"eps_high": 1e-3}}, ["loss.eps_low=2e-4", "rollout.group_size=4"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.rollout.group_size) == (2e-4, 1e-3, 4)


def test_device_override_table_applies_only_on_that_device():
    """``[overrides.cpu]`` changes the config on a CPU and not on CUDA."""
    data = {"train": {"steps": 160}, "overrides": {"cpu": {"train.steps": 8}}}
    assert build_config(data, device="cpu").train.steps == 8
    assert build_config(data, device="cuda").train.steps == 160


def test_overrides_are_checked_against_the_settings_the_run_uses(tmp_path):
    """`train.steps=6` on the quickstart is a valid CPU run (its [overrides.cpu] sets 2 minibatches), though not one
    with the file's 4: load_config checks once, after the device's table applies (it used to check before and refuse
    the CPU run); the same override on a GPU is still refused in one line."""
    from gspo.config import load_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
    cfg = load_config(quickstart, ["train.steps=6", "model.device='cpu'"])
    assert (cfg.train.steps, cfg.train.minibatches) == (6, 2)
    with pytest.raises(UserError, match="multiple of train.minibatches = 4"):
        build_config(load_toml(quickstart), ["train.steps=6"], device="cuda")
    bad = tmp_path / "bad.toml"  # a setting no device's table fixes is refused as before
    bad.write_text('[train]\nminibatches = 4\n[overrides.cpu]\n"train.lr" = 1e-5\n')
    with pytest.raises(UserError, match="multiple of train.minibatches = 4"):
        load_config(bad, ["train.steps=6", "model.device='cpu'"])
    with pytest.raises(UserError, match="model.device = 'gpu' is not a device"):  # the first pass's one setting
        load_config(quickstart, ["model.device='gpu'"])


def test_unknown_key_suggests_the_closest():
    """A misspelt key names itself and the closest valid key."""
    with pytest.raises(UserError, match="did you mean 'eps_high'"):
        build_config({"loss": {"eps_hihg": 0.1}})
    with pytest.raises(UserError, match="did you mean 'gspo'"):
        build_config({"algorithm": "gsop"})


def test_wrong_type_names_key_and_value():
    """A value of the wrong type names the key, the expected type and the value."""
    with pytest.raises(UserError, match="'rollout.group_size' must be int"):
        build_config({}, ["rollout.group_size=eight"])
    with pytest.raises(UserError, match="must be bool"):
        build_config({"model": {"gradient_checkpointing": 1}})


def test_malformed_toml_and_missing_file(tmp_path):
    """A broken TOML file and a missing one each end in one sentence naming the file."""
    bad = tmp_path / "bad.toml"
    bad.write_text("algorithm = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_toml(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


@pytest.mark.parametrize("data, overrides, match", [
    ({"algorithm": "gspo", "loss": {"aggregation": "token-mean"}}, [], "allow_length_weighted_sequence"),
    ({"algorithm": "gspo_token", "loss": {"aggregation": "seq-mean-token-sum-norm"}}, [], "allow_length_weighted_sequence"),
    ({}, ["rollout.group_size=1"], "group_size = 1"),
    ({}, ["train.minibatches=3"], "pick a divisor of 256"),
    ({}, ["train.steps=10"], "multiple of train.minibatches"),
    ({}, ["train.micro_batch_size=5"], "micro_batch_size"),
    ({}, ["loss.level='tokens'"], "loss.level"),
    ({}, ["train.old_logprobs='engine'"], "recompute, rollout"),
    ({}, ["rollout.temperature=0"], "temperature"),
    ({}, ["loss.beta=-1"], "beta"),
    ({"algorithm": "dapo"}, ["dapo.overlong_cache=999"], "overlong_cache"),
    ({"rewards": {"functions": [{"path": "mymodule.reward"}]}}, [], "module:function"),
    ({}, ["train.steps"], "key=value"),
    ({}, ["sentinel.window=0"], "sentinel.window"),
    ({}, ["sentinel.lr_factor=0"], "sentinel.lr_factor"),
    ({}, ["sentinel.reward_drop=-1"], "sentinel thresholds"),
    ({}, ["log.trace_every=-1"], "log.trace_every"),
    ({}, ["log.profile_batch=-1"], "log.profile_batch = -1 is invalid; use 0 \\(off\\) or the 1-based index"),
    ({}, ["sentinel.truncated_max=1.0"], "sentinel.truncated_max = 1.0 is invalid; use 0 \\(off\\) or a fraction below 1"),
    ({}, ["sentinel.truncated_max=-0.1"], "sentinel.truncated_max"),
    ({}, ["sentinel.action='retry'"], "sentinel.action"),
    ({}, ["sentinel.action='rollback'"], "every detector off .* never acts; turn one on"),
    ({}, ["sentinel.action='stop'", "sentinel.window=3"], "every detector off"),
    ({}, ["rollout.engine_weight_bits=1"], "must be 0 \\(off\\) or 2-16"),
    ({}, ["rollout.engine_weight_bits=17"], "must be 0 \\(off\\) or 2-16"),
    ({"algorithm": "grpo"}, ["loss.step_credit='task'"], "data.task = 'arithmetic' has no built-in step credit"),
    ({}, ["loss.mismatch_correction='truncate'"], "tis, sequence_mask, icepop"),
    ({}, ["loss.mismatch_bounds=[0.5, 2.0]"], "is set but loss.mismatch_correction = 'off'"),
    ({}, ["loss.mismatch_correction='icepop'", "loss.mismatch_bounds=[2.0, 0.5]"], "0 <= low < high"),
    ({}, ["loss.mismatch_correction='tis'", "train.old_logprobs='rollout'"], "set train.old_logprobs = 'recompute'"),
    ({}, ["model.gpu_memory=0"], "share of the GPU in \\(0, 1\\]"),
    ({}, ["model.gpu_memory=1.5"], "model.gpu_memory = 1.5"),
    ({}, ["model.gpu_memory=0.2", "rollout.engine='vllm'"], "must be below model.gpu_memory = 0.2"),
])
def test_every_guard_raises_with_the_fix(data, overrides, match):
    """Each invalid setting raises a UserError whose message names the fix."""
    with pytest.raises(UserError, match=match):
        build_config(data, overrides)


def test_length_weighted_sequence_allowed_explicitly():
    """The sequence-ratio + token-sum combination is accepted when the user asks for it."""
    cfg = build_config({"algorithm": "gspo", "loss": {"aggregation": "token-mean", "allow_length_weighted_sequence": True}})
    assert cfg.loss.aggregation == "token-mean"


def test_single_minibatch_and_wide_sequence_clip_warn(caplog):
    """One minibatch per rollout batch and a GRPO-size clip on a sequence ratio each log a warning."""
    with caplog.at_level(logging.WARNING, logger="gspo"):
        build_config({}, ["train.minibatches=1"])
        build_config({"algorithm": "gspo"}, ["loss.eps_low=0.2", "loss.eps_high=0.2"])
    text = caplog.text
    assert "ratio is always 1" in text and "clips almost nothing" in text


def test_reward_functions_table():
    """Reward functions are read from an array of tables with weights."""
    cfg = build_config({"rewards": {"functions": [{"path": "a:b", "weight": 0.5}, {"path": "c:d"}]}})
    assert [(r.path, r.weight) for r in cfg.rewards.functions] == [("a:b", 0.5), ("c:d", 1.0)]


def test_every_field_is_documented():
    """Every config field carries a docstring (the README reference is generated from them)."""
    rows = field_docs()
    assert len(rows) > 40
    assert all(doc for _, _, doc in rows), [k for k, _, d in rows if not d]
    assert set(PRESETS) == {"gspo", "gspo_token", "grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "cispo", "gmpo",
                            "sapo", "ppo"}


def test_shipped_configs_build(tmp_path):
    """The configs in configs/ build on both device types, and so does every arm of the `gspo compare` commands their
    comments give (the experiments' configs)."""
    import pathlib
    import re
    import shlex

    from gspo.commands.arms import parse_arm

    paths = sorted(pathlib.Path(__file__).parent.parent.joinpath("configs").rglob("*.toml"))
    assert any("experiments" in p.parts for p in paths)
    commands = 0
    for path in paths:
        data = load_toml(path)
        for device in ("cpu", "cuda"):
            build_config(data, device=device)
        lines = re.findall(r"^#.*?(gspo compare .*)$", path.read_text(), flags=re.M)
        commands += len(lines)
        for line in lines:
            argv = shlex.split(line)
            overrides = [a for a in argv[3:argv.index("--algos")] if "=" in a]
            for arm in argv[argv.index("--algos") + 1].split(","):
                preset, extra = parse_arm(arm)
                build_config(data, [*overrides, f"algorithm={preset!r}", *(f"{k}={v!r}" for k, v in extra.items())],
                             device="cuda")
    assert commands >= 4  # numbered_words' one and arithmetic's three


def test_clip_range_follows_an_explicit_level():
    """Choosing a ratio level without a clip range takes that level's range, not the algorithm's."""
    cfg = build_config({"algorithm": "gspo"}, ["loss.level='token'"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.27)
    cfg = build_config({"algorithm": "grpo"}, ["loss.level='sequence'"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
    cfg = build_config({"algorithm": "grpo"}, ["loss.level='sequence'", "loss.eps_high=1e-3"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 1e-3)


def test_rloo_and_reinforce_pp_presets_and_their_refusals():
    """The presets fill the baseline and scale they are defined by (and only what is unset); process credit on top of
    a baseline other than the group mean is refused in one line."""
    rloo, rpp = build_config({"algorithm": "rloo"}).loss, build_config({"algorithm": "reinforce_pp"}).loss
    assert (rloo.advantage_baseline, rloo.advantage_scale, rloo.level) == ("leave_one_out", "none", "token")
    assert (rpp.advantage_baseline, rpp.advantage_scale, rpp.aggregation) == ("none", "tokens", "token-mean")
    assert build_config({"algorithm": "gspo"}).loss.advantage_baseline == "group_mean"
    assert build_config({"algorithm": "reinforce_pp", "loss": {"advantage_baseline": "group_mean"}}).loss.advantage_scale \
        == "tokens"  # REINFORCE++-baseline
    with pytest.raises(UserError, match="loss.advantage_baseline = 'mean' is not one of group_mean, leave_one_out"):
        build_config({"loss": {"advantage_baseline": "mean"}})
    with pytest.raises(UserError, match="loss.step_credit adds process credit to group-centred advantages"):
        build_config({"algorithm": "rloo", "loss": {"step_credit": "task"}, "data": {"task": "running_sum"}})
