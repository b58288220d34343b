"""Tree verification (specdec.sampling.rejection.verify_tree_*): greedy paths on tiny arrays, the
chain as a special case, and the sampled rule's law checked by chi-square on a Markov target (as in
test_rejection.py), with a verifier that forgets the residual update shown to fail the same test."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.tree import chain_parents
from specdec.sampling import rejection
from specdec.sampling.rejection import verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled
from specdec.sampling.rng import RowKeys
from stats_util import chi2_pvalue

ALPHA = 1e-4
N = 200_000
V = 8
TREE = [-1, -1, 0, 0, 1, 1]  # two root children, two children each


def one_hot_logits(ids: list[int], v: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()[None] * 5.0  # (1, T, v)


def test_greedy_takes_the_deepest_matching_path():
    # node tokens; the target's argmax after: pending -> 3, node0 -> 9, node1 -> 4, node3 -> 6
    ids = torch.tensor([[2, 3, 9, 4, 4, 6]])
    parents = torch.tensor([[-1, -1, 0, 1, 1, 3]])
    logits = one_hot_logits([3, 9, 4, 0, 6, 0, 7])  # position 1 + i: after node i
    out, n, path = verify_tree_greedy(ids, parents, logits, torch.tensor([6]))
    assert n.tolist() == [3] and path.tolist() == [[1, 3, 5, -1, -1, -1]]
    assert out.tolist() == [[3, 4, 6, 7, -1, -1, -1]]  # node 1, node 3, node 5, then the argmax after 5
    # the same tree with node 5 cut off by num_draft: node 3's path, and node 4 (also 4) loses the tie
    out, n, path = verify_tree_greedy(ids, parents, logits, torch.tensor([5]))
    assert n.tolist() == [2] and path[0, :2].tolist() == [1, 3] and out[0, :3].tolist() == [3, 4, 6]
    # nothing matches: the target's own token
    out, n, path = verify_tree_greedy(torch.tensor([[5, 5]]), torch.tensor([[-1, 0]]), one_hot_logits([3, 1, 1]),
                                      torch.tensor([2]))
    assert n.tolist() == [0] and out.tolist() == [[3, -1, -1]] and (path == -1).all()


def test_a_chain_is_the_special_case():
    g = torch.Generator().manual_seed(0)
    B, K = 64, 5
    logits = torch.randn(B, K + 1, V, generator=g)
    ids = torch.where(torch.rand(B, K, generator=g) < 0.7, logits[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    nd = torch.randint(0, K + 1, (B,), generator=g)
    out_c, n_c = verify_greedy(ids, logits, nd)
    out_t, n_t, path = verify_tree_greedy(ids, chain_parents(B, K), logits, nd)
    assert torch.equal(n_c, n_t) and torch.equal(out_c, out_t)
    assert all(path[b, :n].tolist() == list(range(n)) for b, n in enumerate(n_t.tolist()))
    # sampled: the same decisions from the same random streams (but for rounding at a boundary)
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    out_c, n_c = verify_sampled(ids, q, p, nd, RowKeys(range(B), [5] * B))
    out_t, n_t, _ = verify_tree_sampled(ids, chain_parents(B, K), q, p, nd, RowKeys(range(B), [5] * B))
    assert (out_c == out_t).all(-1).float().mean() > 0.97 and torch.equal(n_c, n_t)


def dirichlet(rows: int, g: torch.Generator, floor: float = 0.3) -> torch.Tensor:
    d = -torch.rand(rows, V, generator=g, dtype=torch.float64).log()
    return ((1 - floor) * d / d.sum(-1, keepdim=True) + floor / V).float()


@pytest.fixture(scope="module")
def markov():
    g = torch.Generator().manual_seed(11)
    return dirichlet(1, g)[0], dirichlet(V, g), dirichlet(1, g)[0], dirichlet(V, g)  # P0, T, Q0, Q


def draw(q: torch.Tensor, g: torch.Generator, without: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from q (N, V), optionally without the token ``without`` (N,): (ids, the q used)."""
    if without is not None:
        q = q.scatter(1, without[:, None], 0.0)
        q = q / q.sum(-1, keepdim=True)
    return torch.multinomial(q, 1, generator=g)[:, 0], q


