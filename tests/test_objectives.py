"""CISPO, GMPO and SAPO (``loss.objective``): hand-worked numbers and gradients, and each against an independent
float64 re-statement of the peer code that defines it (verl's ``core_algos.py`` policy losses ``cispo``, ``geo_mean``
and ``sapo``) on random inputs with empty rows and zero advantages."""
import math

import pytest
import torch

from gspo.algorithms import policy_loss
from gspo.config import build_config
from gspo.errors import UserError


def run(objective, logp, old, adv, mask, level="token", eps=(0.2, 0.2), aggregation="seq-mean-token-mean", tau=(1.0, 1.05)):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True) if not torch.is_tensor(logp) else logp
    loss, metrics = policy_loss(lp, torch.as_tensor(old, dtype=torch.float64), torch.as_tensor(adv, dtype=torch.float64),
                                torch.as_tensor(mask).bool(), level=level, eps_low=eps[0], eps_high=eps[1],
                                aggregation=aggregation, objective=objective, sapo_tau=tau)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad, metrics


def test_cispo_hand_worked():
    """One row, token ratios [0.5, 1, 7] (log-ratios ln 0.5, 0, ln 7), A = 1, bounds [1 - 1, 1 + 4] = [0, 5]: the
    weights are [0.5, 1, 5] (7 truncated, and still trained); token-mean: loss = -(0.5 + 1 + 5) / 3 = -2.166667, and
    d loss / d log pi = -w A / 3 = [-0.166667, -0.333333, -1.666667]: the truncated token keeps a gradient, scaled
    by its bound, where PPO's clip would give it none."""
    old = [[-1.0, -1.0, -1.0]]
    logp = [[-1.0 + math.log(0.5), -1.0, -1.0 + math.log(7.0)]]
    loss, grad, m = run("cispo", logp, old, [1.0], [[1, 1, 1]], eps=(1.0, 4.0), aggregation="token-mean")
    assert loss == pytest.approx(-6.5 / 3, abs=1e-9)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.0, -5.0]], dtype=torch.float64) / 3)
    assert m["clip/token_high"] == pytest.approx(1 / 3) and m["clip/token_low"] == 0.0


def test_gmpo_hand_worked():
    """One row, token log-ratios [0.1, 0.6, -0.2], eps 0.4 in log space.
    A = +1: each log-ratio is held at the pessimistic side, min(lr, clip(lr, -0.4, 0.4)) = [0.1, 0.4, -0.2]; mean 0.1,
    g = e^0.1 = 1.105171, loss = -1.105171; the held token gets no gradient, the others -g / 3 = -0.368390.
    A = -1: max(lr, clip(lr)) = [0.1, 0.6, -0.2]; mean 1/6, g = e^(1/6) = 1.181360, loss = +1.181360 and every
    token gets +g / 3 = 0.393787 (a negative advantage is clipped only below, at -0.4)."""
    old = [[-1.0, -2.0, -0.5]]
    logp = [[-0.9, -1.4, -0.7]]
    loss, grad, m = run("gmpo", logp, old, [1.0], [[1, 1, 1]], level="sequence", eps=(0.4, 0.4))
    assert loss == pytest.approx(-math.exp(0.1), abs=1e-9)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, -1.0]], dtype=torch.float64) * math.exp(0.1) / 3)
    assert m["clip/token_high"] == pytest.approx(1 / 3) and m["clip/seq_high"] == pytest.approx(1 / 3)
    loss, grad, m = run("gmpo", logp, old, [-1.0], [[1, 1, 1]], level="sequence", eps=(0.4, 0.4))
    assert loss == pytest.approx(math.exp(1 / 6), abs=1e-9)
    torch.testing.assert_close(grad, torch.full((1, 3), math.exp(1 / 6) / 3, dtype=torch.float64))
    assert m["clip/token_total"] == 0.0


def test_gmpo_unclipped_is_gspo_unclipped():
    """With clip ranges no ratio reaches, GMPO's geometric mean is GSPO's s_i: the same loss and gradient."""
    g = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(4, 6, generator=g, dtype=torch.float64), -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask, adv = torch.rand(4, 6, generator=g) > 0.2, torch.randn(4, generator=g, dtype=torch.float64)
    a = run("gmpo", logp.clone().requires_grad_(), old, adv, mask, level="sequence", eps=(50.0, 50.0))
    b = run("clip", logp.clone().requires_grad_(), old, adv, mask, level="sequence", eps=(0.99, 50.0))
    assert a[0] == pytest.approx(b[0], abs=1e-12)
    torch.testing.assert_close(a[1], b[1])


