"""Tests for specdec.sampling: the logits -> probabilities filters and keyed randomness (sampling.rng)."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import kstest
from torch import Tensor

from specdec.config import SamplingParams as SP
from stats_util import chi2_pvalue
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import ACCEPT, DRAFT, NOISE, RowKeys

ALPHA = 1e-4  # significance of each chi-square test; seeds are fixed, so every run is identical


def probs_of(logits: list[float], **params) -> Tensor:
    st = SamplingTensors.from_params([SP(**params)])
    return logits_to_probs(torch.tensor([logits], dtype=torch.float32), st)[0]


def support(p: Tensor) -> set[int]:
    return set(torch.nonzero(p).flatten().tolist())


def softmax_over(logits: list[float], keep: set[int]) -> Tensor:
    x = torch.tensor(logits, dtype=torch.float64)
    x[[i for i in range(len(logits)) if i not in keep]] = float("-inf")
    return torch.softmax(x, -1).float()


def reference_probs(logits: Tensor, p: SP) -> Tensor:
    """A slow, obviously-correct float64 version of logits_to_probs for one row (V,)."""
    x = logits.double().clone()
    if p.temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).float()
    x = x / p.temperature
    if p.top_k > 0:
        kth = x.sort(descending=True).values[min(p.top_k, x.numel()) - 1]
        x[x < kth] = float("-inf")
    if p.top_p < 1:
        probs = torch.softmax(x, -1)
        srt = probs.sort(descending=True).values
        n = int((srt.cumsum(0) - srt < p.top_p).sum())
        x[probs < srt[n - 1]] = float("-inf")
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    return torch.softmax(x, -1).float()


# ---------------------------------------------------------------- logits_to_probs


def test_greedy_is_one_hot_at_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.1]])
    st = SamplingTensors.from_params([SP(temperature=0.0, top_k=2, top_p=0.5)] * 3)
    probs = logits_to_probs(logits, st)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.eye(4)[[1, 0, 3]])
    bf = torch.randn(2, 3, 50).to(torch.bfloat16)  # (B, T, V) in bf16
    probs = logits_to_probs(bf, SamplingTensors.from_params([SP(temperature=0.0)] * 2))
    assert probs.shape == (2, 3, 50) and probs.dtype == torch.float32
    assert torch.equal(probs.argmax(-1), bf.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(2, 3))


def test_temperature_scales_logits():
    logits = torch.randn(3, 40)
    st = SamplingTensors.from_params([SP(temperature=t) for t in (0.5, 1.0, 2.0)])
    expected = torch.softmax(logits / torch.tensor([[0.5], [1.0], [2.0]]), -1)
    assert torch.allclose(logits_to_probs(logits, st), expected, atol=1e-7)


def test_no_filters_is_plain_softmax():
    logits = torch.randn(4, 100)
    for p in (SP(), SP(top_p=1.0, top_k=-1, min_p=0.0), SP(top_k=0)):
        st = SamplingTensors.from_params([p] * 4)
        assert not (st.do_top_k or st.do_top_p or st.do_min_p)
        assert torch.equal(logits_to_probs(logits, st), torch.softmax(logits, -1))


@pytest.mark.parametrize("k, kept", [(1, {1, 3}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3}),
                                     (5, {0, 1, 2, 3, 4}), (100, {0, 1, 2, 3, 4})])
def test_top_k_keeps_every_token_tied_with_the_kth(k, kept):
    logits = [1.0, 3.0, 2.0, 3.0, 0.0]
    p = probs_of(logits, top_k=k)
    assert support(p) == kept
    assert torch.allclose(p, softmax_over(logits, kept), atol=1e-7)


@pytest.mark.parametrize("probs, top_p, kept", [
    ([0.4, 0.3, 0.2, 0.1], 0.1, {0}),
    ([0.4, 0.3, 0.2, 0.1], 0.35, {0}),
    ([0.4, 0.3, 0.2, 0.1], 0.45, {0, 1}),
    ([0.4, 0.3, 0.2, 0.1], 0.65, {0, 1}),
    ([0.4, 0.3, 0.2, 0.1], 0.75, {0, 1, 2}),
    ([0.4, 0.3, 0.2, 0.1], 0.95, {0, 1, 2, 3}),
    ([0.1, 0.2, 0.4, 0.3], 0.65, {2, 3}),  # order of tokens does not matter
    ([0.4, 0.2, 0.2, 0.2], 0.5, {0, 1, 2, 3}),  # the cut falls in a tie group: all of it is kept
    ([0.3, 0.3, 0.2, 0.2], 0.2, {0, 1}),
    ([0.2, 0.3, 0.2, 0.3], 0.65, {0, 1, 2, 3}),
    ([0.97, 0.01, 0.01, 0.01], 0.5, {0}),
])
def test_top_p_keeps_smallest_prefix_reaching_top_p(probs, top_p, kept):
    logits = [math.log(q) for q in probs]
    p = probs_of(logits, top_p=top_p)
    assert support(p) == kept
    assert torch.allclose(p, softmax_over(logits, kept), atol=1e-6)


def test_top_p_one_is_a_no_op_and_wide_nuclei_match_a_full_sort():
    logits = torch.randn(6, 5000) * 0.5  # flat rows: nucleus far wider than a small window
    st = SamplingTensors.from_params([SP(top_p=0.9)] * 3 + [SP(top_p=1.0)] * 3)
    full = logits_to_probs(logits, st, top_p_window=5000)
    for window in (1, 7, 300):  # escalation 1 -> 16 -> 256 -> ... must give the same answer
        assert torch.equal(logits_to_probs(logits, st, top_p_window=window), full)
    assert torch.equal(full[3:], torch.softmax(logits[3:], -1))
    for row in range(3):
        assert support(full[row]) == support(reference_probs(logits[row], SP(top_p=0.9)))


@pytest.mark.parametrize("min_p, kept", [(0.1, {0, 1, 2, 3}), (0.3, {0, 1, 2}), (0.5, {0}),
                                         (1.0, {0})])
def test_min_p_keeps_tokens_within_a_ratio_of_the_top(min_p, kept):
    logits = [2.0, 1.0, 1.0, 0.0, -3.0]  # p / p_max = 1, e^-1, e^-1, e^-2, e^-5
    p = probs_of(logits, min_p=min_p)
    assert support(p) == kept
    assert torch.allclose(p, softmax_over(logits, kept), atol=1e-7)
    assert support(probs_of([2.0, 2.0, 1.0], min_p=1.0)) == {0, 1}


def test_filters_apply_in_order_after_temperature():
    logits = [math.log(q) for q in (0.35, 0.25, 0.2, 0.2)]
    # top-p sees the top-k distribution (0.58, 0.42): 0.58 >= 0.55 already
    assert support(probs_of(logits, top_k=2, top_p=0.55)) == {0}
    assert support(probs_of(logits, top_p=0.55)) == {0, 1}
    # min-p uses the temperature-scaled ratio: e^-0.5 = 0.61 at T=2, e^-1 = 0.37 at T=1
    assert support(probs_of([0.0, -1.0], min_p=0.5, temperature=2.0)) == {0, 1}
    assert support(probs_of([0.0, -1.0], min_p=0.5, temperature=1.0)) == {0}
    # temperature changes the nucleus: at T=0.25 the top token alone has mass >= 0.9
    assert support(probs_of([1.0, 0.0, 0.0], top_p=0.9, temperature=0.25)) == {0}
    assert support(probs_of([1.0, 0.0, 0.0], top_p=0.9)) == {0, 1, 2}


PARAMS = [SP(), SP(temperature=0.0), SP(top_k=5), SP(top_p=0.8), SP(min_p=0.05),
          SP(temperature=0.7, top_k=40, top_p=0.9), SP(temperature=1.3, top_p=0.95, min_p=0.02),
          SP(top_k=2000, top_p=0.5), SP(temperature=0.0, top_k=3), SP(top_k=1)]


def test_rows_with_different_params_match_each_row_alone_and_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), 3000, generator=g) * 2.0  # (B, V)
    batched = logits_to_probs(logits, SamplingTensors.from_params(PARAMS))
    for b, p in enumerate(PARAMS):
        alone = logits_to_probs(logits[b:b + 1], SamplingTensors.from_params([p]))[0]
        assert torch.equal(batched[b], alone), p
        ref = reference_probs(logits[b], p)
        assert support(alone) == support(ref), p
        assert torch.allclose(alone, ref, atol=1e-6), p


def test_three_dim_logits_apply_each_rows_params_to_all_its_positions():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 3, 500, generator=g)  # (B, T, V)
    st = SamplingTensors.from_params(PARAMS)
    bf = logits.to(torch.bfloat16)
    probs = logits_to_probs(bf, st)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    flat = SamplingTensors.from_params([p for p in PARAMS for _ in range(3)])
    assert torch.equal(probs.view(-1, 500), logits_to_probs(bf.view(-1, 500), flat))


# ---------------------------------------------------------------- RowKeys (keyed randomness)


def test_a_rows_draws_depend_on_its_seed_and_position_alone():
    """Neither the batch nor the order of calls moves a row's draws (a stream would)."""
    probs = torch.softmax(torch.randn(1, 50), -1)
    alone = RowKeys([7], [3])
    batch = RowKeys([1, 7, 2**64 - 1, 7], [0, 3, 5, 4])
    for off in range(3):
        assert torch.equal(batch.uniform(4, ACCEPT)[1], alone.uniform(4, ACCEPT)[0])
        assert torch.equal(batch.uniform(4, ACCEPT)[1], alone.uniform(4, ACCEPT)[0])  # repeatable
        assert torch.equal(batch.gumbel_argmax(probs.expand(4, -1), off)[1:2], alone.gumbel_argmax(probs, off))
        assert torch.equal(batch.sample_cdf(probs.expand(4, -1), off)[1:2], alone.sample_cdf(probs, off))
    # position 4 of seed 7 is row 3's position 0 and the alone row's position 1
    assert torch.equal(batch.uniform(1, DRAFT)[3], alone.advanced(1).uniform(1, DRAFT)[0])
    assert torch.equal(batch.exponentials(torch.tensor([1]), 50, rows=torch.tensor([1]))[0],
                       batch.exponentials(torch.tensor([0]), 50, rows=torch.tensor([3]))[0])


