"""PPO's critic-side math (gspo.algorithms.ppo): hand-worked GAE, value loss and explained variance, and each against
an independent float64 re-statement of verl's ``compute_gae_advantage_return`` (the version that passes over
non-step tokens) and ``compute_value_loss`` on random rows with empty rows and gaps."""
import pytest
import torch

from gspo.algorithms.ppo import explained_variance, gae, outcome_token_rewards, value_loss

D = torch.float64


def test_outcome_reward_lands_on_each_rows_last_step():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]).bool()
    r = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask, token_rewards=torch.full((3, 4), 0.1))
    torch.testing.assert_close(r, torch.tensor([[0.1, 2.1, 0, 0], [0.1, 0, -0.9, 0], [0, 0, 0, 0]], dtype=D))


def test_gae_hand_worked():
    """rewards [0, 0, 1], values [0.5, 0.6, 0.8], gamma 1, lam 0.95: deltas 0.1, 0.2, 0.2 (backwards from the end,
    V = 0 after it); A2 = 0.2, A1 = 0.2 + 0.95 * 0.2 = 0.39, A0 = 0.1 + 0.95 * 0.39 = 0.4705; returns A + V =
    [0.9705, 0.99, 1.0]."""
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3).bool(), 1.0, 0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.4705, 0.39, 0.2]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[0.9705, 0.99, 1.0]], dtype=D))


def test_gae_passes_over_appended_tokens():
    """A tool result between two turns (position 1, off the mask) is not a step: its value (9.9) is never read and the
    return carries across it. gamma 0.9, lam 1: A2 = 1 - 0.8 = 0.2; A0 = 0.9 * 0.8 - 0.5 + 0.9 * 0.2 = 0.40."""
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.9, 0.8]]),
                   torch.tensor([[1, 0, 1]]).bool(), 0.9, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.40, 0.0, 0.2]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[0.9, 0.0, 1.0]], dtype=D))


def test_gae_with_unit_gamma_and_lambda_is_reward_minus_value():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 7, generator=g) > 0.3
    values = torch.randn(5, 7, generator=g, dtype=D)
    rewards = torch.randn(5, generator=g, dtype=D)
    adv, ret = gae(outcome_token_rewards(rewards, mask), values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.where(mask, rewards[:, None] - values, 0.0))
    torch.testing.assert_close(ret, torch.where(mask, rewards[:, None].expand(-1, 7), 0.0))


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl's recursion, re-stated: next values and the running advantage skip non-step tokens."""
    nextvalues, lastgaelam, out = 0, 0, []
    T = token_level_rewards.shape[-1]
    for t in reversed(range(T)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def _verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    l1, l2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    per = torch.maximum(l1, l2)
    return 0.5 * (per * response_mask).sum() / response_mask.sum(), ((l2 > l1).double() * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("seed", range(5))
def test_gae_and_value_loss_equal_verl_restatements(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 10
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # an empty row
    mask[1, 3:6] = False  # a gap (appended tokens)
    values = torch.randn(B, T, generator=g, dtype=D)
    rewards = outcome_token_rewards(torch.randn(B, generator=g, dtype=D), mask,
                                    token_rewards=0.1 * torch.randn(B, T, generator=g, dtype=D))
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.5)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        their_adv, their_ret = _verl_gae(rewards, values, mask.double(), gamma, lam)
        torch.testing.assert_close(adv, torch.where(mask, their_adv, 0.0))  # verl leaves values off the mask
        torch.testing.assert_close(ret, torch.where(mask, their_ret, 0.0))
    old = values + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    for clip in (0.2, 0.5):
        v = values.clone().requires_grad_()
        loss, m = value_loss(v, old, ret, mask, clip)
        (grad,) = torch.autograd.grad(loss, v)
        v2 = values.clone().requires_grad_()
        their, their_frac = _verl_value_loss(v2, ret, old, mask.double(), clip)
        (their_grad,) = torch.autograd.grad(their, v2)
        assert loss.item() == pytest.approx(their.item(), rel=1e-12)
        torch.testing.assert_close(grad, their_grad)
        assert m["critic/value_clip_frac"].item() == pytest.approx(their_frac.item())


def test_value_loss_hand_worked():
    """V = 0.6, V_old = 0.5, R = 2, clip 0.05: unclipped (0.6 - 2)^2 = 1.96, clipped (0.55 - 2)^2 = 2.1025 is the
    larger, so L = 2.1025 / 2 = 1.05125 and the gradient is 0 (the clipped value does not move with V). Without the
    clip: L = 0.98, dL/dV = V - R = -1.4."""
    v = torch.tensor([[0.6]], dtype=D, requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1).bool(), 0.05)
    loss.backward()
    assert loss.item() == pytest.approx(1.05125) and v.grad.item() == 0.0 and m["critic/value_clip_frac"] == 1.0
    v.grad = None
    loss, _ = value_loss(v, torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1).bool(), 0.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.98) and v.grad.item() == pytest.approx(-1.4)


def test_explained_variance():
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    ret = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 7.0), ret, mask).item() == pytest.approx(0.0)
    # V = [1, 1, 1]: R - V = [0, 1, 2] has the variance of R -> 0; V = R + [1, -1, 1]: var([-1, 1, -1]) = 4/3, var(R) = 1
    assert explained_variance(ret + torch.tensor([[1.0, -1.0, 1.0, 0.0]]), ret, mask).item() == pytest.approx(-1 / 3)
    assert explained_variance(ret, torch.ones(1, 4), mask).isnan()


def test_step_token_rewards_pay_each_steps_credit_at_its_last_token():
    from gspo.algorithms.ppo import step_token_rewards

    out = step_token_rewards([[2, 5, 0], [], [7]], [[1.0, 0.5, 9.0], [], [3.0]], width=6, weight=2.0)
    # row 0: steps end at tokens 1 and 4 (the empty step pays nothing); row 2's step ends past the width: dropped
    assert out.tolist() == [[0, 2, 0, 0, 1, 0], [0] * 6, [0] * 6]
    # into GAE with gamma = lam = 1 and zero values: each token's advantage is the rewards from it on
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask, out[:1])
    adv, returns = gae(rewards, torch.zeros(1, 6), mask, 1.0, 1.0)
    assert adv.tolist() == [[4.0, 4.0, 2.0, 2.0, 2.0, 0.0]] and torch.equal(returns, adv)