def test_sapo_hand_worked():
    """Token ratios [1, 2], A = +1, tau_pos = 1: f(1) = 2, f(2) = 4 sigmoid(1) = 2.924234; seq-mean-token-mean
    loss = -(2 + 2.924234) / 2 = -2.462117. d loss / d log pi = -f'(r) r A / 2 with f'(r) = 4 s (1 - s),
    s = sigmoid(r - 1): f'(1) = 1 (the plain policy gradient on policy), f'(2) = 0.786448, so the gradient is
    [-0.5, -0.786448] (smaller per unit ratio than on policy, but never cut to 0 as at a clip edge).
    A = -1 uses tau_neg = 1.05: f(1) = 2 / 1.05, loss = +1.904762 for one on-policy token."""
    s = 1 / (1 + math.exp(-1.0))
    loss, grad, m = run("sapo", [[-1.0, -1.0 + math.log(2.0)]], [[-1.0, -1.0]], [1.0], [[1, 1]])
    assert loss == pytest.approx(-(2 + 4 * s) / 2, abs=1e-9)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -4 * s * (1 - s) * 2 / 2]], dtype=torch.float64))
    assert m["clip/token_high"] == pytest.approx(0.5)  # outside the (0.2, 0.2) band: counted, not cut
    loss, grad, _ = run("sapo", [[-1.0]], [[-1.0]], [-1.0], [[1]])
    assert loss == pytest.approx(2 / 1.05, abs=1e-9) and grad.item() == pytest.approx(1.0)


# --- independent float64 re-statements of verl's policy losses (verl/trainer/ppo/core_algos.py), written from its
# --- formulas: their aggregation helpers included (token-mean over the mask; seq-mean-token-mean over rows)


def _verl_token_mean(x, m):
    return (x * m).sum() / m.sum()


def _verl_seq_mean_token_mean(x, m):
    rows = m.sum(-1) > 0  # verl averages sequences with tokens (rows without are not in a batch there)
    return ((x * m).sum(-1)[rows] / m.sum(-1)[rows]).mean()


def _verl_cispo(old, logp, adv, m, low, high):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    clipped = torch.clamp(ratio, 1 - low, 1 + high).detach()
    return _verl_token_mean(-clipped * adv * logp, m)


def _verl_geo_mean(old, logp, adv, m, low, high):
    neg_kl = logp - old
    sgn = torch.sign(adv)
    neg_kl_min = sgn * torch.min(sgn * neg_kl, sgn * torch.clamp(neg_kl, -low, high))
    rows = m.sum(-1) > 0
    ratio = torch.exp((neg_kl_min * m).sum(-1) / m.sum(-1).clamp(min=1))
    a = (adv * m).sum(-1) / m.sum(-1).clamp(min=1)
    return (-a * ratio)[rows].mean()


