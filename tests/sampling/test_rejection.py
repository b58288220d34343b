"""Tests for specdec.sampling.rejection: greedy verification and lossless speculative sampling.

The statistical tests simulate speculative decoding of a Markov "target model" over a small
vocabulary on many independent rows at once: the first token has law P0, each next token the law
T[previous] (so the target's law at position 2 is known given the first token). The draft model is
a Markov chain too (Q0, Q), or a fixed map (deterministic draft, ``draft_probs=None``). Each test
compares the first emitted token with P0 and the first two emitted tokens with
P0[a] * T[a, b] by a Pearson chi-square test at significance ALPHA. Every random draw comes from
fixed seeds, so the tests are deterministic; a fresh seed would fail a correct verifier with
probability at most ALPHA per assertion.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import Tensor

from specdec.config import SamplingParams as SP
from stats_util import chi2_pvalue
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import ACCEPT, RowKeys
from specdec.sampling.rejection import verify_greedy, verify_sampled

ALPHA = 1e-4  # significance of each chi-square assertion
N = 200_000  # independent rows per simulation
V = 8


def dirichlet(rows: int, v: int, g: torch.Generator, floor: float = 0.5) -> Tensor:
    """(rows, v) random distributions mixed with the uniform, so every cell is well populated."""
    d = -torch.rand(rows, v, generator=g, dtype=torch.float64).log()
    return ((1 - floor) * d / d.sum(-1, keepdim=True) + floor / v).float()


class Chain:
    """Markov target (P0, T) and Markov draft (Q0, Q) or a deterministic draft (first, step)."""

    def __init__(self, P0: Tensor, T: Tensor, Q0: Tensor | None = None, Q: Tensor | None = None,
                 first: int | None = None, step: Tensor | None = None):
        self.P0, self.T, self.Q0, self.Q, self.first, self.step = P0, T, Q0, Q, first, step

    def round(self, prev: Tensor | None, K: int, verify: Callable, keys: RowKeys,
              g: torch.Generator) -> tuple[Tensor, Tensor]:
        """One draft + verify round for every row, after token ``prev`` (None: the first)."""
        n = N if prev is None else prev.shape[0]
        p0 = self.P0.expand(n, -1) if prev is None else self.T[prev]  # (n, V)
        ids, q = [], []
        last = prev  # the token each draft step conditions on (None: the start)
        for _ in range(K):
            if self.Q is None:  # deterministic draft
                x = torch.full((n,), self.first) if last is None else self.step[last]
            else:
                qi = self.Q0.expand(n, -1) if last is None else self.Q[last]  # (n, V)
                x = torch.multinomial(qi, 1, generator=g)[:, 0]
                q.append(qi)
            ids.append(x)
            last = x
        draft_ids = torch.stack(ids, 1)  # (n, K)
        target = torch.stack([p0] + [self.T[x] for x in ids], 1)  # (n, K+1, V)
        draft_probs = torch.stack(q, 1) if q else None  # (n, K, V)
        num_draft = torch.full((n,), K)
        return verify(draft_ids, draft_probs, target, num_draft, keys)

    def run(self, K: int, verify: Callable = verify_sampled, seed: int = 0):
        """First two emitted tokens of every row, and round one's num_accepted."""
        g = torch.Generator().manual_seed(seed)
        keys = RowKeys.independent(N, seed + 1)
        out, na = self.round(None, K, verify, keys, g)
        y1 = out[:, 0]
        # the next round, from where round one ended (used only where it emitted one token)
        out2, _ = self.round(y1, K, verify, keys.advanced(na + 1), g)
        y2 = torch.where(na >= 1, out[:, 1], out2[:, 0])
        return y1, y2, na

    def check(self, y1: Tensor, y2: Tensor) -> tuple[float, float]:
        first = chi2_pvalue(torch.bincount(y1, minlength=V), self.P0)
        joint = chi2_pvalue(torch.bincount(y1 * V + y2, minlength=V * V), self.P0[:, None] * self.T)
        return first, joint


