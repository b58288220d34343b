"""Dynamic draft trees from a model drafter (Li et al. 2024, "EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees").

From the drafter's distribution after the pending token, the ``topk`` most probable tokens are the
first frontier. At each further depth the frontier (``topk`` nodes) is fed to the drafter in one
forward (ancestors-only mask, depth-based positions, consecutive slots after the pending token);
each frontier node's ``topk`` most probable children become candidates, scored by cumulative
draft log-probability, and the ``topk`` best of them are the next frontier. Finally every
candidate is reranked by that score and the best ``budget`` nodes are the draft: the score only
falls along a branch, so the kept set is a tree. Children are chosen deterministically (top-k), so
the verifier treats them as one-hot proposals: lossless at any temperature.

Under Gumbel verification (``sampling.gumbel``) a sampled row's children are ranked by the
Gumbel-perturbed log-probability of its processed distribution (temperature, filters) with the
target's noise at the children's position, less the best such value among all tokens: a node's
Gumbel-argmax child scores what its parent scores, every other child less (a Gumbel top-k: a sample
without replacement). So the drafter's own Gumbel-max chain (what a chain drafter would propose)
ranks first and is always kept, and the other branches cover the positions where the target's
Gumbel-max token differs from it; the score still only falls along a branch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.proposers.base import Draft, empty_draft
from specdec.proposers.options import TreeBudgetOptions, option
from specdec.sampling.grammar import DraftMasks
from specdec.sampling.penalties import Penalties
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import NOISE, RowKeys

if TYPE_CHECKING:
    from specdec.runtime.sequence import Sequence

# forward(tokens (B, W), depth (B, W), fed (int: nodes fed before), mask (B, W, 1 + fed + W)) -> logits (B, W, V)
TreeForward = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TreeOptions(TreeBudgetOptions):
    """The options of a drafter that can draft a tree (K is then its node budget)."""

    tree_topk: int = option(0, lo=0, hi=16, help="draft a dynamic tree (EAGLE-2): children per expanded node and "
                                                 "nodes expanded per depth; K is then the tree's node budget; "
                                                 "0: a chain")
    tree_depth: int = option(4, lo=1, hi=16, help="depth of a dynamic tree (drafter forwards per step)")

    @property
    def drafts_trees(self) -> bool:
        return self.tree_topk > 0


@dataclass
class DraftTree:
    """A drafted tree and where the drafter's cache holds its nodes."""

    draft: Draft
    fed: list[list[int]]  # per row, per draft node: its index in feeding order (-1: never fed)


def dynamic_tree(first: torch.Tensor, budget: list[int], topk: int, depth: int, forward: TreeForward,
                 seqs: "list[Sequence] | None" = None, gumbel: bool = False) -> DraftTree:
    """The EAGLE-2 tree of at most ``budget[b]`` nodes per row from the drafter's ``first (B, V)``
    logits after the pending token; ``forward`` feeds frontier nodes (node f of the feeding order
    goes to the drafter's slot pending + 1 + f). With ``seqs``, each node's children are ranked after
    its request's penalties and logit bias, counting the tokens on the node's path (as a chain draft
    counts its own): the target verifies the processed distribution, so that is what it keeps.
    ``gumbel`` (with ``seqs``): sampled rows rank children by Gumbel-perturbed scores (module docstring)."""
    B, dev = first.shape[0], first.device
    n_max = max(budget, default=0)
    if n_max == 0:
        return DraftTree(empty_draft(B, dev), [[] for _ in range(B)])
    pen = Penalties.from_seqs(seqs, dev) if seqs is not None else None
    masks = DraftMasks.from_seqs(seqs) if seqs is not None else None
    if pen is not None:
        first = pen.apply(first)
    if masks is not None:  # a constrained row's children: legal after its kept tokens and the node's path
        first = masks.apply(first)
    rows = torch.arange(B, device=dev)
    noise = _GumbelScores(seqs, dev) if gumbel and seqs is not None and not all(s.params.greedy for s in seqs) else None
    score, tok = _scores(first[:, None], noise, 0)[:, 0].topk(topk, -1)  # (B, k)
    toks, scores = [tok], [score]
    parents = [torch.full((B, topk), -1, dtype=torch.long, device=dev)]  # candidate index of the parent
    frontier = torch.arange(topk, device=dev).expand(B, topk)  # (B, k) candidate indices
    fed_of = torch.full((B, topk), -1, dtype=torch.long, device=dev)  # candidate -> feeding index
    anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # ancestors among fed nodes
    for d in range(1, min(depth, n_max)):
        all_tok, all_score = torch.cat(toks, 1), torch.cat(scores, 1)  # (B, C)
        all_par = torch.cat(parents, 1)
        F = anc.shape[1]
        # the frontier's ancestors: its parent's line among the fed nodes, and itself
        line = torch.zeros(B, topk, F, dtype=torch.bool, device=dev)  # (B, k, F)
        if F:
            par_c = all_par.gather(1, frontier)  # (B, k)
            par_fed = torch.where(par_c >= 0, fed_of.gather(1, par_c.clamp(min=0)), -1)
            line = torch.where((par_fed >= 0)[..., None], anc[rows[:, None], par_fed.clamp(min=0)], line)
        new = torch.cat([line, torch.eye(topk, dtype=torch.bool, device=dev).expand(B, topk, topk)], 2)
        anc = torch.cat([torch.cat([anc, torch.zeros(B, F, topk, dtype=torch.bool, device=dev)], 2), new], 1)
        fed_of = torch.cat([fed_of, torch.full((B, all_tok.shape[1] - fed_of.shape[1]), -1, dtype=torch.long,
                                               device=dev)], 1)
        fed_of[rows[:, None], frontier] = F + torch.arange(topk, device=dev)
        mask = torch.cat([torch.ones(B, topk, 1, dtype=torch.bool, device=dev), new], 2)  # (B, k, 1+F+k)
        logits = forward(all_tok.gather(1, frontier), torch.full((B, topk), d, device=dev), F, mask)  # (B, k, V)
        if pen is not None or masks is not None:
            logits = torch.stack([_process(logits[:, w], _path(all_tok, all_par, frontier[:, w], d), pen, masks)
                                  for w in range(topk)], 1)
        s, t = _scores(logits, noise, d).topk(topk, -1)  # (B, k, k)
        s = s + all_score.gather(1, frontier)[..., None]  # cumulative
        toks.append(t.reshape(B, -1))
        scores.append(s.reshape(B, -1))
        parents.append(frontier[..., None].expand(B, topk, topk).reshape(B, -1))
        C = all_tok.shape[1]
        frontier = C + s.reshape(B, -1).topk(topk, -1).indices  # (B, k)
    all_tok, all_score, all_par = torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1)
    fed_of = torch.cat([fed_of, torch.full((B, all_tok.shape[1] - fed_of.shape[1]), -1, dtype=torch.long,
                                           device=dev)], 1)
    # rerank: the best n candidates (ties: the earlier one, so a parent precedes its child)
    order = torch.sort(all_score, dim=1, descending=True, stable=True).indices  # (B, C)
    finite = all_score.isfinite().sum(1).tolist()  # -inf: a token the grammar forbids, never kept
    order = [o[:n] for o, n in zip(order.tolist(), finite)]
    return _select(all_tok.tolist(), all_par.tolist(), fed_of.tolist(), order, budget, dev)


