"""EAGLE-2 dynamic trees (specdec.proposers.tree) on a fake drafter whose next-token law depends on
the last token only: the tree, its feeding order and the masks it feeds are checked by hand."""
from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.proposers.tree import dynamic_tree, fed_prefix
from specdec.runtime.sequence import Sequence

V = 6
P = torch.zeros(V, V)
P[0, 1:4] = torch.tensor([0.5, 0.3, 0.2])  # after the pending token (0)
P[1, 3:5] = torch.tensor([0.1, 0.9])
P[2, 4:6] = torch.tensor([0.6, 0.4])
P[4, 0:2] = torch.tensor([0.7, 0.3])
P[3, 0] = P[5, 0] = 1.0


def test_dynamic_tree_expands_the_best_frontier_and_keeps_the_best_nodes():
    calls = []

    def forward(tokens, depth, fed, mask):
        calls.append((tokens.tolist(), depth.tolist(), fed, mask.tolist()))
        return P[tokens].log()  # (B, W, V)

    first = P[0].log()[None].expand(2, V)
    tree = dynamic_tree(first, [5, 2], topk=2, depth=3, forward=forward)
    d = tree.draft
    # candidates by branch probability: 1 (.5), 4 after 1 (.45), 0 after 1-4 (.315), 2 (.3), 4 after 2 (.18)
    assert d.num_tokens.tolist() == [5, 2]
    assert d.tokens[0].tolist() == [1, 2, 4, 4, 0] and d.parents[0].tolist() == [-1, -1, 0, 1, 2]
    assert d.tokens[1, :2].tolist() == [1, 4] and d.parents[1, :2].tolist() == [-1, 0]
    assert tree.fed[0] == [0, 1, 2, 3, -1] and tree.fed[1] == [0, 2]
    # depth 1 feeds the root's children, depth 2 the best two grandchildren, each seeing its own line
    assert [c[0][0] for c in calls] == [[1, 2], [4, 4]] and [c[2] for c in calls] == [0, 2]
    assert calls[1][1][0] == [2, 2]
    assert calls[1][3][0] == [[True, True, False, True, False], [True, False, True, False, True]]
    assert d.probs is None  # top-k children: one-hot proposals


def test_budget_one_is_a_single_token_and_fed_prefix_stops_at_an_unfed_node():
    tree = dynamic_tree(P[0].log()[None], [1], topk=2, depth=3, forward=lambda *a: 1 / 0)
    assert tree.draft.tokens.tolist() == [[1]] and tree.draft.parents.tolist() == [[-1]]
    assert fed_prefix([0, 2, 4], [0, 1, 2, 3, -1]) == [0, 2]
    assert fed_prefix([1, 3], [5, -1, 2, 3]) == []


def request(params: SamplingParams) -> Sequence:
    """A request with one prompt token (the pending 0) and no output yet."""
    return Sequence(request_id="r", prompt=None, prompt_ids=[0], params=params, detokenizer=None,
                    eos_ids=frozenset(), max_len=64, seed=0)


def forward(tokens, depth, fed, mask):
    """The fake drafter: P's row of each fed token, as logits (zeros at a tiny floor, not -inf)."""
    return P[tokens].clamp(min=1e-9).log()


def paths(draft, b: int = 0) -> set[tuple[int, ...]]:
    toks, par = draft.tokens[b].tolist(), draft.parents[b].tolist()
    out = set()
    for i in range(int(draft.num_tokens[b])):
        line, j = [], i
        while j >= 0:
            line.append(toks[j])
            j = par[j]
        out.add(tuple(line[::-1]))
    return out


def test_children_are_ranked_after_the_requests_penalties_counting_their_own_path():
    """A presence penalty of 2 on a request with no output yet: below 1 -> 4, token 1 is on the node's
    own path, so the target would penalise it there; ranked after the penalty it falls from .135 to
    .025 and the sixth node is 0 after 2 -> 4 (.126) instead."""
    seq = request(SamplingParams(presence_penalty=2.0))

    first = P[0].clamp(min=1e-9).log()[None]
    common = {(1,), (1, 4), (1, 4, 0), (2,), (2, 4)}
    plain = dynamic_tree(first, [6], topk=2, depth=3, forward=forward).draft
    tree = dynamic_tree(first, [6], topk=2, depth=3, forward=forward, seqs=[seq]).draft
    assert paths(plain) == common | {(1, 4, 1)}
    assert paths(tree) == common | {(2, 4, 0)}


class LegalAfter:
    """A fake grammar matcher: the legal tokens after a path (absent: every token)."""

    words = 1

    def __init__(self, legal: dict[tuple[int, ...], set[int]]) -> None:
        self.legal = legal

    def fill(self, out) -> None:
        self.mask_after([], out)

    def mask_after(self, path, out) -> None:
        allowed = self.legal.get(tuple(path))
        if allowed is not None:
            out.fill_(sum(1 << t for t in allowed))


def test_a_constrained_rows_nodes_are_legal_after_their_own_path():
    """Only 2 or 3 may follow the pending token and only 5 may follow 2: masked and renormalised, the
    tree is 2 (.6), 2 -> 5 (.6), 2 -> 5 -> 0 (.6), 3 (.4), 3 -> 0 (.4); unmasked it leads with 1."""
    seq = request(SamplingParams())
    seq.matcher = LegalAfter({(): {2, 3}, (2,): {5}})

    first = P[0].clamp(min=1e-9).log()[None]
    plain = dynamic_tree(first, [5], topk=2, depth=3, forward=forward).draft
    tree = dynamic_tree(first, [5], topk=2, depth=3, forward=forward, seqs=[seq]).draft
    assert (1,) in paths(plain)
    assert paths(tree) == {(2,), (2, 5), (2, 5, 0), (3,), (3, 0)}


def test_forbidden_candidates_are_never_kept_even_with_budget_to_spare():
    """One legal token after the pending token and one after it, top-2 children: the second child of
    each is -inf (forbidden), and the tree holds only the legal line however large the budget."""
    seq = request(SamplingParams())
    seq.matcher = LegalAfter({(): {2}, (2,): {4}, (2, 4): {1}})

    tree = dynamic_tree(P[0].clamp(min=1e-9).log()[None], [12], topk=2, depth=3, forward=forward, seqs=[seq]).draft
    assert paths(tree) == {(2,), (2, 4), (2, 4, 1)} and int(tree.num_tokens[0]) == 3
    # nothing legal after 2 (the grammar's only tokens outside the drafter's vocabulary): a leaf, no NaN
    seq.matcher = LegalAfter({(): {2}, (2,): set()})
    tree = dynamic_tree(P[0].clamp(min=1e-9).log()[None], [12], topk=2, depth=3, forward=forward, seqs=[seq]).draft
    assert paths(tree) == {(2,)}
