"""Per-token advantages from process credit (loss.step_credit): character ends of steps mapped to token ends with the
real tokenizer, the run's advantages per token, and the one-line refusals."""
import pytest
import torch

from gspo.errors import UserError
from gspo.rewards.steps import token_starts
from gspo.train import Trainer

from test_trainer import tiny_config, tiny_dir  # noqa: F401  (the module fixture)


@pytest.mark.parametrize("text", [
    "0 + 3 = 3\n3 + 5 = 8\nAnswer: 8",
    "  leading spaces and    runs\n\n\nof newlines",
    "café, naïve: é è ê — “quotes”",
    "emoji 🙂🙃 split across byte tokens 🧮",
])
def test_token_starts_are_where_each_token_begins_in_the_decoded_text(tokenizer, text):
    """Each token starts where the text decoded from the tokens before it ends; a token inside a multi-byte character
    starts where that character does (its prefix decodes the partial character as U+FFFD)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    starts = token_starts(tokenizer, ids, decoded)
    assert len(starts) == len(ids) and starts[0] == 0 and starts == sorted(starts)
    for t in range(len(ids)):
        prefix = tokenizer.decode(ids[:t], skip_special_tokens=True)
        whole = prefix.rstrip("\ufffd")
        assert starts[t] == len(whole) and decoded.startswith(whole)


def test_a_gspo_token_run_trains_on_per_token_advantages(tiny_dir, tmp_path):  # noqa: F811
    """GSPO-token with step credit: the batch's advantages are (N, T), constant between step ends, equal to the
    outcome advantage after a completion's last step, and the run trains with finite losses."""
    cfg = tiny_config(tiny_dir, "algorithm='gspo_token'", "rollout.max_new_tokens=16",
                      "loss.step_credit='trainer_rewards:every_third_char'")
    trainer = Trainer(cfg, tmp_path / "run")
    batch = trainer.collector.collect()
    adv, mask = batch.advantages, batch.rollout.completion_mask
    assert adv.shape == mask.shape
    from gspo.algorithms import group_advantages

    outcome = group_advantages(batch.rewards, cfg.rollout.group_size)
    varies = 0
    for i, text in enumerate(batch.rollout.texts):
        ids = batch.rollout.completion_ids[i][mask[i]].tolist()
        starts = token_starts(trainer.tokenizer, ids, text)
        ends = [sum(s < e for s in starts) for e in range(3, len(text) + 1, 3)]
        last = ends[-1] if ends else 0
        assert torch.allclose(adv[i, last:], outcome[i].expand(adv.shape[1] - last))
        bounds = sorted({0, *ends})
        for a, b in zip(bounds, bounds[1:]):  # one value per step
            assert torch.allclose(adv[i, a:b], adv[i, a].expand(b - a))
        varies += len({round(float(v), 6) for v in adv[i, :last]}) > 1
    assert varies  # the process term moves advantages within completions
    trainer.train()
    from gspo.runlog.metrics import read_jsonl

    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


def test_step_credit_refusals_are_one_line(tiny_dir, tmp_path):  # noqa: F811
    with pytest.raises(UserError, match="sequence-level ratio cannot take"):
        tiny_config(tiny_dir, "algorithm='gspo'", "loss.step_credit='trainer_rewards:every_third_char'")
    with pytest.raises(UserError, match="has no attribute .nope."):
        Trainer(tiny_config(tiny_dir, "algorithm='grpo'", "loss.step_credit='trainer_rewards:nope'"), tmp_path / "a")
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='grpo'", "loss.step_credit='trainer_rewards:bad_steps'"),
                      tmp_path / "b")
    with pytest.raises(UserError, match="the ends must ascend"):
        trainer.collector.collect()
    trainer.rewards.close()


@pytest.mark.parametrize("path", ["reward_fixtures_hang:f", "trainer_rewards:hang_steps"])
def test_a_step_credit_that_blocks_at_import_or_in_a_call_ends_in_one_line(tiny_dir, tmp_path, monkeypatch, path):  # noqa: F811
    """A ``loss.step_credit`` module that blocks when imported, or a function that never returns, runs in the reward
    workers under their limits: one line naming ``loss.step_credit`` (the import used to hang training forever, in
    the trainer's own process, with no output)."""
    import sys
    import time

    from gspo.rewards import runner as runner_module

    monkeypatch.setattr(runner_module, "STARTUP_TIMEOUT_S", 3.0)
    cfg = tiny_config(tiny_dir, "algorithm='grpo'", f"loss.step_credit='{path}'", "rewards.workers=1",
                      "rewards.timeout_s=2")
    start = time.monotonic()
    with pytest.raises(UserError, match=f"loss.step_credit = '{path}'"):
        trainer = Trainer(cfg, tmp_path / "run")
        try:
            trainer.train()
        finally:
            trainer.rewards.close()
    assert time.monotonic() - start < 120 and "reward_fixtures_hang" not in sys.modules