class _GumbelScores:
    """Children scores of a Gumbel-verified tree: log q + g - max(log q + g) on sampled rows."""

    def __init__(self, seqs: "list[Sequence]", dev: torch.device) -> None:
        self.st = SamplingTensors.from_params([s.params for s in seqs], dev)
        self.keys = RowKeys.from_seqs(seqs, dev, shared_noise=True)
        self.rows = torch.tensor([not s.params.greedy for s in seqs], device=dev).nonzero()[:, 0]

    def __call__(self, logits: torch.Tensor, lp: torch.Tensor, d: int) -> torch.Tensor:
        """``logits``, ``lp`` (B, W, V): W nodes of each row, their children at the row's position + d."""
        B, W, V = logits.shape
        r = self.rows
        q = logits_to_probs(logits, self.st)[r]  # (n, W, V) the processed distribution
        e = self.keys.exponentials(torch.full((len(r),), d, dtype=torch.long, device=r.device), V, NOISE, r)
        pert = q.log() - e.log()[:, None, :]  # (n, W, V) log q + g
        pert = pert - pert.amax(-1, keepdim=True)
        out = lp.clone()
        out[r] = pert.masked_fill(pert.isnan(), float("-inf"))
        return out


def _scores(logits: torch.Tensor, noise: "_GumbelScores | None", d: int) -> torch.Tensor:
    """(B, W, V) children scores: log-probabilities, Gumbel-perturbed on sampled rows of a Gumbel tree."""
    lp = _log_probs(logits)
    return lp if noise is None else noise(logits, lp, d)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax; a row with no legal token (a grammar's only tokens outside a drafter's vocabulary)
    is all -inf, not NaN."""
    lp = torch.log_softmax(logits.float(), -1)
    return lp.masked_fill(lp.isnan(), float("-inf"))


def _process(logits: torch.Tensor, path: torch.Tensor, pen: "Penalties | None",
             masks: "DraftMasks | None") -> torch.Tensor:
    """A frontier node's children logits ``(B, V)`` after its path ``(B, d)``: penalties and bias, then
    the grammar."""
    if pen is not None:
        logits = pen.apply(logits, path)
    return logits if masks is None else masks.apply_after(logits, path)


def _path(tok: torch.Tensor, par: torch.Tensor, node: torch.Tensor, d: int) -> torch.Tensor:
    """``(B, d)``: the tokens from the root's child down to candidate ``node (B,)`` at depth ``d``."""
    out = []
    for _ in range(d):
        out.append(tok.gather(1, node[:, None]))
        node = par.gather(1, node[:, None].clamp(min=0))[:, 0]
    return torch.cat(out[::-1], 1)


def _select(tok: list, par: list, fed: list, order: list, budget: list[int], dev) -> DraftTree:
    """Each row's best ``budget[b]`` candidates as a tree in creation order (parents first)."""
    B, n_max = len(tok), max(budget)
    tokens = torch.zeros(B, n_max, dtype=torch.long)
    parents = torch.full((B, n_max), -1, dtype=torch.long)
    fed_rows, counts = [], []
    for b in range(B):
        where: dict[int, int] = {}
        for c in sorted(order[b][:budget[b]]):  # creation order: a parent before its children
            if par[b][c] < 0 or par[b][c] in where:  # (a tie could orphan one)
                where[c] = len(where)
        kept = list(where)
        for i, c in enumerate(kept):
            tokens[b, i] = tok[b][c]
            parents[b, i] = where[par[b][c]] if par[b][c] >= 0 else -1
        fed_rows.append([fed[b][c] for c in kept])
        counts.append(len(kept))
    draft = Draft(tokens=tokens.to(dev), num_tokens=torch.tensor(counts, device=dev), probs=None,
                  parents=parents.to(dev))
    return DraftTree(draft, fed_rows)


def fed_prefix(path: list[int], fed: list[int]) -> list[int]:
    """The feeding indices of the leading path nodes the drafter was fed (its cache holds them)."""
    out = []
    for n in path:
        if fed[n] < 0:
            break
        out.append(fed[n])
    return out
