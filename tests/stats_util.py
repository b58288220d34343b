"""Statistics shared by the distribution tests."""
from __future__ import annotations

import torch
from torch import Tensor


def chi2_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of counts against probs (any shape, flattened).

    Outcomes of probability 0 must not occur; cells expecting fewer than 5 are pooled.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    zero = probs == 0
    assert counts[zero].sum() == 0, "an outcome of probability 0 occurred"
    counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))
