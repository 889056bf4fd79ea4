"""Group-relative advantages, the zero-variance filter and DAPO's overlong punishment against hand-worked numbers."""
import math

import pytest
import torch

from gspo import group_advantages, overlong_penalty
from gspo.algorithms.advantages import zero_variance_groups
from gspo.errors import UserError

NAN = float("nan")


def test_group_scale_hand_worked():
    """Group (1, 0, 1, 0): mean 0.5, unbiased std sqrt(1/3) = 0.577350, so A = +-0.866025."""
    a = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([1, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3))


def test_zero_variance_group_gives_zero_never_nan():
    """A group whose rewards are all equal gets advantage 0 at every scale, even with eps = 0."""
    for scale in ("group", "batch", "none"):
        a = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5]), 3, scale=scale, eps=0.0)
        assert torch.isfinite(a).all()
        assert (a[:3] == 0).all()


def test_all_groups_zero_variance_batch_scale():
    """When every group is constant the batch has spread (1, 1 | 0, 0) but every centred reward is 0: zeros."""
    a = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, scale="batch", eps=0.0)
    assert (a == 0).all()


def test_failed_rewards_are_left_out_of_the_baseline():
    """A NaN reward gets advantage 0 and the group's mean and std use only the valid rewards: (1, NaN, 0) -> +-0.707107."""
    a = group_advantages(torch.tensor([1.0, NAN, 0.0]), 3, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)]))


def test_group_with_one_valid_reward_gets_zero():
    """A group with a single valid reward has no baseline: advantage 0, not NaN."""
    a = group_advantages(torch.tensor([NAN, 1.0, NAN, 0.0, 1.0, 1.0]), 3)
    assert (a[:3] == 0).all() and torch.isfinite(a).all()
    assert zero_variance_groups(torch.tensor([NAN, 1.0, NAN, 0.0, 1.0, 1.0]), 3).tolist() == [True, False]


def test_mean_only_and_batch_scales_hand_worked():
    """Dr. GRPO's mean-only scale: (3, 1 | 0, 0) -> (1, -1, 0, 0). The batch scale (Lite PPO, TRL's "batch") divides
    the group-centred rewards by the unbiased std of the raw batch (3, 1, 0, 0): mean 1, squared deviations
    4 + 0 + 1 + 1 = 6 over 3, std sqrt(2) -> (0.707107, -0.707107, 0, 0). (The std of the centred rewards would be
    sqrt(2/3), giving +-1.224745.)"""
    r = torch.tensor([3.0, 1.0, 0.0, 0.0])
    assert group_advantages(r, 2, scale="none").tolist() == [1.0, -1.0, 0.0, 0.0]
    torch.testing.assert_close(group_advantages(r, 2, scale="batch", eps=0.0), torch.tensor([1.0, -1.0, 0, 0]) / math.sqrt(2))


