"""Grammar-forced drafts: merged in front of the inner drafter's chain or tree, and the inner hears
only about its own tokens."""
from __future__ import annotations

import torch

from specdec.proposers.base import Draft
from specdec.proposers.grammar import _inner_path, merge


def test_forced_tokens_lead_an_inner_chain_with_one_hot_q():
    q = torch.softmax(torch.randn(2, 2, 10), -1)
    inner = Draft(tokens=torch.tensor([[5, 6], [7, 8]]), num_tokens=torch.tensor([2, 1]), probs=q)
    d = merge([[1, 2], []], inner, behind=True)
    assert d.tokens.tolist() == [[1, 2, 5, 6], [7, 0, 0, 0]] and d.num_tokens.tolist() == [4, 1]
    assert d.probs[0, 0, 1] == 1 and d.probs[0, 1, 2] == 1 and torch.equal(d.probs[0, 2:], q[0])
    assert torch.equal(d.probs[1, :1], q[1, :1])


def test_an_inner_trees_roots_hang_from_the_last_forced_token():
    inner = Draft(tokens=torch.tensor([[5, 6, 7]]), num_tokens=torch.tensor([3]), parents=torch.tensor([[-1, -1, 0]]))
    d = merge([[1, 2]], inner, behind=True)
    assert d.tokens.tolist() == [[1, 2, 5, 6, 7]] and d.parents.tolist() == [[-1, 0, 1, 1, 2]]
    assert _inner_path([0, 1, 2, 4], 2) == [0, 2] and _inner_path([0, 1], -1) == []


def test_without_drafting_behind_a_forced_row_drafts_its_forced_tokens_alone():
    inner = Draft(tokens=torch.tensor([[5, 6], [7, 8]]), num_tokens=torch.tensor([2, 2]))
    d = merge([[1], []], inner)
    assert d.tokens[0, :1].tolist() == [1] and d.num_tokens.tolist() == [1, 2] and d.tokens[1].tolist() == [7, 8]
