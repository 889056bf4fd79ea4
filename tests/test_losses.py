"""The policy losses against hand-worked numbers, and their invariants."""
import math

import pytest
import torch

from gspo import policy_loss
from gspo.algorithms.losses import aggregate, importance_ratio, ratio_metrics
from gspo.errors import UserError

PAD = 0.0
# Two sequences, the second one token shorter.  log-ratios:  row 0: [0.10, -0.05, 0.10]  row 1: [-0.05, 0.10]
LOGP = [[-1.00, -0.50, -2.00], [-0.30, -1.20, PAD]]
OLD = [[-1.10, -0.45, -2.10], [-0.25, -1.30, PAD]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]


def run(level, eps_low, eps_high, aggregation="seq-mean-token-mean", logp=LOGP, old=OLD, adv=ADV, mask=MASK):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), torch.tensor(mask).bool(),
        level=level, eps_low=eps_low, eps_high=eps_high, aggregation=aggregation,
    )
    loss.backward()
    return loss.item(), lp.grad, metrics


def test_gspo_hand_worked_tight_clip():
    """GSPO with eps (3e-4, 4e-4): s0 = e^0.05 = 1.051271 is clipped to 1.0004 (A > 0), s1 = e^0.025 = 1.025315 is
    not (A < 0 takes the unclipped side); loss = (-1.0004 + 0.5 * 1.025315) / 2 = -0.243871 and only row 1 gets
    gradient: 0.5 * 0.5 * s1 / 2 = 0.128164 per token."""
    loss, grad, m = run("sequence", 3e-4, 4e-4)
    assert loss == pytest.approx(-0.243871, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0, 0, 0], [0.128164, 0.128164, 0]], dtype=torch.float64), atol=1e-6, rtol=0)
    assert m["clip/seq_high"] == pytest.approx(0.5) and m["clip/seq_low"] == 0.0
    assert m["clip/token_total"] == pytest.approx(3 / 5)  # the 3 tokens of the clipped sequence out of 5


def test_gspo_hand_worked_wide_clip():
    """GSPO with eps 0.2 clips nothing: loss = (-1.051271 + 0.512658) / 2 = -0.269307; row 0 gradient is
    -0.5 * s0 / 3 = -0.175212 per token."""
    loss, grad, m = run("sequence", 0.2, 0.2)
    assert loss == pytest.approx(-0.269307, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.175212] * 3, [0.128164, 0.128164, 0]], dtype=torch.float64), atol=1e-6, rtol=0)
    assert m["clip/token_total"] == 0.0
    assert m["ratio/seq_max"] == pytest.approx(math.exp(0.05), abs=1e-6)