def test_token_starts_of_ids_that_are_not_the_texts_own_encoding(tokenizer):
    """Sampled ids need not be the canonical encoding of their text (here "Answer" spelt in single letters, and an
    emoji's bytes split): the decoded prefixes give the starts."""
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "Answer"]
    emoji = tokenizer("🧮", add_special_tokens=False)["input_ids"]
    ids = letters + emoji + tokenizer(": 12", add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != ids
    starts = token_starts(tokenizer, ids, text)
    assert starts[:6] == [0, 1, 2, 3, 4, 5] and starts[6] == 6  # each letter; the emoji's bytes start at it
    assert starts[-1] == len(text) - len(tokenizer.decode(ids[-1:])) and starts == sorted(starts)


def test_a_step_credit_module_in_the_current_folder_is_found(user_folder):
    """loss.step_credit = 'my_steps:spans' with my_steps.py in the folder the command runs in loads that function."""
    from gspo.rewards.worker import resolve

    (user_folder / "cwd_steps.py").write_text("def spans(c, e):\n    return [(len(c), 1.0)]\n")
    assert resolve("cwd_steps:spans", steps=True)("ab", None) == [(2, 1.0)]


def test_each_turn_of_a_multi_turn_row_is_a_step_credited_with_its_environment_reward():
    """loss.step_credit = 'env', by hand (scale 'none' only centres the credits over the group's steps):
    row 0: turn 1 = tokens 0-1 (reward 0), two appended tokens, turn 2 = tokens 4-6 (reward 1);
    row 1: turn 1 = tokens 0-2 (reward 0.5), an appended token, turn 2 = token 4, cut off (no reward: no step).
    Credits 0, 1, 0.5 have mean 0.5: centred -0.5, 0.5 (row 0) and 0 (row 1). A token gets its outcome advantage plus
    the centred credit of its turn and every later turn: row 0: 0.5 - 0.5 + 0.5 = 0.5 on turn 1, 0.5 + 0.5 = 1.0 on
    turn 2 (appended tokens carry a value too, out of the loss mask); row 1: -0.5 throughout. A trajectory whose
    environment failed (NaN reward) gets no process credit."""
    from gspo.algorithms.advantages import step_advantages
    from gspo.rewards.steps import turn_steps
    from gspo.types import Rollout

    sampled = torch.tensor([[1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2], dtype=torch.bool)
    rollout = Rollout(prompt_ids=[[1], [1]], completion_ids=torch.zeros(2, 7, dtype=torch.long), completion_mask=mask,
                      logprobs=torch.zeros(2, 7), finish_reasons=["stop", "length"], texts=["", ""], pad_id=0,
                      sampled_mask=sampled, turn_rewards=[[0.0, 1.0], [0.5]])
    outcome = torch.tensor([0.5, -0.5])

    def turn_advantages(rewards):
        return step_advantages(outcome, *turn_steps(rollout, rewards), 2, 7, scale="none")

    adv = turn_advantages(torch.tensor([1.0, 0.5]))
    assert adv.shape == (2, 7)
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=adv.dtype))
    torch.testing.assert_close(adv[1, :5], torch.full((5,), -0.5, dtype=adv.dtype))
    failed = turn_advantages(torch.tensor([float("nan"), 0.5]))
    torch.testing.assert_close(failed[0], torch.full((7,), 0.5, dtype=adv.dtype))  # one step left: centred to 0


def test_env_step_credit_needs_an_environment_and_other_step_credits_do_not_take_one():
    from gspo.config import build_config

    env = {"env": {"path": "gspo.envs.builtin:GuessNumber"}, "data": {"task": "guess_number"},
           "algorithm": "gspo_token"}
    build_config({**env, "loss": {"step_credit": "env"}})
    with pytest.raises(UserError, match=r"^loss.step_credit = 'env' credits each turn .* set env.path"):
        build_config({"algorithm": "gspo_token", "loss": {"step_credit": "env"}})
    with pytest.raises(UserError, match=r"^loss.step_credit = 'task' splits one reply into steps, not a multi-turn row"):
        build_config({**env, "loss": {"step_credit": "task"}})
    with pytest.raises(UserError, match="sequence-level ratio cannot take"):
        build_config({**env, "algorithm": "gspo", "loss": {"step_credit": "env"}})


def test_under_a_critic_an_environments_step_rewards_are_paid_once():
    """loss.step_credit = 'env' with PPO, by hand: two turns paid c = 0.5 and 0, the trajectory's reward is their sum
    0.5. GAE's token rewards are 0.5 at turn 1's end and the rest of the outcome, 0.5 - 0.5 = 0, at the last step, so
    with gamma = lambda = 1 and V = 0 turn 1's tokens return 0.5 and turn 2's 0 (they returned 1.0 and 0.5 when the
    outcome was paid again on top); a process reward model's credits (not part of the outcome) are added to it."""
    from gspo.algorithms.ppo import gae, process_token_rewards
    from gspo.rewards.steps import turn_steps
    from gspo.types import Rollout

    sampled = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    rollout = Rollout(prompt_ids=[[1]], completion_ids=torch.zeros(1, 6, dtype=torch.long),
                      completion_mask=torch.ones(1, 6, dtype=torch.bool), logprobs=torch.zeros(1, 6),
                      finish_reasons=["stop"], texts=[""], pad_id=0, sampled_mask=sampled, turn_rewards=[[0.5, 0.0]])
    reward = torch.tensor([0.5])
    steps = turn_steps(rollout, reward)
    assert steps == ([[2, 6]], [[0.5, 0.0]])
    tokens = process_token_rewards(reward, sampled, *steps, paid_in_outcome=True)
    torch.testing.assert_close(tokens[0], torch.tensor([0, 0.5, 0, 0, 0, 0], dtype=torch.float64))
    _, returns = gae(tokens, torch.zeros(1, 6, dtype=torch.float64), sampled, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns[0][sampled[0]], torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64))
    prm = process_token_rewards(reward, sampled, *steps, weight=2.0)  # credits beside the outcome, weighted
    torch.testing.assert_close(prm[0], torch.tensor([0, 1.0, 0, 0, 0, 0.5], dtype=torch.float64))
