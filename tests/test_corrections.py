"""Behaviour-policy corrections (gspo.algorithms.corrections): hand-worked numbers, an independent float64
re-statement on random inputs, the loss they weight, and a training run that logs them."""
import math

import pytest
import torch

from gspo.algorithms.corrections import DEFAULT_BOUNDS, mismatch_weights
from gspo.algorithms.losses import policy_loss

LN2 = math.log(2.0)


def test_hand_worked_weights_of_each_correction():
    """Two rows: row 0's three tokens have pi_old / pi_engine = 1, 4, 1/2 (geometric mean 4^(1/3) * 2^(-1/3) =
    2^(1/3) = 1.26); row 1's one token 1.005; a padded position holds garbage that must not count."""
    behave = torch.zeros(2, 3, dtype=torch.float64)
    prox = torch.tensor([[0.0, 2 * LN2, -LN2], [math.log(1.005), 99.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])

    w, kept, m = mismatch_weights(prox, behave, mask, "tis", "token", 0.0, 2.0)
    assert torch.allclose(w.float(), torch.tensor([[1.0, 2.0, 0.5], [1.005, 0.0, 0.0]]))  # 4 truncated to 2
    assert torch.equal(kept, mask) and m["mismatch/truncated"].item() == pytest.approx(1 / 4)

    g = 2 ** (1 / 3)
    w, kept, m = mismatch_weights(prox, behave, mask, "tis", "sequence", 0.0, 2.0)
    assert torch.allclose(w.float(), torch.tensor([[g, g, g], [1.005, 0.0, 0.0]]))  # one weight a sequence, under the cap
    assert m["mismatch/truncated"].item() == 0.0
    w, _, m = mismatch_weights(prox, behave, mask, "tis", "sequence", 0.0, 1.1)
    assert torch.allclose(w.float(), torch.tensor([[1.1, 1.1, 1.1], [1.005, 0.0, 0.0]])) and m["mismatch/truncated"] == 0.5

    w, kept, m = mismatch_weights(prox, behave, mask, "sequence_mask", "sequence", 0.99, 1.01)
    assert torch.equal(kept, torch.tensor([[False] * 3, [True, False, False]]))  # row 0's 1.26 leaves [0.99, 1.01]
    assert torch.equal(w, kept.double()) and m["mismatch/masked_seqs"] == 0.5 and m["mismatch/masked_tokens"] == 0.75

    w, kept, m = mismatch_weights(prox, behave, mask, "icepop", "token", 0.5, 2.0)
    assert torch.equal(kept, torch.tensor([[True, False, True], [True, False, False]]))  # 4 leaves [0.5, 2]
    assert torch.allclose(w.float(), torch.tensor([[1.0, 0.0, 0.5], [1.005, 0.0, 0.0]]))
    assert m["mismatch/masked_tokens"] == 0.25 and m["mismatch/masked_seqs"] == 0.0

    w, kept, m = mismatch_weights(prox, behave, mask, "off", "token", 0.0, 1.0)
    assert torch.equal(w, mask.double()) and torch.equal(kept, mask)


def _reference(prox, behave, mask, kind, level, low, high):
    """The corrections re-stated row by row in float64 Python, from their definitions (verl's token/sequence TIS at
    GSPO's geometric level, SkyRL's geometric sequence mask, IcePop's two-sided token mask)."""
    B, T = mask.shape
    w = [[0.0] * T for _ in range(B)]
    keep = [[False] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        lw = {t: max(-20.0, min(20.0, float(prox[i, t]) - float(behave[i, t]))) for t in idx}
        g = math.exp(sum(lw.values()) / len(idx)) if idx else 1.0
        for t in idx:
            r = math.exp(lw[t])
            if kind == "tis":
                w[i][t], keep[i][t] = min(r if level == "token" else g, high), True
            elif kind == "sequence_mask":
                keep[i][t] = low <= g <= high
                w[i][t] = 1.0 if keep[i][t] else 0.0
            else:  # icepop
                keep[i][t] = low <= r <= high
                w[i][t] = r if keep[i][t] else 0.0
    return torch.tensor(w, dtype=torch.float64), torch.tensor(keep)


@pytest.mark.parametrize("kind, level", [("tis", "token"), ("tis", "sequence"), ("tis", "sequence_token"),
                                         ("sequence_mask", "sequence"), ("sequence_mask", "token"), ("icepop", "token")])
def test_weights_equal_a_float64_restatement_on_random_inputs(kind, level):
    """Random log-probs with gaps from 0 to several nats, random masks with empty rows: the weights and kept masks
    equal the re-statement (float64 both), at the default bounds and at random ones."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        B, T = 6, 9
        prox = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 5
        behave = prox + torch.randn(B, T, generator=gen, dtype=torch.float64) * (0.01 if trial % 2 else 1.0)
        mask = torch.rand(B, T, generator=gen) < 0.7
        mask[0] = False  # an empty row
        low, high = DEFAULT_BOUNDS[kind] if trial < 10 else sorted(torch.rand(2, generator=gen).tolist())
        high = high + 0.5 if trial >= 10 else high
        w, kept, metrics = mismatch_weights(prox, behave, mask, kind, level, low, high)
        ref_w, ref_keep = _reference(prox, behave, mask, kind, level, low, high)
        assert torch.equal(kept, ref_keep)
        assert torch.allclose(w, ref_w, rtol=1e-12, atol=0)
        assert all(torch.isfinite(v) for v in metrics.values())


def test_the_loss_weighs_each_term_and_left_out_tokens_leave_the_denominators():
    """policy_loss with weights: all-ones weights are no correction; weights w scale each position's term; a
    correction's kept mask passed as the mask makes the token-mean the mean over the kept tokens only."""
    gen = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=gen)).requires_grad_()
    old = logp.detach() - 0.05 * torch.randn(3, 5, generator=gen)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5, dtype=torch.bool)
    kw = dict(level="token", eps_low=0.2, eps_high=0.28, aggregation="token-mean", with_metrics=False)
    plain, _ = policy_loss(logp, old, adv, mask, **kw)
    ones, _ = policy_loss(logp, old, adv, mask, weights=torch.ones(3, 5), **kw)
    assert torch.equal(plain, ones)
    w = torch.rand(3, 5, generator=gen) * 2
    weighted, _ = policy_loss(logp, old, adv, mask, weights=w, **kw)
    ratio = torch.exp(logp - old)
    per = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    assert torch.allclose(weighted, (w * per).mean())
    kept = mask.clone()
    kept[1, 2:] = False
    masked, _ = policy_loss(logp, old, adv, kept, weights=kept.float(), **kw)
    assert torch.allclose(masked, per[kept].mean())  # 12 kept tokens in the denominator, not 15


