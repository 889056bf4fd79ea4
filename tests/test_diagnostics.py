"""Ratio histograms and token traces: hand-checked bins, both levels from one minibatch, and the files a run writes."""
import math

import torch

from gspo.runlog.diagnostics import LOG_RATIO_EDGES, bin_counts, pick_trace_rows, ratio_histograms, token_trace


def _bin(x: float) -> int:
    return sum(1 for e in LOG_RATIO_EDGES if x >= e)


def test_bins_are_fixed_symmetric_and_half_open():
    """25 bins; 0 and -1e-5 fall in the centre bin [-1e-5, 1e-5); an edge value belongs to the bin it opens."""
    assert len(LOG_RATIO_EDGES) == 24 and LOG_RATIO_EDGES == sorted(LOG_RATIO_EDGES)
    assert all(math.isclose(a, -b) for a, b in zip(LOG_RATIO_EDGES, reversed(LOG_RATIO_EDGES)))
    counts = bin_counts(torch.tensor([0.0, 1e-5, -1e-5, 5.0, -5.0, 2e-4], dtype=torch.float64))
    assert sum(counts) == 6 and len(counts) == 25
    assert counts[12] == 2  # 0.0 and -1e-5 -> [-1e-5, 1e-5)
    assert counts[13] == 1 and _bin(1e-5) == 13  # 1e-5 opens [1e-5, 3e-5)
    assert counts[11] == 0
    assert counts[0] == 1 and counts[24] == 1  # beyond +-3: the open outer bins
    assert counts[_bin(2e-4)] == 1 and _bin(2e-4) == 15  # [1e-4, 3e-4)


def test_histograms_count_tokens_and_sequences():
    """Hand-worked: row 0 has token log-ratios (0.2, -0.2) -> sequence 0; row 1 has (0.02) -> sequence 0.02; the padded
    position of row 1 is not counted."""
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, -0.2], [0.02, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    h = ratio_histograms(logp, old, mask)
    assert sum(h["token"]) == 3 and sum(h["seq"]) == 2
    assert h["token"][_bin(0.2)] == 1 and h["token"][_bin(-0.2)] == 1 and h["token"][_bin(0.02)] == 1
    assert h["seq"][_bin(0.0)] == 1 and h["seq"][_bin(0.02)] == 1


def test_token_trace_and_row_choice(tokenizer):
    """A trace keeps each token's text and log-ratio, and the sequence log-ratio is their mean; the row with the most
    extreme token ratio is traced first."""
    ids = torch.tensor(tokenizer.encode(" 12 + 7 = 19") + [0, 0])
    n = len(ids) - 2
    mask = torch.arange(len(ids)) < n
    logp = torch.zeros(len(ids))
    logp[1] = 0.5
    t = token_trace(tokenizer, ids, logp, torch.zeros(len(ids)), mask, advantage=1.5)
    assert "".join(t["tokens"]) == " 12 + 7 = 19"
    assert t["token_log_ratio"][1] == 0.5 and math.isclose(t["seq_log_ratio"], 0.5 / n, rel_tol=1e-6)
    lp = torch.zeros(3, 4)
    lp[2, 1] = -2.0
    assert pick_trace_rows(lp, torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool), 2)[0] == 2


def test_non_finite_log_ratios_are_counted_apart():
    """A NaN or inf log-ratio (a skipped non-finite step) is not binned as an outlier: it is counted on its own."""
    logp = torch.tensor([[float("nan"), 0.1], [0.0, 0.0]])
    h = ratio_histograms(logp, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool))
    assert sum(h["token"]) == 3 and h["token_nonfinite"] == 1
    assert sum(h["seq"]) == 1 and h["seq_nonfinite"] == 1