def make_tree(kind: str, markov, g: torch.Generator):
    """(ids (N, 6), draft_probs (N, 6, V) or None, target_probs (N, 7, V)) for TREE."""
    P0, T, Q0, Q = markov
    ids, qs = [], []
    for i, parent in enumerate(TREE):
        base = Q0.expand(N, V) if parent < 0 else Q[ids[parent]]  # (N, V)
        if kind == "deterministic":  # the two most probable draft tokens, no sampling
            top = base.topk(2, -1).indices
            ids.append(top[:, i % 2])
            continue
        second = i % 2 == 1  # the second child of its parent: drawn after its sibling i - 1
        x, q = draw(base, g, ids[i - 1] if kind == "without_replacement" and second else None)
        ids.append(x)
        qs.append(q)
    ids_t = torch.stack(ids, 1)  # (N, 6)
    target = torch.stack([P0.expand(N, V)] + [T[ids_t[:, i]] for i in range(len(TREE))], 1)  # (N, 7, V)
    return ids_t, (torch.stack(qs, 1) if qs else None), target


def emitted_law_pvalues(kind: str, markov, seed: int) -> tuple[float, float]:
    P0, T = markov[0], markov[1]
    g = torch.Generator().manual_seed(seed)
    ids, q, target = make_tree(kind, markov, g)
    parents = torch.tensor(TREE).expand(N, -1)
    out, n, _ = verify_tree_sampled(ids, parents, q, target, torch.full((N,), len(TREE)),
                                    RowKeys.independent(N, seed))
    first = torch.bincount(out[:, 0], minlength=V)
    two = n >= 1  # a second token was emitted: after an accepted first, it follows T[first]
    pairs = torch.zeros(V, V)
    pairs.index_put_((out[two, 0], out[two, 1]), torch.ones(int(two.sum())), accumulate=True)
    expected = pairs.sum(1, keepdim=True) * T  # (V, V) conditional on each first token's count
    return chi2_pvalue(first, P0), chi2_pvalue(pairs, expected)


@pytest.mark.parametrize("kind", ["iid", "without_replacement", "deterministic"])
def test_sampled_tree_verification_follows_the_target(markov, kind):
    p_first, p_pair = emitted_law_pvalues(kind, markov, seed=3)
    assert p_first > ALPHA and p_pair > ALPHA


@pytest.mark.slow  # the statistic's power, checked in the slow stage (15 s each)
@pytest.mark.parametrize("kind", ["iid", "deterministic"])
def test_forgetting_the_residual_update_is_caught(markov, kind, monkeypatch):
    """After a rejected sibling p must become norm(max(0, p - q)); keeping p is biased toward the
    rejected tokens, and the same test sees it."""
    monkeypatch.setattr(rejection, "_residual", lambda p, q: p.clone())
    p_first, _ = emitted_law_pvalues(kind, markov, seed=3)
    assert p_first < ALPHA


def test_a_deterministic_tree_keeps_the_most_any_lossless_verifier_can():
    """A lossless verifier accepts node n only when the target's own sample begins with n's path, so
    E[accepted] <= sum over nodes of P_target(path): on a deterministic (top-k) tree the rule here
    reaches that bound (why Traversal Verification, which helps sampled trees, adds nothing to ours).
    A verifier that stopped at the first rejected sibling would keep only the first child's share."""
    g = torch.Generator().manual_seed(5)
    law = dirichlet(1, g)[0], dirichlet(V, g), dirichlet(1, g)[0], dirichlet(V, g)
    P0, T = law[0], law[1]
    ids, _, target = make_tree("deterministic", law, g)
    parents = torch.tensor(TREE).expand(N, -1)
    _, n, _ = verify_tree_sampled(ids, parents, None, target, torch.full((N,), len(TREE)),
                                  RowKeys.independent(N, 7))
    row = ids[0].tolist()
    bound = sum(float(P0[row[i]]) if par < 0 else float(P0[row[par]] * T[row[par], row[i]])
                for i, par in enumerate(TREE))
    se = float(n.float().std()) / N ** 0.5
    assert abs(float(n.float().mean()) - bound) < 5 * se, (float(n.float().mean()), bound)
    first_only = sum(float(P0[row[i]]) if par < 0 else float(P0[row[par]] * T[row[par], row[i]])
                     for i, par in enumerate(TREE) if i in (0, 2))  # the first child's line alone
    assert bound - first_only > 10 * se