def test_grpo_token_level_hand_worked_wide_clip():
    """GRPO, eps 0.2: token ratios row 0 (1.105171, 0.951229, 1.105171), row 1 (0.951229, 1.105171), none clipped.
    Row 0 mean loss -(3.161571)/3 = -1.053857, row 1 0.5 * (0.951229 + 1.105171)/2 = 0.514100, loss -0.269878.
    Gradient row 0: -r/(2*3) = (-0.184195, -0.158538, -0.184195); row 1: 0.5 r/(2*2) = (0.118904, 0.138146)."""
    loss, grad, m = run("token", 0.2, 0.2)
    assert loss == pytest.approx(-0.269878, abs=1e-6)
    expected = torch.tensor([[-0.184195, -0.158538, -0.184195], [0.118904, 0.138146, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert m["clip/token_total"] == 0.0


def test_grpo_token_level_hand_worked_tight_clip():
    """Token level with eps (3e-4, 4e-4): row 0 tokens 1 and 3 (r = 1.105 > 1.0004, A > 0) are clipped, token 2
    (r = 0.951 < 1) is not; row 1 token 1 (r = 0.951 < 0.9997, A < 0) is clipped, token 2 is not.
    Row 0: -(1.0004 + 0.951229 + 1.0004)/3 = -0.984010; row 1: (0.49985 + 0.552585)/2 = 0.526218; loss -0.228896.
    Only unclipped tokens get gradient: row 0 token 2 -0.158538, row 1 token 2 0.138146."""
    loss, grad, m = run("token", 3e-4, 4e-4)
    assert loss == pytest.approx(-0.228896, abs=1e-6)
    expected = torch.tensor([[0, -0.158538, 0], [0, 0.138146, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert m["clip/token_high"] == pytest.approx(2 / 5) and m["clip/token_low"] == pytest.approx(1 / 5)
    assert m["clip/seq_total"] == pytest.approx((2 / 3 + 1 / 2) / 2)


def test_gspo_token_equals_gspo_with_sequence_advantages():
    """GSPO-token equals GSPO in loss value and gradient when every token of a sequence has the same advantage."""
    torch.manual_seed(0)
    for eps in ((3e-4, 4e-4), (0.2, 0.2)):
        logp = -torch.rand(4, 7, dtype=torch.float64) * 3
        old = logp + 0.05 * torch.randn(4, 7, dtype=torch.float64)
        mask = torch.arange(7)[None, :] < torch.tensor([7, 5, 3, 6])[:, None]
        adv = torch.randn(4, dtype=torch.float64)
        outs = []
        for level, a in (("sequence", adv), ("sequence_token", adv[:, None].expand(4, 7))):
            lp = logp.clone().requires_grad_(True)
            loss, _ = policy_loss(lp, old, a, mask, level=level, eps_low=eps[0], eps_high=eps[1], aggregation="seq-mean-token-mean")
            loss.backward()
            outs.append((loss.detach(), lp.grad))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1], outs[1][1])


def test_gspo_token_differs_with_per_token_advantages():
    """With advantages that vary along a sequence, GSPO-token's gradient differs from GSPO's with the mean advantage."""
    logp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    old = logp - 0.01
    adv_tok = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    grads = []
    for level, a in (("sequence_token", adv_tok), ("sequence", adv_tok.mean(-1))):
        lp = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, a, mask, level=level, eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean")
        loss.backward()
        grads.append(lp.grad)
    assert not torch.allclose(grads[0], grads[1])
    # GSPO-token: each token's gradient is -s * A_t / |y|; s = e^0.01
    s = math.exp(0.01)
    torch.testing.assert_close(grads[0], torch.tensor([[-s / 3, 0.0, s / 3]], dtype=torch.float64))


def test_sequence_level_rejects_per_token_advantages():
    """level='sequence' refuses advantages that vary within a sequence and names GSPO-token as the fix."""
    with pytest.raises(UserError, match="sequence_token"):
        run("sequence", 0.2, 0.2, adv=[[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_padding_never_changes_loss_or_gradient(level, aggregation):
    """Padded positions holding +-inf or NaN change neither the loss nor the gradient of real tokens."""
    results = []
    for fill in (0.0, float("inf"), float("-inf"), float("nan")):
        lp = [[-1.00, -0.50, -2.00], [-0.30, -1.20, fill]]
        old = [[-1.10, -0.45, -2.10], [-0.25, -1.30, -fill if fill == fill else fill]]
        loss, grad, _ = run(level, 0.2, 0.28, aggregation=aggregation, logp=lp, old=old)
        assert math.isfinite(loss) and torch.isfinite(grad).all()
        results.append((loss, grad))
    for loss, grad in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-12)
        torch.testing.assert_close(grad, results[0][1])
        assert grad[1, 2] == 0


def test_aggregation_modes_hand_worked():
    """The three aggregations on x = [[1, 2, 3], [4, 5, pad]]: seq-mean-token-mean (2 + 4.5)/2 = 3.25,
    token-mean 15/5 = 3, seq-mean-token-sum-norm 15/(2*4) = 1.875 with max_length 4."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    m = torch.tensor(MASK).bool()
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx(3.25)
    assert aggregate(x, m, "token-mean").item() == pytest.approx(3.0)
    assert aggregate(x, m, "seq-mean-token-sum-norm", max_length=4).item() == pytest.approx(1.875)
    with pytest.raises(UserError, match="token-mean"):
        aggregate(x, m, "mean")


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_microbatches_sum_to_full_batch(aggregation):
    """Summing the losses of micro-batches with the full batch's denominators gives the full-batch loss and gradient."""
    torch.manual_seed(1)
    logp = -torch.rand(6, 5, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(6, 5, dtype=torch.float64)
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]
    adv = torch.randn(6, dtype=torch.float64)
    kw = dict(level="token", eps_low=0.2, eps_high=0.28, aggregation=aggregation, max_length=5)
    full_lp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, old, adv, mask, **kw)
    full.backward()
    part_lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        loss, _ = policy_loss(part_lp[rows], old[rows], adv[rows], mask[rows], num_seqs=6, num_tokens=int(mask.sum()), **kw)
        total = total + loss
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(part_lp.grad, full_lp.grad)


def test_ratio_is_one_on_policy_and_sequence_ratio_is_geometric_mean():
    """On-policy every ratio is 1; off-policy the sequence ratio is the geometric mean of the token ratios."""
    lp = torch.tensor(LOGP)
    mask = torch.tensor(MASK).bool()
    for level in ("token", "sequence", "sequence_token"):
        r = importance_ratio(lp, lp.clone(), mask, level)
        assert torch.allclose(r[mask], torch.ones(5))
    s = importance_ratio(lp, torch.tensor(OLD), mask, "sequence")
    assert s[0, 0].item() == pytest.approx((math.exp(0.1) * math.exp(-0.05) * math.exp(0.1)) ** (1 / 3), rel=1e-6)


def test_extreme_log_ratio_is_clamped_before_exp():
    """A log-ratio of 1000 does not overflow: the loss and gradient stay finite."""
    loss, grad, m = run("token", 0.2, 0.2, logp=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], old=[[-1000.0, 0, 0], [0, 0, 0]])
    assert math.isfinite(loss) and torch.isfinite(grad).all() and math.isfinite(m["kl/old_new"])


def test_kl_to_reference_adds_beta_times_k3():
    """With beta > 0 the loss grows by beta * mean k3 KL; k3 of ref - logp = 0.1 is e^0.1 - 0.1 - 1 = 0.005171."""
    lp = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=torch.float64)
    loss, m = policy_loss(lp, lp, adv, mask, level="token", eps_low=0.2, eps_high=0.2, aggregation="token-mean",
                          ref_logp=lp + 0.1, beta=0.5)
    assert loss.item() == pytest.approx(0.5 * (math.exp(0.1) - 0.1 - 1), abs=1e-9)
    assert m["kl/ref"] == pytest.approx(math.exp(0.1) - 0.1 - 1, abs=1e-9)


def test_metrics_are_detached_zero_dim_tensors():
    """Every metric is a detached 0-dim tensor (no host sync, no graph held until the step's one reduce)."""
    _, _, m = run("sequence", 3e-4, 4e-4)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())
    for key in ("clip/token_low", "clip/token_high", "clip/token_total", "clip/seq_low", "clip/seq_high",
                "clip/seq_total", "ratio/token_mean", "ratio/seq_mean", "ratio/token_max", "ratio/seq_min", "kl/old_new"):
        assert key in m


def test_masked_statistics_match_boolean_indexing():
    """The ratio statistics computed under a mask equal those of the selected values (what the metrics used to index)."""
    torch.manual_seed(0)
    logp, old = torch.randn(5, 7) * 0.1, torch.randn(5, 7) * 0.1
    mask = torch.rand(5, 7) > 0.4
    mask[3] = False  # a row without tokens
    m = ratio_metrics(logp, old, mask)
    w = torch.exp(logp - old)[mask]
    for name, value in (("mean", w.mean()), ("std", w.std(unbiased=False)), ("min", w.min()), ("max", w.max())):
        assert m[f"ratio/token_{name}"].item() == pytest.approx(value.item(), rel=1e-6)
    empty = ratio_metrics(logp, old, torch.zeros_like(mask))
    assert math.isnan(empty["ratio/token_mean"].item()) and math.isnan(empty["ratio/seq_max"].item())


def test_rows_without_loss_tokens_do_not_count_as_sequences():
    """A fully masked row (overlong-filtered) is left out of the sequence mean: the other rows' gradient is unchanged."""
    logp = torch.tensor([[-1.0, -0.5], [-0.3, -1.2]], dtype=torch.float64)
    grads = []
    for mask in ([[1, 1], [0, 0]], [[1, 1]]):
        m = torch.tensor(mask).bool()
        lp = logp[: len(mask)].clone().requires_grad_(True)
        loss, _ = policy_loss(lp, lp.detach(), torch.ones(len(mask), dtype=torch.float64), m, level="sequence",
                              eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean")
        loss.backward()
        grads.append(lp.grad[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_length_bin_metrics_hand_worked():
    """Three responses of 2, 70 and 0 tokens (the last left out of the loss) in a run of max_length 128: bins 0-63,
    64-127 and 128-255 (for responses cut at exactly 128; 256 and more cannot be filled). Bin 0-63 holds row 0: token log-ratios (log 2, 0), one clipped ->
    clip 1/2, token ratios (2, 1): std 0.5, one sequence: std 0. Bin 64-127 holds row 1: 70 tokens of ratio 1, none
    clipped."""
    from gspo.algorithms.losses import length_bin_metrics, response_length_bins

    assert [name for *_, name in response_length_bins(128)] == ["0-63", "64-127", "128-255"]
    assert [name for *_, name in response_length_bins(127)] == ["0-63", "64-127"]
    assert [name for *_, name in response_length_bins(600)] == ["0-63", "64-127", "128-255", "256-511", "512+"]
    T = 80
    mask = torch.zeros(3, T, dtype=torch.bool)
    mask[0, :2], mask[1, :70] = True, True
    token_lr = torch.zeros(3, T)
    token_lr[0, 0] = math.log(2.0)
    clipped = torch.zeros(3, T, dtype=torch.bool)
    clipped[0, 0] = True
    out = {k: float(v) for k, v in length_bin_metrics(token_lr, mask, clipped, 128).items()}
    assert out["bylen/0-63/seqs"] == 1 and out["bylen/64-127/seqs"] == 1
    assert out["bylen/0-63/clip_token"] == 0.5 and out["bylen/64-127/clip_token"] == 0.0
    assert out["bylen/0-63/ratio_token_std"] == pytest.approx(0.5) and out["bylen/0-63/ratio_seq_std"] == 0.0
    assert out["bylen/64-127/ratio_token_std"] == 0.0
    assert out["bylen/128-255/seqs"] == 0 and math.isnan(out["bylen/128-255/clip_token"])
    empty = length_bin_metrics(token_lr, mask & False, clipped, 128)
    assert float(empty["bylen/0-63/seqs"]) == 0 and math.isnan(float(empty["bylen/0-63/clip_token"]))


def test_policy_loss_reports_length_bins_of_its_max_length():
    logp, old = torch.zeros(2, 5), torch.zeros(2, 5)
    _, metrics = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 5, dtype=torch.bool), level="token",
                             eps_low=0.2, eps_high=0.2, aggregation="token-mean", max_length=300)
    assert {k for k in metrics if k.endswith("/seqs")} == {"bylen/0-63/seqs", "bylen/64-127/seqs", "bylen/128-255/seqs",
                                                           "bylen/256-511/seqs"}