def test_purposes_stages_and_seeds_draw_differently():
    base = RowKeys([5, 6], [10, 10])
    u = {p: base.uniform(8, p) for p in (ACCEPT, DRAFT, NOISE)}
    assert not torch.equal(u[ACCEPT], u[DRAFT]) and not torch.equal(u[ACCEPT][0], u[ACCEPT][1])
    inner = RowKeys([5, 6], [10, 10], stage=1)
    assert not torch.equal(inner.uniform(8, ACCEPT), u[ACCEPT])
    off = torch.zeros(2, dtype=torch.long)
    assert not torch.equal(inner.exponentials(off, 30), base.exponentials(off, 30))
    shared = RowKeys([5, 6], [10, 10], stage=1, shared_noise=True)  # Gumbel verification: one noise
    assert torch.equal(shared.exponentials(off, 30), base.exponentials(off, 30))
    assert not torch.equal(shared.uniform(8, ACCEPT), u[ACCEPT])


@pytest.mark.parametrize("V", [10, 3000], ids=["hashed", "twister"])
def test_noise_is_standard_exponential(V):
    """Both noise generators (hashed counters, keyed Mersenne Twister): Kolmogorov-Smirnov against
    Exp(1) at ALPHA, fixed seeds; and no zero (w / E must never be NaN)."""
    keys = RowKeys.independent(4000 // V + 8, seed=3)
    e = keys.exponentials(torch.zeros(len(keys), dtype=torch.long), V)
    assert (e > 0).all()
    assert kstest(e.flatten()[:20_000].double().numpy(), "expon").pvalue > ALPHA


@pytest.mark.parametrize("sampler", ["gumbel", "cdf"])
def test_sample_frequencies_match_probs_chi_square(sampler):
    """Gumbel-max and inverse-CDF draws have the law of probs. False-failure rate ALPHA = 1e-4."""
    probs = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.0, 0.2, 0.1, 0.12, 0.08, 0.0])
    keys = RowKeys.independent(40_000, seed=1)
    draw = keys.gumbel_argmax if sampler == "gumbel" else keys.sample_cdf
    draws = torch.cat([draw(probs.expand(40_000, -1), j) for j in range(2)])
    assert chi2_pvalue(torch.bincount(draws, minlength=10), probs) > ALPHA
    # the statistic has power: the same draws are rejected against a slightly different law
    wrong = probs.clone()
    wrong[[0, 3]] += torch.tensor([-0.02, 0.02])
    assert chi2_pvalue(torch.bincount(draws, minlength=10), wrong) < ALPHA


