"""Medusa drafting (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): H residual heads on the target's last hidden state (``heads.medusa``) guess the
tokens 2..H+1 positions ahead at once, and a fixed candidate tree of their top choices is verified.

Per row the proposer keeps one vector: the target's final-norm hidden state ``h_t`` at the position
just before the pending token (from the prompt's prefill, then from each verification forward at the
last kept position: the block is in path order after a tree). The target's LM head on ``h_t`` gave
the pending token (t+1); head k gives the draft token at depth k (t+1+k).

The tree ("sparse tree" in the paper) is a set of paths of choices, ``(2, 0)`` meaning head 1's
third most probable token followed by head 2's most probable. It is built greedily from the heads'
measured top-i accuracies (``sparse_tree``): a node's expected contribution is the product of the
accuracies along its path, and the best node whose parent is in the tree is added until the node
budget is spent, so every prefix of the order is a tree. Children are deterministic (top-i), so the
verifier treats them as one-hot proposals (as for ``proposers.tree``): lossless at any temperature.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.quant.linear import Linear
from specdec.heads.medusa import MedusaHeads, load_heads
from specdec.models.native import tile_linears
from specdec.proposers.base import Draft, Proposer, draft_budget, empty_draft
from specdec.proposers.eagle import head_path
from specdec.proposers.options import TreeBudgetOptions, option
from specdec.runtime.sequence import Sequence
from specdec.sampling.grammar import DraftMasks, unpack
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import NOISE, RowKeys

Path_ = tuple[int, ...]  # a node: the choice (rank) at each depth


@dataclass(frozen=True)
class MedusaOptions(TreeBudgetOptions):
    method = "medusa"
    summary = "Medusa heads on the target's last hidden state draft a fixed tree of their top choices (K: its node budget)"

    model: str | None = option(None, flag="--speculative-model",
                               help="the heads: a Medusa head directory (config.json + model.safetensors); "
                                    "unset: the heads shipped for the target model")

    @property
    def drafts_trees(self) -> bool:
        return True  # always its fixed tree

    def build(self, store) -> "MedusaProposer":
        path = head_path(self.model, store.target.name, "medusa", "Medusa heads ship")
        heads = load_heads(path, dtype=store.dtype, device=store.device)
        c, t = heads.config, store.target.config
        if c.hidden_size != t.hidden_size or c.vocab_size != t.vocab_size:
            raise SpecdecError(f"Medusa heads '{path}' were made for another model (hidden {c.hidden_size}, "
                               f"vocabulary {c.vocab_size}; the target has {t.hidden_size}, {t.vocab_size})")
        tile_linears(heads)  # drafting only: its products on the native kernels
        return MedusaProposer(heads, *draft_lm_head(heads, store))


def draft_lm_head(heads: MedusaHeads, store) -> tuple[nn.Module, torch.Tensor | None]:
    """The LM head the heads draft through and the target ids of its rows (None: all, in order): the
    target's own, or, for heads with a draft vocabulary, a copy of just those rows (read from the
    target's weights, packed like the target's), so a drafting step reads a fifth of Qwen2.5's
    152k-row head (from a GGUF file read in place: its rows dequantized)."""
    if heads.vocab is None:
        return store.target.model.lm_head, None
    cfg = store.target.config
    names = (("model.embed_tokens.weight", "embed_tokens.weight") if cfg.tie_word_embeddings
             else ("lm_head.weight", "model.lm_head.weight"))
    try:
        rows = store.target.weight(names)
    except SpecdecError:
        return store.target.model.lm_head, None
    ids = heads.vocab.cpu()
    lin = Linear(cfg.hidden_size, len(ids), dtype=store.dtype, device=store.device)
    with torch.no_grad():
        lin.weight.copy_(rows[ids].to(store.dtype))
    lin.tile() or lin.pack()  # (where it can: bf16 on a CPU)
    return lin, heads.vocab


def sparse_tree(acc: list[list[float]], budget: int) -> list[Path_]:
    """The best ``budget`` nodes, greedily (Medusa's rule): each added node has the highest product of
    ``acc[depth][rank]`` along its path among the children of nodes already in (ties: the earlier
    path in lexicographic order). Parents come before children."""
    out: list[Path_] = []
    heap = [(-a, (i,)) for i, a in enumerate(acc[0])] if acc else []
    heapq.heapify(heap)
    while heap and len(out) < budget:
        neg, node = heapq.heappop(heap)
        out.append(node)
        if len(node) < len(acc):
            for i, a in enumerate(acc[len(node)]):
                heapq.heappush(heap, (neg * a, node + (i,)))
    return out


@lru_cache(maxsize=64)
def tree_layout(acc: tuple[tuple[float, ...], ...], budget: int) -> tuple[list[int], list[int], list[int]]:
    """``sparse_tree`` as (parent index (-1: the pending token), depth - 1, rank) per node."""
    nodes = sparse_tree([list(a) for a in acc], budget)
    where = {n: i for i, n in enumerate(nodes)}
    return [where.get(n[:-1], -1) for n in nodes], [len(n) - 1 for n in nodes], [n[-1] for n in nodes]


class MedusaProposer(Proposer):
    """Drafts a Medusa tree from each row's last verified hidden state."""

    hidden_layers = (-1,)  # the final norm's output

    def __init__(self, heads: MedusaHeads, lm_head, row_ids: torch.Tensor | None = None) -> None:
        self.heads, self.lm_head = heads, lm_head
        self.row_ids = row_ids  # the target id of each row of ``lm_head`` (None: row i is token i)
        self.acc = tuple(tuple(a) for a in heads.config.accuracies())
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (position of h, h (C,))
        self.verified: torch.Tensor | None = None  # (B, 1+K, C)

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        h = forward.hidden[-1][0]  # (T, C) positions start..
        self.last[seq.row] = (start + h.shape[0] - 1, h[-1].clone())

    def remove(self, seq: Sequence) -> None:
        self.last.pop(seq.row, None)

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        self.verified = forward.hidden[-1]

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        h, self.verified = self.verified, None
        if h is None:
            return
        for i, (s, a) in enumerate(zip(seqs, num_accepted)):
            self.last[s.row] = (s.num_tokens - 2, h[i, a].clone())  # the state before the new pending token

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        dev = self.heads.heads[0].linear.weight.device
        budget = draft_budget(seqs, ks)
        for i, s in enumerate(seqs):
            pos, _ = self.last.get(s.row, (-1, None))
            if pos != s.num_tokens - 2:  # no state for this position yet (a one-token prompt)
                budget[i] = 0
        n_max = max(budget, default=0)
        if n_max == 0:
            return empty_draft(len(seqs), dev)
        parents, depth, rank = tree_layout(self.acc, n_max)
        n_max = len(parents)
        H, R = max(depth) + 1, max(rank) + 1
        ready = [self.last[s.row][1] for s, b in zip(seqs, budget) if b]
        h = torch.stack([self.last[s.row][1] if b else torch.zeros_like(ready[0])
                         for s, b in zip(seqs, budget)])  # (B, C); rows without a draft: anything
        w = self.heads.heads[0].linear.weight
        x = torch.stack([blk(h.to(w.dtype)) for blk in self.heads.heads[:H]], 1)  # (B, H, C)
        logits = self.lm_head(x.to(h.dtype))  # (B, H, V or the draft vocabulary)
        if self.verify == "gumbel":
            logits = self._gumbel_scores(seqs, logits)
        top = logits.topk(R, dim=-1).indices  # (B, H, R)
        if self.row_ids is not None:
            top = self.row_ids[top]  # draft-vocabulary rows -> target ids
        tokens = top[:, torch.tensor(depth, device=dev), torch.tensor(rank, device=dev)]  # (B, n)
        masks = DraftMasks.from_seqs(seqs)
        if masks is not None:
            tokens = self._legal(tokens, logits, masks, parents, depth, rank, budget)
        par = torch.tensor(parents, device=dev).expand(len(seqs), n_max)
        counts = torch.tensor([min(b, n_max) for b in budget], device=dev)
        return Draft(tokens=tokens, num_tokens=counts, probs=None, parents=par.clone())

    def _gumbel_scores(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Under Gumbel verification, a sampled row's head h ranks tokens by log q_h + g (its
        processed distribution, perturbed by the target's noise at the position head h predicts,
        ``num_tokens + h``, read by target token id): its rank-0 path is the heads' own Gumbel-max
        chain, the other ranks a Gumbel top-k (``proposers.tree``). Greedy rows keep their logits."""
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return logits
        B, H, Vd = logits.shape
        rows = torch.tensor(sampled, device=logits.device)
        st = SamplingTensors.from_params([seqs[i].params for i in sampled], logits.device)
        q = logits_to_probs(logits[rows].float(), st)  # (n, H, Vd)
        keys = RowKeys.from_seqs([seqs[i] for i in sampled], logits.device, shared_noise=True)
        V = self.heads.config.vocab_size  # the target's: noise is indexed by target token id
        n = len(sampled)
        e = keys.exponentials(torch.arange(H).repeat(n), V, NOISE, torch.arange(n).repeat_interleave(H))
        e = e.view(n, H, V)
        if self.row_ids is not None:
            e = e[..., self.row_ids.to(e.device)]  # draft-vocabulary rows read their target ids' noise
        out = logits.float().clone()
        out[rows] = q.log() - e.log()
        return out

    def _legal(self, tokens: torch.Tensor, logits: torch.Tensor, masks: DraftMasks, parents: list[int],
               depth: list[int], rank: list[int], budget: list[int]) -> torch.Tensor:
        """A constrained row's tree under its grammar: node i becomes the ``rank[i]``-th most probable
        token of its head among those legal after its parent's path (its siblings share that mask;
        a node with too few legal tokens keeps its unmasked one, which the verifier rejects)."""
        tokens = tokens.clone()
        ids = self.row_ids.cpu() if self.row_ids is not None else torch.arange(logits.shape[-1])  # head row -> id
        end = int(ids.max()) + 1
        for b, m in masks.rows:
            toks = tokens[b].tolist()
            ranked: dict[int, list[int]] = {}  # parent -> legal tokens of its children's head, best first
            for i in range(min(budget[b], len(parents))):
                p = parents[i]
                if p not in ranked:
                    path, j = [], p
                    while j >= 0:
                        path.append(toks[j])
                        j = parents[j]
                    bits = torch.full((m.words,), -1, dtype=torch.int32)
                    m.mask_after(path[::-1], bits)
                    ok = unpack(bits, end)[ids]  # (rows of the head,) legal
                    lg = logits[b, depth[i]].float().cpu().masked_fill(~ok, float("-inf"))
                    k = min(max(rank) + 1, int(ok.sum()))
                    ranked[p] = ids[lg.topk(k).indices].tolist()
                if rank[i] < len(ranked[p]):
                    toks[i] = ranked[p][rank[i]]
            tokens[b] = torch.tensor(toks, device=tokens.device)
        return tokens
