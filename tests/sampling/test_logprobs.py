"""token_logprobs: the chosen token's raw log-probability and the top alternatives."""
from __future__ import annotations

import torch

from specdec.sampling.logprobs import token_logprobs


def test_logprobs_are_log_softmax_and_top_is_sorted():
    torch.manual_seed(0)
    logits = torch.randn(5, 30) * 4
    ids = torch.tensor([0, 3, 29, 7, 7])
    out = token_logprobs(logits, ids, 4)
    ref = torch.log_softmax(logits, -1)
    for t, lp in enumerate(out):
        assert lp.token_id == int(ids[t]) and abs(lp.logprob - float(ref[t, ids[t]])) < 1e-6
        assert [i for i, _ in lp.top] == ref[t].topk(4).indices.tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_no_alternatives_and_blocks_give_the_same_values():
    torch.manual_seed(1)
    logits = torch.randn(7, 50).bfloat16()
    ids = torch.randint(0, 50, (7,))
    assert all(lp.top == [] for lp in token_logprobs(logits, ids, 0))
    assert token_logprobs(logits, ids, 3, block=2) == token_logprobs(logits, ids, 3)
