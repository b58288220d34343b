"""EAGLE-3-style feature drafting (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test"): a trained one-layer head reads the target's hidden
states of three layers from the verification forward and drafts K tokens on its own outputs.

Life cycle per row (the head's KV cache is position-addressed like the target's, no rollback):

* admission: the prompt's prefill returns the target's features at positions 0..n-2; they wait
  (``pending``) with the tokens that follow them;
* each step: ``on_verified`` keeps the verification forward's features, ``on_accept`` moves the
  accepted prefix (the pending token and the accepted drafts) into ``pending``;
* ``propose``: the head reads every pending position in one pass (writing its cache), the last
  one's output gives draft token 1, and each further token feeds the head its own output and the
  embedding of the token it just drafted. Drafting stops after a token the head gives less than
  ``draft_confidence_threshold``. Verification always uses the full target vocabulary; the head's
  distribution ``q`` (over its reduced vocabulary, zero elsewhere) goes to the verifier as is.
  With ``tree_topk`` it drafts an EAGLE-2 dynamic tree instead (``proposers.tree``): each depth's
  frontier is one head pass under an ancestors-only mask, a node reading its parent's output state.
* prefix caching: once the head has read a prompt, the full blocks of its keys are offered to its own
  prefix cache (each position keyed by its token and the next); a later prompt starting the same way
  maps them, and the target skips prefilling at most that prefix (``reuse_prefix``), so the head
  still reads the hidden states of every position it does not hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.heads.eagle import EagleHead
from specdec.models.native import tile_linears
from specdec.heads.speculators import load_head
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget, empty_draft
from specdec.proposers.options import option
from specdec.proposers.tree import TreeOptions, dynamic_tree
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.sequence import Sequence


def shipped_head(model: str, kind: str) -> Path | None:
    """The trained head of ``kind`` (eagle, medusa) committed beside an embedded model
    (``specdec/heads/<name>/<kind>/``), if any."""
    if Path(model).name != model:  # a path, not an embedded name
        return None
    path = Path(__file__).resolve().parent.parent / "heads" / model / kind
    return path if (path / "config.json").is_file() else None


def head_path(model: str | None, target: str, method: str, what: str) -> Path:
    """The head directory a config names, else the one shipped for ``target``; one clear error if neither.
    ``what``: the head and its verb, as in "EAGLE head ships"."""
    path = Path(model) if model else shipped_head(target, method)
    if path is None:
        raise SpecdecError(f"no trained {what} for model {target!r}: train one with `specdec train {method} "
                           f"--model {target} --output DIR` and pass {{'method': '{method}', 'model': DIR}} "
                           "(CLI: --speculative-model DIR)")
    return path


@dataclass(frozen=True)
class EagleOptions(TreeOptions):
    method = "eagle"
    summary = "a trained EAGLE-3-style head drafts from the target's own hidden states"

    model: str | None = option(None, flag="--speculative-model",
                               help="the head: a speculators EAGLE-3 directory (config.json + model.safetensors); "
                                    "unset: the head shipped for the target model")
    draft_confidence_threshold: float = option(0.0, lo=0.0, hi=1.0, hi_open=True,
                                               help="stop a draft after a token the head gives less than this "
                                                    "probability")

    def build(self, store) -> "EagleProposer":
        path = head_path(self.model, store.target.name, "eagle", "EAGLE head ships")
        head = load_head(path, dtype=store.dtype, device=store.device)
        check_fits(head, store.target.config, path)
        tile_linears(head)  # drafting only: its products on the native kernels
        return EagleProposer(head, store.target.model.embed_tokens, self.draft_confidence_threshold,
                             self.tree_topk, self.tree_depth)


def check_fits(head: EagleHead, target_cfg, path: Path) -> None:
    """The head must read this target: same width, vocabulary and existing layers."""
    c = head.config
    n = target_cfg.num_hidden_layers
    if (c.target_hidden_size != target_cfg.hidden_size or c.hidden_size != target_cfg.hidden_size
            or c.vocab_size != target_cfg.vocab_size or not all(1 <= i <= n for i in c.aux_layer_ids)):
        raise SpecdecError(f"EAGLE head '{path}' was made for another model (hidden {c.hidden_size}, vocabulary "
                           f"{c.vocab_size}, layers {list(c.aux_layer_ids)}; the target has hidden "
                           f"{target_cfg.hidden_size}, vocabulary {target_cfg.vocab_size}, {n} layers): "
                           "use a head trained for this target")


@dataclass
class Pending:
    """Positions the head has not read yet: features ``(m, 3C)`` at positions start.., next tokens."""

    start: int
    feats: list[torch.Tensor]
    tokens: list[int]


class EagleProposer(Proposer):
    """Drafts with an EAGLE-3 head in its own position-addressed KV cache (one row per target row)."""

    def __init__(self, head: EagleHead, embed: nn.Embedding, confidence_threshold: float = 0.0,
                 tree_topk: int = 0, tree_depth: int = 4) -> None:
        self.head, self.embed = head, embed
        self.tree_topk, self.tree_depth = min(tree_topk, head.config.draft_vocab_size), tree_depth
        self.layers = head.config.target_layers  # in the order fc reads them
        self.hidden_layers = tuple(dict.fromkeys(self.layers))
        self.confidence_threshold = confidence_threshold
        self.cache: KVCache | None = None
        self.pending: dict[int, Pending] = {}
        self.to_offer: dict[int, int] = {}  # row -> prompt positions to offer the head's prefix cache once read
        self.verified: torch.Tensor | None = None  # (B, 1+K, 3C) the last verification's features

    def lookahead(self) -> int:
        return self.tree_topk * (self.tree_depth - 1)  # a tree's fed nodes may outnumber K

    def features(self, forward) -> torch.Tensor:
        """``(B, T, 3C)``: the chosen layers' hidden states of a target forward, concatenated."""
        return torch.cat([forward.hidden[i] for i in self.layers], dim=-1)

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        # one slot more than the target's: padded positions of a ragged batch write there
        if self.cache is None:
            self.cache = self.head.new_cache(rows, max_len + 1, num_blocks)
        else:
            self.cache.grow(rows, max_len + 1, num_blocks)

    def prefix_keys(self, tokens: list[int], n: int) -> list[int]:
        """The head's prefix-cache keys of positions ``0..n-1``: the head's keys at position ``j`` come from
        the target's state there and token ``j + 1``, so each position is keyed by both tokens."""
        v = self.head.config.vocab_size
        return [a * v + b for a, b in zip(tokens[:n], tokens[1:n + 1])]

    def reuse_prefix(self, seq: Sequence) -> int | None:
        # the prompt's positions whose head keys a finished request left in the head's prefix cache:
        # the target skips prefilling at most those (the head reads the hidden states of the rest)
        if self.cache is None:
            return 0
        self.cache.free(seq.row)  # the row is empty unless an admission failed before its ``add``
        return self.cache.share_prefix(seq.row, self.prefix_keys(seq.tokens, len(seq.tokens) - 1), 1)

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        feats = self.features(forward)[0]  # (T, 3C): positions start.., each followed by the next token
        p = self.pending.get(seq.row)
        if start == 0 or p is None or p.start + len(p.tokens) != start:  # a new request in this row
            p = self.pending[seq.row] = Pending(start, [], [])
        p.feats.append(feats)
        p.tokens.extend(seq.tokens[start + 1:start + 1 + feats.shape[0]])

    def add(self, seq: Sequence) -> None:
        p = self.pending.get(seq.row)
        if p is None or p.start + len(p.tokens) != seq.num_tokens - 1:  # a one-token prompt: nothing read
            self.pending[seq.row] = Pending(seq.num_tokens - 1, [], [])
        self.to_offer[seq.row] = seq.num_tokens - 1

    def remove(self, seq: Sequence) -> None:
        self.pending.pop(seq.row, None)
        self.to_offer.pop(seq.row, None)
        if self.cache is not None:
            self.cache.free(seq.row)

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        self.verified = self.features(forward)

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        feats, self.verified = self.verified, None
        if feats is None:
            return
        for i, (s, a) in enumerate(zip(seqs, num_accepted)):
            p = self.pending.get(s.row)
            if p is None:
                continue
            # the block verified started at the pending token's position; a + 1 positions were kept
            start = s.num_tokens - a - 2
            if p.start + len(p.tokens) != start:  # a gap (cannot happen in the engine): start afresh there
                p = self.pending[s.row] = Pending(start, [], [])
            p.feats.append(feats[i, :a + 1])
            p.tokens.extend(s.tokens[start + 1:start + a + 2])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        dev = self.head.fc.weight.device
        B = len(seqs)
        budget = draft_budget(seqs, ks)
        if max(budget, default=0) == 0:
            return empty_draft(B, dev)
        pend = [self.pending[s.row] for s in seqs]
        need = [len(p.tokens) for p in pend]
        for i, n in enumerate(need):
            if n == 0:
                budget[i] = 0  # nothing read yet (a one-token prompt): no draft this step
        if max(budget) == 0:
            return empty_draft(B, dev)
        M = max(need)
        width = self.head.fc.in_features
        dtype = self.head.fc.weight.dtype
        feats = torch.zeros(B, M, width, dtype=dtype, device=dev)  # (B, M, 3C), right-padded
        toks = torch.zeros(B, M, dtype=torch.long, device=dev)
        pos = torch.zeros(B, M, dtype=torch.long, device=dev)
        slots = torch.zeros(B, M, dtype=torch.long, device=dev)
        for i, (p, n) in enumerate(zip(pend, need)):
            last = p.start + n - 1
            pos[i] = max(last, 0)  # padded queries sit at the row's last position (attend to something)
            # and write past it (slots the row's later reads overwrite, as a draft's do)
            slots[i] = (last + 1 + torch.arange(M, device=dev)).clamp(max=self.cache.max_len - 1)
            if n:
                feats[i, :n] = torch.cat(p.feats).to(dtype)
                toks[i, :n] = torch.tensor(p.tokens, device=dev)
                pos[i, :n] = torch.arange(p.start, p.start + n, device=dev)
                slots[i, :n] = pos[i, :n]
        rows = torch.tensor([s.row for s in seqs], device=dev)
        out = self.head.step(self.embed(toks).to(dtype), self.head.fc(feats), pos, slots, self.cache, rows)
        idx = torch.tensor([max(n - 1, 0) for n in need], device=dev)
        state = {"h": out[torch.arange(B, device=dev), idx].unsqueeze(1)}  # (B, 1, C)
        base = pos.gather(1, idx[:, None])  # (B, 1) the last position read
        for s, p, n in zip(seqs, pend, need):
            p.start, p.feats, p.tokens = p.start + n, [], []
            if self.to_offer.get(s.row, p.start + 1) <= p.start:  # the head's keys of the whole prompt are written
                self.cache.register_prefix(s.row, self.prefix_keys(s.tokens, self.to_offer.pop(s.row)))

        if self.tree_topk:
            return self._tree(seqs, budget, state["h"], base, rows)

        def next_logits(j: int, prev: torch.Tensor | None) -> torch.Tensor:
            if prev is not None:
                at = base + j
                state["h"] = self.head.step(self.embed(prev[:, None]).to(dtype), state["h"], at, at, self.cache, rows)
            return self.head.to_target_vocab(self.head.logits(state["h"][:, 0]).float())  # (B, V)

        return autoregressive_draft(seqs, budget, next_logits, self.confidence_threshold, dev,
                                    gumbel=self.verify == "gumbel")

    def _tree(self, seqs: list[Sequence], budget: list[int], h: torch.Tensor, base: torch.Tensor, rows: torch.Tensor) -> Draft:
        """A dynamic tree (``proposers.tree``) from the state ``h (B, 1, C)`` at the last position read,
        ``base (B, 1)``. A node at depth d reads its parent's output state (the root's: ``h``) at position
        base + d; fed node f is written to slot base + 1 + f, which the next read of real positions
        overwrites (so nothing moves after verification)."""
        outs = h  # (B, 1 + F, C): the root's state, then each fed node's output
        dtype = h.dtype

        def forward(tokens: torch.Tensor, depth: torch.Tensor, fed: int, mask: torch.Tensor) -> torch.Tensor:
            nonlocal outs
            B, W = tokens.shape
            # a node's parent: its deepest fed ancestor (fed in depth order: the last one its mask marks)
            order = torch.arange(1, fed + 1, device=tokens.device)
            parent = (mask[:, :, 1:1 + fed].long() * order).amax(-1) if fed else tokens.new_zeros(B, W)  # 0: root
            hidden = outs.gather(1, parent[..., None].expand(B, W, outs.shape[-1]))
            slots = (base + 1 + fed + torch.arange(W, device=tokens.device)).clamp(max=self.cache.max_len - 1)
            out = self.head.step(self.embed(tokens).to(dtype), hidden, base + depth, slots, self.cache, rows,
                                 tree=(base, mask[:, :, 1:]))
            outs = torch.cat([outs, out], 1)
            return self.head.to_target_vocab(self.head.logits(out).float())  # (B, W, V)

        first = self.head.to_target_vocab(self.head.logits(h[:, 0]).float())  # (B, V)
        return dynamic_tree(first, budget, self.tree_topk, self.tree_depth, forward, seqs,
                            gumbel=self.verify == "gumbel").draft