@pytest.mark.parametrize("value, G", [(0.7, 8), (0.1, 8), (0.1, 3), (0.3, 6), (1 / 3, 5), (123.456, 7)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_non_dyadic_rewards_are_zero_variance(value, G, scale):
    """A group whose rewards are all equal but not exact in binary (0.7, 0.1, 1/3...) has advantage exactly 0 and is
    zero-variance; in float32 statistics eight 0.7s got +0.056 each and the dynamic-sampling filter kept them."""
    rewards = torch.cat([torch.full((G,), value), torch.linspace(0.0, 1.0, G)])  # a constant group, then a varied one
    adv = group_advantages(rewards, G, scale=scale)
    assert (adv[:G] == 0).all() and (adv[G:] != 0).any()
    assert zero_variance_groups(rewards, G).tolist() == [True, False]


def test_advantages_keep_float32_for_the_update():
    """float32 rewards give float32 advantages (float64 statistics inside), float64 rewards float64."""
    assert group_advantages(torch.tensor([1.0, 0.0]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float64


def test_bad_group_size_and_scale_are_user_errors():
    """Rewards that do not divide into groups, and an unknown scale, raise a UserError that names the fix."""
    with pytest.raises(UserError, match="multiple of the group size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(UserError, match="group, batch, tokens, none"):
        group_advantages(torch.zeros(4), 2, scale="std")


def test_overlong_penalty_hand_worked():
    """L_max 20, L_cache 8: lengths 10, 12, 16, 20, 21 -> 0, 0, -0.5, -1, -1."""
    p = overlong_penalty(torch.tensor([10, 12, 16, 20, 21]), 20, 8)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(UserError, match="overlong"):
        overlong_penalty(torch.tensor([1]), 20, 0)


def test_step_advantages_add_the_groups_normalised_credit_to_go_by_hand():
    """Group of 2, width 6. Completion 0: steps ending at tokens 2 and 4 with credit 1, 0; completion 1: steps ending
    at 3 and 5 with credit 1, 1. Pool {1, 0, 1, 1}: mean 0.75, unbiased std 0.5, so r~ = [0.5, -1.5] and [0.5, 0.5];
    credit to go [-1.0, -1.5] and [1.0, 0.5]. With outcome advantages 0.5 and -0.5:
        row 0: -0.5 -0.5 | -1.0 -1.0 | 0.5 0.5      (tokens 4, 5 are past the last step: outcome only)
        row 1:  0.5 0.5 0.5 | 0.0 0.0 | -0.5"""
    from gspo.algorithms.advantages import step_advantages

    adv = step_advantages(torch.tensor([0.5, -0.5]), [[2, 4], [3, 5]], [[1.0, 0.0], [1.0, 1.0]], 2, 6, eps=0.0)
    expected = torch.tensor([[-0.5, -0.5, -1.0, -1.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.0, 0.0, -0.5]])
    torch.testing.assert_close(adv, expected)
    half = step_advantages(torch.tensor([0.5, -0.5]), [[2, 4], [3, 5]], [[1.0, 0.0], [1.0, 1.0]], 2, 6, eps=0.0,
                           weight=0.5)
    torch.testing.assert_close(half - torch.tensor([[0.5], [-0.5]]), (expected - torch.tensor([[0.5], [-0.5]])) / 2)


def test_step_advantages_add_nothing_where_the_group_carries_no_process_signal():
    """Equal credits everywhere, a single step in the group, or no steps: the outcome advantage on every token."""
    from gspo.algorithms.advantages import step_advantages

    outcome = torch.tensor([1.0, -1.0, 0.3, -0.3, 0.0, 0.0])
    adv = step_advantages(outcome, [[1, 2], [3], [4], [], [], []], [[1.0, 1.0], [1.0], [0.0], [], [], []], 2, 5)
    torch.testing.assert_close(adv, outcome[:, None].expand(6, 5))


def test_step_advantages_scale_their_credit_as_the_outcome_is_scaled():
    """The example above with scale 'none' (Dr. GRPO): credits only centred on the group's mean 0.75, so r~ = [0.25,
    -0.75] and [0.25, 0.25], credit to go [-0.5, -0.75] and [0.5, 0.25]; with 'batch' the one group is the batch,
    so it equals 'group'."""
    from gspo.algorithms.advantages import step_advantages

    args = (torch.tensor([0.5, -0.5]), [[2, 4], [3, 5]], [[1.0, 0.0], [1.0, 1.0]], 2, 6)
    none = step_advantages(*args, scale="none")
    torch.testing.assert_close(none, torch.tensor([[0.0, 0.0, -0.25, -0.25, 0.5, 0.5], [0.0, 0.0, 0.0, -0.25, -0.25, -0.5]]))
    torch.testing.assert_close(step_advantages(*args, scale="batch"), step_advantages(*args, scale="group"))


# ------------------------------------------------------------------------------------------ RLOO and REINFORCE++


def test_leave_one_out_baseline_hand_worked():
    """RLOO: A_i = r_i - mean of the group's other rewards. Group [1, 0, 0, 1]: 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3;
    with a failed reward [1, NaN, 0, 0] the baseline leaves it out: 1 - 0 = 1, 0 - 1/2 = -1/2, NaN -> 0; a group of
    equal rewards gives 0."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, float("nan"), 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4, scale="none", baseline="leave_one_out")
    want = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.0, 0.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert a.tolist() == pytest.approx(want, abs=1e-7)


def _rloo_restated(rewards, G):
    """verl's RLOO outcome advantage restated in float64 (compute_rloo_outcome_advantage): per group of G > 1 scores,
    r_i * G / (G - 1) - mean * G / (G - 1)."""
    out = []
    for g in range(0, len(rewards), G):
        group = rewards[g:g + G]
        mean = sum(group) / G
        out += [x * G / (G - 1) - mean * G / (G - 1) for x in group]
    return out


def _whiten_restated(values, lengths):
    """REINFORCE++'s global whitening restated in float64 (verl's masked_whiten over the response tokens): the mean and
    the Bessel-corrected variance of every token's value, (v - mean) / sqrt(var + 1e-8)."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


@pytest.mark.parametrize("seed", range(5))
def test_rloo_and_reinforce_pp_equal_float64_restatements_of_the_peers(seed):
    """On random rewards (groups of 4, lengths 1-9): RLOO's advantages equal verl's formula, and REINFORCE++'s (no
    baseline) and REINFORCE++-baseline's (group mean subtracted first) whitened advantages equal verl's masked_whiten of
    the per-token returns, to 1e-6 (verl puts its 1e-8 inside the square root, gspo adds it to the std)."""
    from gspo.algorithms.advantages import whiten_tokens

    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(16, generator=g, dtype=torch.float64).round(decimals=1)
    lengths = torch.randint(1, 10, (16,), generator=g)
    mask = torch.arange(9)[None, :] < lengths[:, None]  # (16, 9)
    rloo = group_advantages(rewards, 4, scale="none", baseline="leave_one_out")
    assert rloo.tolist() == pytest.approx(_rloo_restated(rewards.tolist(), 4), abs=1e-9)
    for baseline in ("none", "group_mean"):
        centred = group_advantages(rewards, 4, scale="tokens", baseline=baseline)
        if baseline == "group_mean":
            assert centred.tolist() == pytest.approx(group_advantages(rewards, 4, scale="none").tolist())
        out = whiten_tokens(centred, mask)  # (16, 9)
        want = _whiten_restated(centred.tolist(), lengths.tolist())
        assert out[:, 0].tolist() == pytest.approx(want, abs=1e-6)
        assert torch.equal(out, torch.where(mask, out[:, :1], 0.0))  # one value on each row's tokens, 0 off them


def test_whitening_hand_worked_and_degenerate_batches():
    """Rewards [1, 0] over 3 and 1 tokens: the tokens [1, 1, 1, 0] have mean 0.75 and std 0.5, so 0.5 and -1.5. All
    tokens equal (or one token) leave the advantages centred only; no token at all gives zeros, never NaN."""
    from gspo.algorithms.advantages import whiten_tokens

    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = whiten_tokens(torch.tensor([1.0, 0.0]), mask)
    assert out.flatten().tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5, 0.0, 0.0], abs=1e-6)
    assert whiten_tokens(torch.tensor([2.0, 2.0]), mask).abs().max() == 0
    assert whiten_tokens(torch.tensor([3.0, 1.0]), torch.tensor([[True, False, False], [False, False, False]])).tolist() \
        == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert whiten_tokens(torch.tensor([1.0, 0.0]), torch.zeros(2, 3, dtype=torch.bool)).abs().max() == 0


def test_no_baseline_keeps_the_signal_of_groups_whose_rewards_are_equal():
    """REINFORCE++ has no group baseline: a group of equal rewards still carries them (the batch centres them later),
    where GRPO's group mean leaves it nothing."""
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert group_advantages(r[:2], 2, scale="tokens", baseline="none").tolist() == [1.0, 1.0]
    assert group_advantages(r[:2], 2, scale="tokens").tolist() == [0.0, 0.0]
    with pytest.raises(UserError, match="Unknown group advantage baseline 'loo'"):
        group_advantages(r, 2, baseline="loo")


# ------------------------------------------------------------------------------------------ one call


def test_estimate_advantages_chooses_the_estimator_as_the_config_does():
    """One call for every estimator: the GRPO family's group advantages (with step credit added, whitened over the
    loss tokens of the rows with a reward under scale 'tokens'), and with a critic GAE over the token rewards and the
    values, whitened or not, with the value targets; each equals the pieces it chooses, composed by hand."""
    from gspo.algorithms import estimate_advantages, whiten_tokens
    from gspo.algorithms.advantages import step_advantages
    from gspo.algorithms.ppo import gae, outcome_token_rewards, process_token_rewards

    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, generator=g).round(decimals=1)
    rewards[3] = NAN
    mask = torch.arange(6)[None, :] < torch.randint(1, 7, (8,), generator=g)[:, None]  # (8, 6)
    steps = ([[2, 4]] * 8, [[float(i % 2), 1.0] for i in range(8)])

    def grpo(baseline, scale, steps=None):
        return estimate_advantages(rewards, mask, baseline=baseline, scale=scale, group_size=4, steps=steps,
                                   step_weight=0.5)

    adv, returns = grpo("group_mean", "group")
    assert returns is None and torch.equal(adv, group_advantages(rewards, 4))
    adv, _ = grpo("group_mean", "group", steps)
    assert torch.equal(adv, step_advantages(group_advantages(rewards, 4), *steps, 4, 6, weight=0.5))
    adv, _ = grpo("leave_one_out", "tokens")
    centred = group_advantages(rewards, 4, scale="tokens", baseline="leave_one_out")
    assert torch.equal(adv, whiten_tokens(centred, mask & torch.isfinite(rewards)[:, None]))

    ppo_rewards = torch.nan_to_num(rewards)  # PPO's rows without a reward are off its mask
    values = torch.randn(8, 6, generator=g)
    for token_rewards in (outcome_token_rewards(ppo_rewards, mask), process_token_rewards(ppo_rewards, mask, *steps)):
        for scale in ("none", "tokens"):
            adv, returns = estimate_advantages(token_rewards, mask, baseline="critic", scale=scale, group_size=4,
                                               values=values, gamma=0.9, lam=0.8)
            want, want_returns = gae(token_rewards, values, mask, 0.9, 0.8)
            assert torch.equal(adv, whiten_tokens(want, mask) if scale == "tokens" else want)
            assert torch.equal(returns, want_returns)
    # (N,) rewards are paid at each row's last step, as outcome_token_rewards pays them
    adv, _ = estimate_advantages(ppo_rewards, mask, baseline="critic", scale="none", group_size=4, values=values)
    assert torch.equal(adv, gae(outcome_token_rewards(ppo_rewards, mask), values, mask, 1.0, 1.0)[0])
