"""Log-probabilities of chosen tokens and their top alternatives, from logits already computed.

What they are of: the *raw* model distribution, log_softmax of the target's logits at that position,
before penalties, logit bias, temperature and the top-k / top-p / min-p filters (vLLM's default,
``logprobs_mode="raw_logprobs"``). They therefore describe the model, not the sampler, and are the
same whatever sampling parameters drew the token. Under speculation they come from the verification
forward (the target scores every emitted token there anyway), and the target's logits at a position
are bit-identical whether it runs alone or in a verified block (quant/linear.py), so they equal
those of plain decoding exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the chosen token's log-probability and the ``n`` most likely tokens there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


def token_logprobs(logits: Tensor, token_ids: Tensor, n: int, block: int = 64) -> list[TokenLogprob]:
    """logits (T, V) at T positions, token_ids (T,) chosen there -> one TokenLogprob per position.

    Runs ``block`` positions at a time (a long prompt's logprobs need no (T, V) float32 copy).
    Ties in the top list keep ``torch.topk``'s order (deterministic for the same logits).
    """
    out: list[TokenLogprob] = []
    for lo in range(0, logits.shape[0], block):
        lp = torch.log_softmax(logits[lo:lo + block].float(), dim=-1)  # (t, V)
        ids = token_ids[lo:lo + block]
        chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()  # (t,)
        if n > 0:
            vals, idx = torch.topk(lp, n, dim=-1)  # (t, n)
            tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops = [[] for _ in chosen]
        out += [TokenLogprob(int(t), c, top) for t, c, top in zip(ids.tolist(), chosen, tops)]
    return out