def random_chain(seed: int, zero_q: bool = False) -> Chain:
    g = torch.Generator().manual_seed(seed)
    P0, T = dirichlet(1, V, g)[0], dirichlet(V, V, g)
    Q0, Q = dirichlet(1, V, g)[0], dirichlet(V, V, g)
    if zero_q:  # the draft never proposes tokens 0..3, which the target likes
        Q0[:4], Q[:, :4] = 0, 0
        Q0, Q = Q0 / Q0.sum(), Q / Q.sum(-1, keepdim=True)
    return Chain(P0, T, Q0, Q)


@pytest.mark.parametrize("K", [1, 3])
def test_random_p_and_q_is_lossless(K):
    """First token ~ P0 and first two ~ P0 x T; alpha = 1e-4 per assertion, fixed seeds."""
    chain = random_chain(0)
    y1, y2, na = chain.run(K)
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA
    # acceptance of the first draft token: E = sum_x min(p(x), q(x)); |z| < 3.9 is alpha = 1e-4
    alpha = torch.minimum(chain.P0, chain.Q0).sum().item()
    rate = (na >= 1).double().mean().item()
    assert abs(rate - alpha) < 3.9 * (alpha * (1 - alpha) / N) ** 0.5


def test_draft_with_zero_mass_where_target_has_mass_is_lossless():
    """q = 0 on tokens p likes: only the residual can emit them. alpha = 1e-4 per assertion."""
    chain = random_chain(1, zero_q=True)
    y1, y2, na = chain.run(2, seed=1)
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA
    assert (y1 < 4).any()  # tokens the draft cannot propose are emitted (recovered)


def test_draft_token_with_zero_draft_probability_is_treated_as_deterministic():
    """draft_probs given but q(x) = 0 for the proposed x (an inconsistent draft): lossless anyway.

    Tokens are proposed by a fixed map into q's zero set. alpha = 1e-4 per assertion.
    """
    base = random_chain(2, zero_q=True)
    step = torch.tensor([1, 2, 3, 0, 1, 2, 3, 0])  # always a token with q = 0
    chain = Chain(base.P0, base.T, first=0, step=step)

    def with_q(draft_ids, draft_probs, target, num_draft, keys):
        q = base.Q[draft_ids]  # (n, K, V): any q with q(x) = 0
        return verify_sampled(draft_ids, q, target, num_draft, keys)

    y1, y2, na = chain.run(2, verify=with_q, seed=2)
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA
    rate = (na >= 1).double().mean().item()  # accepted with probability p(x), not 1
    assert abs(rate - chain.P0[0].item()) < 3.9 * (0.25 / N) ** 0.5


def test_identical_p_and_q_always_accepts():
    """p == q: every draft token is accepted (exactly) and the output is ~p. alpha = 1e-4."""
    base = random_chain(3)
    chain = Chain(base.P0, base.T, base.P0.clone(), base.T.clone())
    y1, y2, na = chain.run(3, seed=3)
    assert (na == 3).all()
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA


def test_disjoint_supports_always_reject_and_recover_from_p():
    """p on even tokens, q on odd ones: nothing is accepted; the output is ~p. alpha = 1e-4."""
    g = torch.Generator().manual_seed(4)
    even, odd = torch.arange(V) % 2 == 0, torch.arange(V) % 2 == 1
    P0, T = dirichlet(1, V, g)[0] * even, dirichlet(V, V, g) * even
    Q0, Q = dirichlet(1, V, g)[0] * odd, dirichlet(V, V, g) * odd
    chain = Chain(*(t / t.sum(-1, keepdim=True) for t in (P0, T, Q0, Q)))
    y1, y2, na = chain.run(2, seed=4)
    assert (na == 0).all()
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA


def test_deterministic_draft_without_probs_is_lossless():
    """draft_probs=None (n-gram style): accept with p(x), recover from p without x. alpha = 1e-4."""
    base = random_chain(5)
    chain = Chain(base.P0, base.T, first=int(base.P0.argmax()), step=torch.randperm(V))
    y1, y2, na = chain.run(3, seed=5)
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA
    alpha = chain.P0[chain.first].item()
    assert abs((na >= 1).double().mean().item() - alpha) < 3.9 * (alpha * (1 - alpha) / N) ** 0.5


