"""Tests for specdec.sampling.gumbel: drafter-invariant verification by Gumbel-max equality.

The simulations reuse test_rejection.py's Markov target (P0, T) and draft (Q0, Q) on many rows with
independent seeds; chi-square tests at ALPHA with fixed seeds (deterministic runs).
"""
from __future__ import annotations

import torch

from specdec.engine.tree import chain_parents
from specdec.sampling.gumbel import verify_gumbel, verify_tree_gumbel
from specdec.sampling.rejection import verify_greedy
from specdec.sampling.rng import RowKeys
from stats_util import chi2_pvalue
from test_rejection import ALPHA, V, dirichlet

N = 100_000


def markov(seed: int):
    g = torch.Generator().manual_seed(seed)
    return dirichlet(1, V, g)[0], dirichlet(V, V, g), dirichlet(1, V, g)[0], dirichlet(V, V, g)


def gumbel_chain(keys: RowKeys, first: torch.Tensor, trans: torch.Tensor, K: int) -> torch.Tensor:
    """(N, K) tokens of the Markov chain (first, trans) drawn by Gumbel-max with ``keys``' noise."""
    toks, law = [], first.expand(len(keys), -1)
    for j in range(K):
        t = keys.gumbel_argmax(law, j)
        toks.append(t)
        law = trans[t]
    return torch.stack(toks, 1)


def run(K: int, seed: int, draft: str = "gumbel"):
    """One verification step of every row: the emitted tokens, num_accepted, and the target's own
    plain Gumbel-max tokens (what plain decoding with the same seeds emits)."""
    P0, T, Q0, Q = markov(seed)
    keys = RowKeys.independent(N, seed)
    if draft == "gumbel":  # the drafter's own Gumbel-argmax with the target's noise
        ids = gumbel_chain(keys, Q0, Q, K)
    else:  # any other draft: sampled independently of the noise
        g = torch.Generator().manual_seed(seed + 100)
        ids = torch.multinomial(Q0.expand(N, -1), K, replacement=True, generator=g)
    target = torch.stack([P0.expand(N, -1)] + [T[ids[:, i]] for i in range(K)], 1)  # (N, K+1, V)
    out, na = verify_gumbel(ids, target, torch.full((N,), K), keys)
    plain = gumbel_chain(keys, P0, T, K + 1)
    return out, na, plain, (P0, T, Q0, Q)


def test_emitted_tokens_are_plain_decodings_whatever_the_draft():
    for draft in ("gumbel", "independent"):
        out, na, plain, _ = run(3, seed=1, draft=draft)
        for j in range(4):
            emitted = na >= j
            assert torch.equal(out[emitted, j], plain[emitted, j]), (draft, j)
            assert (out[~emitted, j] == -1).all()


def test_emitted_law_is_the_targets_and_acceptance_meets_the_coupling_bound():
    out, na, _, (P0, T, Q0, _) = run(2, seed=2)
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), P0) > ALPHA
    two = na >= 1
    pairs = torch.bincount(out[two, 0] * V + out[two, 1], minlength=V * V).view(V, V).float()
    assert chi2_pvalue(pairs, pairs.sum(1, keepdim=True) * T) > ALPHA
    tv = 0.5 * (P0 - Q0).abs().sum()
    rate = (na >= 1).double().mean()
    bound = (1 - tv) / (1 + tv)  # Daliri, Musco and Suresh 2024
    assert rate > bound - 4 * (0.25 / N) ** 0.5, (float(rate), float(bound), float(1 - tv))


def test_greedy_rows_verify_as_verify_greedy():
    g = torch.Generator().manual_seed(9)
    B, K, Vb = 64, 4, 50
    logits = torch.randn(B, K + 1, Vb, generator=g)
    amax = logits.argmax(-1)
    ids = torch.where(torch.rand(B, K, generator=g) < 0.7, amax[:, :K], torch.randint(0, Vb, (B, K), generator=g))
    nd = torch.randint(0, K + 1, (B,), generator=g)
    one_hot = torch.nn.functional.one_hot(amax, Vb).float()
    assert all(torch.equal(a, b) for a, b in zip(verify_gumbel(ids, one_hot, nd, RowKeys.independent(B)),
                                                  verify_greedy(ids, logits, nd)))


def test_tree_walk_on_a_chain_is_the_chain_and_finds_the_right_sibling():
    g = torch.Generator().manual_seed(4)
    B, K, Vb = 200, 4, 6
    p = torch.softmax(2 * torch.randn(B, K + 1, Vb, generator=g), -1)
    keys = RowKeys.independent(B, 4)
    ids = torch.randint(0, Vb, (B, K), generator=g)
    nd = torch.randint(0, K + 1, (B,), generator=g)
    out_c, n_c = verify_gumbel(ids, p, nd, keys)
    out_t, n_t, path = verify_tree_gumbel(ids, chain_parents(B, K), p, nd, keys)
    assert torch.equal(out_c, out_t) and torch.equal(n_c, n_t)
    # a root with every token as a child (target positions: the pending token, then each child):
    # the accepted child is the target's own Gumbel-max token at position 0
    star = torch.arange(Vb).expand(B, Vb)
    parents = torch.full((B, Vb), -1)
    target = torch.cat([p[:, :1], p[:, 1:2].expand(B, Vb, Vb)], 1)  # (B, 1+Vb, Vb)
    out, n, path = verify_tree_gumbel(star, parents, target, torch.full((B,), Vb), keys)
    first = keys.gumbel_argmax(p[:, 0], 0)
    assert (n == 1).all() and torch.equal(out[:, 0], first) and torch.equal(path[:, 0], first)
    assert torch.equal(out[:, 1], keys.gumbel_argmax(p[:, 1], 1))


def test_the_statistic_catches_a_verifier_that_keeps_the_draft():
    """Emitting the draft token on a mismatch (no verification at all) is biased toward q."""
    out, na, _, (P0, T, Q0, Q) = run(2, seed=2)
    P0x, _, _, _ = markov(2)
    keys = RowKeys.independent(N, 2)
    draft = gumbel_chain(keys, Q0, Q, 1)[:, 0]
    assert chi2_pvalue(torch.bincount(draft, minlength=V), P0x) < ALPHA
