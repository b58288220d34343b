"""Token-tree buffers, built by pure functions (as Medusa builds its tree buffers).

A tree draft of K nodes for each row is ``tokens (B, K)`` plus ``parents (B, K)``: node i's parent
index (``-1``: a child of the pending token, the tree's root). Parents precede their children
(``parents[b, i] < i``), so a node's ancestors are always computed before it. A chain is the tree
``parents[b, i] = i - 1``. Verification feeds the block ``[pending, node 0, ..., node K-1]``:

* slots: consecutive, ``start .. start + K`` (``start`` = the pending token's position);
* RoPE positions: ``start + depth`` (the pending token has depth 0, root children depth 1), so each
  node is scored at the position it would have in its own branch (SpecInfer, Miao et al. 2024;
  EAGLE-2, Li et al. 2024);
* attention: each node sees the prefix, the pending token, its ancestors and itself (``ancestor_mask``).

After verification the accepted path's keys and values move to the slots a chain would have used
(``compaction``), so the cache is exactly what decoding that path token by token leaves.
"""
from __future__ import annotations

import torch
from torch import Tensor


def chain_parents(rows: int, k: int, device: torch.device | str = "cpu") -> Tensor:
    """(rows, k) long: the chain ``i - 1`` (node 0 is a child of the root)."""
    return (torch.arange(k, device=device) - 1).expand(rows, k).clone()


def normalize_parents(parents: Tensor, num_nodes: Tensor) -> Tensor:
    """``parents (B, K)`` with padding nodes (index >= num_nodes[b]) made root children, checked:
    a real node's parent is -1 or an earlier real node. Raises ValueError otherwise."""
    B, K = parents.shape
    idx = torch.arange(K, device=parents.device)
    real = idx[None, :] < num_nodes.to(parents.device)[:, None]  # (B, K)
    out = torch.where(real, parents, -1)
    bad = real & ((out < -1) | (out >= idx[None, :]))
    if bool(bad.any()):
        b, i = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"tree draft row {b}: node {i} has parent {int(parents[b, i])}; a parent must be -1 "
                         "(the root) or an earlier node")
    return out


def ancestors(parents: Tensor) -> Tensor:
    """``parents (B, K)`` -> ``(B, K, K)`` bool: [b, i, j] = node j is node i or one of its ancestors."""
    B, K = parents.shape
    eye = torch.eye(K, dtype=torch.bool, device=parents.device)
    anc = torch.zeros(B, K, K, dtype=torch.bool, device=parents.device)
    rows = torch.arange(B, device=parents.device)
    for i in range(K):
        p = parents[:, i]  # (B,)
        above = anc[rows, p.clamp(min=0)] & (p >= 0)[:, None]  # (B, K): the parent's line, none at the root
        anc[:, i] = above | eye[i]
    return anc


def ancestor_mask(parents: Tensor) -> Tensor:
    """``(B, 1+K, 1+K)`` bool attention mask of a verification block ``[pending, nodes]``: every
    node sees the pending token, its ancestors and itself; the pending token sees itself."""
    B, K = parents.shape
    m = torch.zeros(B, 1 + K, 1 + K, dtype=torch.bool, device=parents.device)
    m[:, :, 0] = True
    m[:, 1:, 1:] = ancestors(parents)
    return m


def depths(parents: Tensor) -> Tensor:
    """``(B, K)`` long: each node's depth (root children: 1)."""
    return ancestors(parents).sum(-1)


def compaction(paths: list[list[int]], starts: list[int]) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Slot moves that put each row's accepted path where a chain would sit.

    ``paths[b]``: node indices of row b's accepted path; ``starts[b]``: its pending token's slot
    (node i sits at slot start + 1 + i). Returns (batch indices, src slots, dst slots) for the rows
    that need a move, each row's lists padded to one length with no-op moves of the pending slot.
    """
    moves = [(b, [s + 1 + n for n in p], [s + 1 + j for j in range(len(p))])
             for b, (p, s) in enumerate(zip(paths, starts)) if any(n != j for j, n in enumerate(p))]
    if not moves:
        return [], [], []
    width = max(len(src) for _, src, _ in moves)
    bs = [b for b, _, _ in moves]
    src = [s + [starts[b]] * (width - len(s)) for b, s, _ in moves]
    dst = [d + [starts[b]] * (width - len(d)) for b, _, d in moves]
    return bs, src, dst


def branch_tokens(draft_ids: Tensor, anc: Tensor) -> Tensor:
    """``(B, 1+K, K)`` long: the draft tokens before each position of a verification block, in its
    own branch (position 0, the pending token: none; position 1+i: node i's ancestors and node i),
    -1 elsewhere: what penalties count at that position, as plain decoding of the branch would.
    ``anc (B, K, K)`` from ``ancestors``."""
    B, K = draft_ids.shape
    mine = torch.where(anc, draft_ids[:, None, :], -1)  # (B, K, K)
    return torch.cat([torch.full((B, 1, K), -1, dtype=torch.long, device=draft_ids.device), mine], 1)


def path_order(paths: Tensor) -> Tensor:
    """``paths (B, K)`` (accepted nodes, -1 after) -> ``(B, 1+K)`` block positions in chain order:
    the pending token, then the path's nodes (positions past the path: 0)."""
    B = paths.shape[0]
    nodes = torch.where(paths >= 0, paths + 1, 0)
    return torch.cat([torch.zeros(B, 1, dtype=torch.long, device=paths.device), nodes], 1)