def test_top_k_top_p_filtered_target_and_draft_are_lossless():
    """p and q from logits_to_probs with different temperature / top-k / top-p / min-p: zeros in
    both, q(x) > 0 where p(x) = 0 and the reverse. The output law is the filtered p. alpha = 1e-4.
    """
    g = torch.Generator().manual_seed(6)
    t_logits, d_logits = torch.randn(V + 1, V, generator=g), torch.randn(V + 1, V, generator=g)
    d_logits = 0.5 * d_logits + 0.5 * t_logits  # a draft that resembles the target
    t_st = SamplingTensors.from_params([SP(temperature=0.8, top_k=5, top_p=0.9)] * (V + 1))
    d_st = SamplingTensors.from_params([SP(temperature=1.2, top_k=4, min_p=0.1)] * (V + 1))
    P, Q = logits_to_probs(t_logits, t_st), logits_to_probs(d_logits, d_st)  # row V: the start
    assert (P == 0).any() and (Q == 0).any()
    chain = Chain(P[V], P[:V], Q[V], Q[:V])
    y1, y2, na = chain.run(3, seed=6)
    first, joint = chain.check(y1, y2)
    assert first > ALPHA and joint > ALPHA


def test_num_accepted_follows_the_geometric_law():
    """Context-free p, q: P(n = j) = a^j (1 - a) for j < K, a^K for j = K, with
    a = sum_x min(p(x), q(x)). Chi-square at alpha = 1e-4, fixed seed."""
    base = random_chain(7)
    p, q = base.T[0], base.Q[0]
    chain = Chain(p, p.expand(V, -1).contiguous(), q, q.expand(V, -1).contiguous())
    K = 3
    _, _, na = chain.run(K, seed=7)
    a = torch.minimum(p, q).sum().double()
    law = torch.stack([a ** j * (1 - a) for j in range(K)] + [a ** K])
    assert chi2_pvalue(torch.bincount(na, minlength=K + 1), law) > ALPHA


def wrong_verify(draft_ids, draft_probs, target, num_draft, keys):
    """A broken verifier: accepts like the real one but on rejection samples from p, not the
    residual max(0, p - q)."""
    B, K = draft_ids.shape
    p_x = target[:, :K].gather(-1, draft_ids[..., None])[..., 0]
    q_x = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    na = (keys.uniform(K, ACCEPT, sub=torch.arange(K)) < p_x / q_x).long().cumprod(-1).sum(-1)
    nxt = keys.gumbel_argmax(target[torch.arange(B), na], na)
    padded = torch.cat([draft_ids, draft_ids[:, :1]], 1)  # (B, K+1)
    out = torch.where(torch.arange(K + 1) < na[:, None], padded, -1)
    return out.scatter_(1, na[:, None], nxt[:, None]), na


def test_the_statistic_rejects_wrong_verifiers():
    """The same statistic, seed and sample size fail two broken verifiers: sampling p instead of
    the residual (wrong first token), and a bonus token drawn from p_{K-1} instead of p_K (right
    first token, wrong second: only the joint test sees it)."""
    chain = random_chain(0)
    first, joint = chain.check(*chain.run(1, verify=wrong_verify)[:2])
    assert first < ALPHA and joint < ALPHA

    def stale_bonus(draft_ids, draft_probs, target, num_draft, keys):
        shifted = torch.cat([target[:, :-1], target[:, -2:-1]], 1)  # p_K := p_{K-1}
        return verify_sampled(draft_ids, draft_probs, shifted, num_draft, keys)

    first, joint = chain.check(*chain.run(1, verify=stale_bonus)[:2])
    assert first > ALPHA and joint < ALPHA


def test_seeded_rows_are_repeatable_and_independent_of_the_batch():
    g = torch.Generator().manual_seed(8)
    K, B = 4, 3
    target = torch.softmax(torch.randn(B, K + 1, 30, generator=g), -1)
    draft = torch.softmax(torch.randn(B, K, 30, generator=g), -1)
    ids = torch.multinomial(draft.view(-1, 30), 1, generator=g).view(B, K)
    nd = torch.tensor([4, 2, 3])
    seen = set()
    for at in range(5):  # a row's draws depend on its seed and position alone
        batch = RowKeys([3 + at, 11, 5], [at, 40 + at, 2])
        alone = RowKeys([11], [40 + at])
        out_b, na_b = verify_sampled(ids, draft, target, nd, batch)
        out_a, na_a = verify_sampled(ids[1:2], draft[1:2], target[1:2], nd[1:2], alone)
        assert torch.equal(out_b[1:2], out_a) and torch.equal(na_b[1:2], na_a)
        assert torch.equal(verify_sampled(ids[1:2], draft[1:2], target[1:2], nd[1:2], alone)[0], out_a)
        seen.add(tuple(out_a[0].tolist()))
    assert len(seen) > 1  # other positions: other draws