def test_gumbel_max_on_a_large_vocabulary_follows_probs():
    """The Mersenne Twister noise path (V > HASH_MAX_V): mass spread over a large vocabulary."""
    V = 3000
    logits = torch.full((V,), -30.0)
    logits[[5, 700, 2999]] = torch.tensor([1.0, 0.0, 0.5])
    probs = torch.softmax(logits, -1)
    keys = RowKeys.independent(6000, seed=2)
    draws = keys.gumbel_argmax(probs.expand(6000, -1))
    counts = torch.stack([(draws == t).sum() for t in (5, 700, 2999)])
    assert int(counts.sum()) == 6000
    assert chi2_pvalue(counts, probs[[5, 700, 2999]] / probs[[5, 700, 2999]].sum()) > ALPHA


def test_sample_never_returns_a_zero_weight_token_at_the_extremes():
    keys = RowKeys.independent(3)
    weights = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 3.0], [0.0, 2.0, 0.0]])  # unnormalised
    keys.uniform = lambda offsets, purpose, sub=0: torch.full((3, 1), 1.0 - 2.0 ** -53, dtype=torch.float64)
    assert keys.sample_cdf(weights).tolist() == [1, 2, 1]
    keys.uniform = lambda offsets, purpose, sub=0: torch.zeros(3, 1, dtype=torch.float64)
    assert keys.sample_cdf(weights).tolist() == [0, 2, 1]
    assert RowKeys.independent(3).gumbel_argmax(weights).tolist()[1:] == [2, 1]
