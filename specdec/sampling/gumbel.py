"""Drafter-invariant verification: Gumbel-max sampling with keyed noise, verified by equality.

Daliri, Musco and Suresh (2024), "Coupling without communication and drafter-invariant speculative
decoding". At every output position the target's token is the Gumbel-max sample

    t = argmax_v (log p(v) + g(v)),   g = the position's Gumbel noise (``RowKeys``, purpose NOISE),

an exact sample of p (the processed distribution: penalties, temperature, top-k / top-p / min-p),
with the noise a pure function of (seed, position) indexed by target token id. A drafter that
proposes ``argmax(log q + g)`` with the same noise agrees with the target with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)) (their Theorem), close to rejection sampling's 1 - TV; verification is
plain equality: accept the longest draft prefix equal to the target's own Gumbel-max tokens, then
emit the target's token at the first mismatch (or the bonus). What is emitted never depends on the
draft: it is the token plain decoding draws with the same seed (plain decoding samples by the same
Gumbel-max, ``verify_sampled`` with an empty draft). So with ``verify: "gumbel"`` a seeded sampled
request is token-identical with speculation on or off, for any method, K, tree or batch; the draft
only decides how many target forwards it takes. Any draft is lossless here, deterministic or not.

Trees: the walk starts at the pending token; at each node the target's Gumbel-max token of the
node's position (the position after it) is compared with the node's children, the first equal child
(node order) is accepted, and the walk stops at a node none of whose children equals it. Drafters
make each node's first child its parent's Gumbel-argmax at that position (``proposers.tree``).

Noise is drawn lazily, only for positions the walk reaches: a draft rejected early pays for few
noise vectors (one per (row, position): a V-wide draw, the cost of this mode on a large vocabulary).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.sampling.rejection import _check, _tree_outputs
from specdec.sampling.rng import RowKeys


def verify_gumbel(draft_ids: Tensor, target_probs: Tensor, num_draft: Tensor,
                  keys: RowKeys) -> tuple[Tensor, Tensor]:
    """Accept the longest draft prefix equal to the target's Gumbel-max tokens, then emit the
    target's Gumbel-max token: draft_ids (B, K), target_probs (B, K+1, V) (one-hot on greedy rows:
    their argmax), num_draft (B,), keys (``shared_noise``) -> (out_ids (B, K+1), num_accepted (B,))."""
    B, K = _check(draft_ids, target_probs, num_draft)
    dev = draft_ids.device
    out = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.arange(B, device=dev)  # rows whose every earlier draft token was accepted
    for j in range(K + 1):
        t = keys.gumbel_argmax(target_probs[alive, j], j, rows=alive)  # (n,) the target's token there
        out[alive, j] = t
        ok = (j < num_draft[alive]) & (draft_ids[alive, min(j, K - 1)] == t) if j < K else torch.zeros_like(t, dtype=torch.bool)
        alive = alive[ok]
        num_accepted[alive] += 1
        if not len(alive):
            break
    return out, num_accepted


def verify_tree_gumbel(draft_ids: Tensor, parents: Tensor, target_probs: Tensor, num_draft: Tensor,
                       keys: RowKeys) -> tuple[Tensor, Tensor, Tensor]:
    """Walk the tree accepting the child equal to the target's Gumbel-max token at each depth:
    draft_ids (B, K), parents (B, K) (normalised), target_probs (B, K+1, V) (position 0: the pending
    token, 1 + i: node i), num_draft (B,), keys -> (out_ids (B, K+1), num_accepted (B,), path (B, K))."""
    B, K = _check(draft_ids, target_probs, num_draft)
    dev = draft_ids.device
    valid = torch.arange(K, device=dev)[None, :] < num_draft[:, None]  # (B, K)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # current node (-1: the pending token)
    next_ids = torch.zeros(B, dtype=torch.long, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.arange(B, device=dev)
    while len(alive):
        c = cur[alive]
        t = keys.gumbel_argmax(target_probs[alive, c + 1], num_accepted[alive], rows=alive)  # (n,)
        next_ids[alive] = t
        match = valid[alive] & (parents[alive] == c[:, None]) & (draft_ids[alive] == t[:, None])  # (n, K)
        found = match.any(-1)
        child = match.long().argmax(-1) if K else c  # the first equal child in node order
        alive = alive[found]
        cur[alive] = child[found]
        num_accepted[alive] += 1
    return _tree_outputs(draft_ids, parents, torch.where(num_accepted > 0, cur, -1), num_accepted, next_ids)