def test_padding_positions_are_never_accepted():
    target = torch.softmax(torch.randn(4, 4, 10), -1)
    draft = target[:, :3].clone()  # p == q: every real draft token is accepted
    ids = torch.multinomial(draft.reshape(-1, 10), 1).view(4, 3)
    nd = torch.tensor([0, 1, 2, 3])
    out, na = verify_sampled(ids, draft, target, nd, RowKeys.independent(4))
    assert na.tolist() == [0, 1, 2, 3]
    for b in range(4):
        assert torch.equal(out[b, :b], ids[b, :b]) and out[b, b] >= 0
        assert (out[b, b + 1:] == -1).all()


# ---------------------------------------------------------------- greedy


def greedy_case():
    """Target argmax 2, 4, 1, 3 at positions 0..3 for every row (with a tie at position 0)."""
    logits = torch.full((6, 4, 5), -1.0)
    for pos, tok in enumerate([2, 4, 1, 3]):
        logits[:, pos, tok] = 2.0
    logits[:, 0, 3] = 2.0  # tie with token 2 at position 0: the lowest index wins
    draft = torch.tensor([[2, 4, 1], [0, 4, 1], [2, 0, 1], [2, 4, 1], [2, 4, 1], [2, 4, 1]])
    nd = torch.tensor([3, 3, 3, 2, 0, 1])
    out = torch.tensor([[2, 4, 1, 3], [2, -1, -1, -1], [2, 4, -1, -1], [2, 4, 1, -1],
                        [2, -1, -1, -1], [2, 4, -1, -1]])
    return draft, logits, nd, out, torch.tensor([3, 0, 1, 2, 0, 1])


def test_verify_greedy_hand_made_cases():
    draft, logits, nd, out, na = greedy_case()
    got_out, got_na = verify_greedy(draft, logits, nd)
    assert torch.equal(got_out, out) and torch.equal(got_na, na)
    no_draft = torch.zeros(6, dtype=torch.long)
    empty_out, empty_na = verify_greedy(draft[:, :0], logits[:, :1], no_draft)
    assert empty_out.tolist() == [[2]] * 6 and empty_na.tolist() == [0] * 6


def test_verify_sampled_on_greedy_rows_equals_verify_greedy():
    draft, logits, nd, out, na = greedy_case()
    probs = logits_to_probs(logits, SamplingTensors.from_params([SP(temperature=0.0)] * 6))
    one_hot = torch.nn.functional.one_hot(draft, 5).float()
    for q in (None, one_hot, torch.softmax(torch.randn(6, 3, 5), -1)):
        got_out, got_na = verify_sampled(draft, q, probs, nd, RowKeys.independent(6))
        assert torch.equal(got_out, out) and torch.equal(got_na, na)

    g = torch.Generator().manual_seed(9)
    B, K, Vb = 256, 4, 50
    logits = torch.randn(B, K + 1, Vb, generator=g)  # (B, K+1, V)
    amax = logits.argmax(-1)
    lengths = torch.randint(0, K + 1, (B,), generator=g)  # how many leading drafts match
    ids = torch.where(torch.arange(K) < lengths[:, None], amax[:, :K],
                      (amax[:, :K] + torch.randint(1, Vb, (B, K), generator=g)) % Vb)
    nd = torch.randint(0, K + 1, (B,), generator=g)
    probs = logits_to_probs(logits, SamplingTensors.from_params([SP(temperature=0.0)] * B))
    q_random = torch.softmax(torch.randn(B, K, Vb, generator=g), -1)
    q_wrong = torch.nn.functional.one_hot(amax[:, :K], Vb).float()  # q(x) = 0 where x != argmax
    ref = verify_greedy(ids, logits, nd)
    for q in (None, q_random, q_wrong):
        got = verify_sampled(ids, q, probs, nd, RowKeys.independent(B))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