def test_a_run_with_each_correction_logs_it_and_an_exact_engine_weighs_every_token_one(tiny_dir, tmp_path):  # noqa: F811
    """Training with loss.mismatch_correction: against an exact engine (the hf engine on the trainer's own fp32
    weights) every weight is 1 and nothing is left out; against 4-bit engine weights the weights spread, TIS
    truncates, the masks leave tokens or sequences out, and every loss stays finite."""
    from gspo.runlog.metrics import read_jsonl
    from gspo.train import Trainer
    from test_trainer import tiny_config

    def run(name, *extra):
        Trainer(tiny_config(tiny_dir, "rollout.engine='hf'", "train.steps=4", *extra), tmp_path / name).train()
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    exact = run("exact", "loss.mismatch_correction='tis'")
    batch = [r for r in exact if r["minibatch"] == 0]
    assert all(r["mismatch/weight_mean"] == pytest.approx(1.0, abs=1e-5) and r["mismatch/truncated"] == 0.0
               for r in batch)
    assert all(r["logprob/engine_diff_max"] < 1e-4 for r in batch)
    for kind, key in (("tis", "mismatch/truncated"), ("sequence_mask", "mismatch/masked_seqs"),
                      ("icepop", "mismatch/masked_tokens")):
        rows = run(kind, f"loss.mismatch_correction='{kind}'", "rollout.engine_weight_bits=4",
                   *{"tis": ["loss.mismatch_bounds=[0.0, 1.05]", "algorithm='grpo'"],
                     "icepop": ["loss.mismatch_bounds=[0.95, 1.05]"]}.get(kind, []))
        first = [r for r in rows if r["minibatch"] == 0]
        assert all(math.isfinite(r["loss"]) for r in rows)
        assert max(r[key] for r in first) > 0, (kind, [r[key] for r in first])
        assert max(r["logprob/engine_diff_mean"] for r in first) > 1e-3


from test_trainer import tiny_dir  # noqa: E402,F401  (the module fixture)