def _verl_sapo(old, logp, adv, m, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    return _verl_seq_mean_token_mean(-torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, m)


def _random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False  # an empty row
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = 0.0  # a zero-variance group's row
    return old, logp, mask, adv


@pytest.mark.parametrize("seed", range(5))
def test_objectives_equal_verl_restatements(seed):
    """Gradients equal verl's on random rows (empty rows, a zero advantage, ratios far from 1); losses equal where
    the definitions agree: GMPO and SAPO exactly, CISPO up to its value (gspo reports -w A, verl -w A log pi: the
    same gradient)."""
    old, logp, mask, adv = _random_batch(seed)
    adv_t = adv[:, None].expand(-1, mask.shape[1]) * mask
    m = mask.double()
    one = (1.0, 1.05)
    cases = [("cispo", "token", (1.0, 4.0), "token-mean", one, lambda lp: _verl_cispo(old, lp, adv_t, m, 1.0, 4.0)),
             ("cispo", "token", (0.2, 0.28), "token-mean", one, lambda lp: _verl_cispo(old, lp, adv_t, m, 0.2, 0.28)),
             ("gmpo", "sequence", (0.4, 0.4), "seq-mean-token-mean", one,
              lambda lp: _verl_geo_mean(old, lp, adv_t, m, 0.4, 0.4)),
             ("gmpo", "sequence", (0.1, 0.3), "seq-mean-token-mean", one,
              lambda lp: _verl_geo_mean(old, lp, adv_t, m, 0.1, 0.3)),
             ("sapo", "token", (0.2, 0.2), "seq-mean-token-mean", one, lambda lp: _verl_sapo(old, lp, adv_t, m, 1.0, 1.05)),
             ("sapo", "token", (0.2, 0.2), "seq-mean-token-mean", (0.5, 3.0),
              lambda lp: _verl_sapo(old, lp, adv_t, m, 0.5, 3.0))]
    for objective, level, eps, agg, tau, verl in cases:
        ours, grad, _ = run(objective, logp.clone().requires_grad_(), old, adv, mask, level=level, eps=eps,
                            aggregation=agg, tau=tau)
        lp = logp.clone().requires_grad_()
        theirs = verl(lp)
        (their_grad,) = torch.autograd.grad(theirs, lp)
        torch.testing.assert_close(grad, their_grad, rtol=1e-10, atol=1e-12, msg=objective)
        assert not grad[0].any()  # the empty row
        if objective != "cispo":
            assert ours == pytest.approx(theirs.item(), rel=1e-10, abs=1e-12), objective
        else:
            w = torch.clamp(torch.exp(logp - old), 1 - eps[0], 1 + eps[1])
            assert ours == pytest.approx(_verl_token_mean(-w * adv_t, m).item(), rel=1e-10), objective


def test_presets_and_refusals():
    """The presets fill objective, level, bounds and aggregation; an objective at a level it is not defined at, bad
    bounds and stray temperatures are refused in one line."""
    c = build_config({"algorithm": "cispo"}).loss
    assert (c.objective, c.level, c.eps_low, c.eps_high, c.aggregation) == ("cispo", "token", 1.0, 4.0, "token-mean")
    g = build_config({"algorithm": "gmpo"}).loss
    assert (g.objective, g.level, g.eps_low, g.eps_high) == ("gmpo", "sequence", 0.4, 0.4)
    s = build_config({"algorithm": "sapo"}).loss
    assert (s.objective, s.level, s.sapo_tau) == ("sapo", "token", [1.0, 1.05])
    assert build_config({"algorithm": "grpo"}).loss.objective == "clip"
    assert build_config({"algorithm": "grpo", "loss": {"objective": "sapo"}}).loss.sapo_tau is None  # SAPO_TAU then
    with pytest.raises(UserError, match="loss.objective = 'cispo' is defined at loss.level = 'token', not 'sequence'"):
        build_config({"algorithm": "gspo", "loss": {"objective": "cispo"}})
    with pytest.raises(UserError, match="loss.objective = 'gmpo' is defined at loss.level = 'sequence', not 'token'"):
        build_config({"algorithm": "grpo", "loss": {"objective": "gmpo"}})
    with pytest.raises(UserError, match="loss.objective = 'ppo' is not one of clip, cispo, gmpo, sapo"):
        build_config({"loss": {"objective": "ppo"}})
    with pytest.raises(UserError, match="loss.sapo_tau = \\[1.0\\] must be two temperatures > 0"):
        build_config({"algorithm": "sapo", "loss": {"sapo_tau": [1.0]}})
    with pytest.raises(UserError, match="only with loss.objective = 'sapo' \\(it is 'clip'\\)"):
        build_config({"algorithm": "grpo", "loss": {"sapo_tau": [1.0, 2.0]}})
    with pytest.raises(UserError, match="0 <= loss.eps_low <= 1"):
        build_config({"algorithm": "cispo", "loss": {"eps_low": 1.5}})
    with pytest.raises(UserError, match="0 <= loss.eps_low < 1"):
        build_config({"algorithm": "grpo", "loss": {"eps_low": 1.0}})
    assert build_config({"algorithm": "gmpo", "loss": {"eps_low": 2.0}}).loss.eps_low == 2.0  # log space: e^-2 > 0
