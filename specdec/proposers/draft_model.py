"""Draft-model speculation (Leviathan et al. 2023; Chen et al. 2023): a small model with the
target's tokenizer drafts k tokens autoregressively, or a dynamic tree of k nodes (``tree_topk``:
EAGLE-2's, ``proposers.tree``); the target verifies them in one pass. A draft model of another
tokenizer drafts through ``proposers.cross_vocab`` (the same options, chains only). With
``draft_vocab_size`` the drafter's LM head keeps only the most frequent target tokens
(``heads.reduced_head``: FR-Spec).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import QUANTIZATIONS
from specdec.errors import SpecdecError
from specdec.models.llama import Transformer
from specdec.heads.reduced_head import ReducedHead, reduced_logits
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget, empty_draft, trained_context
from specdec.proposers.cross_vocab import CrossVocabProposer
from specdec.proposers.draft_vocab import DraftVocabOptions
from specdec.proposers.options import option
from specdec.proposers.tree import dynamic_tree, fed_prefix
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class DraftModelOptions(DraftVocabOptions):
    method = "draft_model"
    summary = "a small model drafts K tokens (the target's tokenizer, or another one: re-tokenized, lossless)"
    # the 0.5B int4 draft for the 1.5B: 32k of 151,936 rows cut draft time per token 19% for 2 points of
    # acceptance (2.42x -> 2.58x); 16k and 8k lost more acceptance than they saved (drafts-any-model.md)
    auto_vocab_size = 32768

    model: str | None = option(required=True, flag="--speculative-model",
                               help="the draft model: an embedded name, a Hugging Face directory or a .gguf file")
    quantization: str | None = option(None, choices=QUANTIZATIONS, flag="--speculative-quantization",
                                      help="the draft's weights: int4/int8 (from bf16) or gguf (the file's own "
                                           "blocks); unquantized when unset")
    draft_confidence_threshold: float = option(0.0, lo=0.0, hi=1.0, hi_open=True,
                                               help="stop a draft after a token the draft gives less than this "
                                                    "probability")
    draft_context: int | None = option(None, lo=1, help="the draft reads only the last N prompt tokens (cheap "
                                                          "prefill of long prompts); all of them when unset")

    def build(self, store) -> Proposer:
        draft = store.draft_model(self.model, self.quantization)
        if self.tree_topk and draft.config.layer_mixers:
            raise SpecdecError(f"draft model {self.model!r} is a hybrid model: its recurrent states follow one chain "
                               "of tokens, so it drafts chains (no tree_topk)")
        draft.model.fit_state_slots(self.num_speculative_tokens + 1)  # a hybrid draft's state rings
        if not store.shares_tokenizer(draft):
            if self.tree_topk or self.draft_vocab_size:
                raise SpecdecError(f"draft model {self.model!r} has another tokenizer than the target: it drafts "
                                   "chains over its own vocabulary (no tree_topk, no draft_vocab_size)")
            return CrossVocabProposer(draft.model, store.vocab_pair(draft), store.target.config.vocab_size,
                                      self.draft_confidence_threshold, self.draft_context)
        return DraftModelProposer(draft.model, self.draft_confidence_threshold, self.draft_context, self.tree_topk,
                                  self.tree_depth, head=self.reduced_head(store, draft.model))


class DraftModelProposer(Proposer):
    """Drafts with a separate model whose KV cache rows mirror the target's.

    ``valid[row]`` counts the sequence's tokens the draft cache holds. After a step, the draft's
    keys for accepted draft tokens stay valid, the rest is overwritten later (position-addressed
    cache: no rollback). With ``context`` set, the draft reads only the last ``context`` tokens of
    a longer prompt (``skip[row]`` tokens are left out and its positions shifted): its prefill of
    a long prompt (RAG, summarization) then costs a fraction, at some cost in acceptance. Drafts
    are verified, so any context is exact.
    """

    drafts_after_unkept_tokens = True  # it catches up on any tokens it has not seen

    def __init__(self, model: Transformer, confidence_threshold: float = 0.0, context: int | None = None,
                 tree_topk: int = 0, tree_depth: int = 4, head: ReducedHead | None = None) -> None:
        self.runner = ModelRunner(model)
        self.head = head  # a frequency-ranked head (draft_vocab_size), else the model's own
        # stop a row's draft after the first token whose draft probability (its top probability for
        # greedy rows) falls below this: later tokens are unlikely to be accepted
        self.confidence_threshold = confidence_threshold
        self.context = context
        self.valid: dict[int, int] = {}
        self.skip: dict[int, int] = {}
        self.n_before: dict[int, int] = {}
        self.tree_topk, self.tree_depth = tree_topk, tree_depth
        self.fed: dict[int, list[int]] = {}  # row -> per node of its last tree: its drafter slot offset

    def lookahead(self) -> int:
        return self.tree_topk * (self.tree_depth - 1)  # a tree's fed nodes may outnumber K

    def fit_draft_length(self, k: int) -> None:
        # a hybrid draft writes K tokens past the last accepted one: its rings hold them (its cache's too)
        self.runner.model.fit_state_slots(k + 1, self.runner.cache)

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        self.runner.num_blocks = num_blocks
        self.runner.ensure_cache(rows, max_len)

    def add(self, seq: Sequence) -> None:
        """Prefill the draft's row with the context: the last ``context`` tokens before the pending
        one (all of them when unset), re-based to start at the draft's position 0, so the draft
        reads exactly what the same model fed only those tokens would."""
        cap = trained_context(self.runner.model)  # past its positions the draft reads a window
        context = self.context if seq.num_tokens - 1 <= cap else min(self.context or cap, cap)
        skip = 0 if context is None else max(0, seq.num_tokens - 1 - context)
        window = seq.tokens[skip:-1]  # what the draft reads, at its positions 0 ..
        cached = self.runner.reuse_prefix(seq.row, window)  # its own prefix cache (keyed from position 0)
        self.runner.prefill(seq.row, window[cached:], start=cached)
        self.runner.offer_prefix(seq.row, window)
        self.skip[seq.row] = skip
        self.valid[seq.row] = seq.num_tokens - 1

    def remove(self, seq: Sequence) -> None:
        self.valid.pop(seq.row, None)
        self.skip.pop(seq.row, None)
        self.n_before.pop(seq.row, None)
        self.fed.pop(seq.row, None)
        if self.runner.cache is not None:
            self.runner.cache.free(seq.row)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        dev = self.runner.device
        B = len(seqs)
        budget = draft_budget(seqs, ks)
        kmax = max(budget)
        if kmax == 0:
            return empty_draft(B, dev)
        for s in seqs:
            lo = self.valid[s.row]
            if s.num_tokens - lo > 2:
                # a row that sat out steps without drafts catches up alone: padding the other rows
                # to its length could write past the end of the cache
                self.runner.prefill(s.row, s.tokens[lo:-1], start=lo - self.skip[s.row])
                self.valid[s.row] = s.num_tokens - 1
        # feed what the draft has not seen yet: 1 token, or 2 after a fully accepted draft (rows
        # needing fewer are right-padded; padded slots lie past the real tokens and get overwritten)
        need = [s.num_tokens - self.valid[s.row] for s in seqs]
        feed = max(need)
        toks = torch.tensor([s.tokens[self.valid[s.row]:] + [s.tokens[-1]] * (feed - n)
                             for s, n in zip(seqs, need)], device=dev)  # (B, feed)
        pos = (torch.tensor([[self.valid[s.row] - self.skip[s.row]] for s in seqs], device=dev)
               + torch.arange(feed, device=dev))  # the draft's own positions
        last = torch.tensor([[n - 1] for n in need], device=dev)  # (B, 1) each row's last real token
        rows = torch.tensor([s.row for s in seqs], device=dev)
        first = self._logits(toks, pos, rows, at=last)[:, 0]  # (B, V)
        nxt_pos = pos.gather(1, last) + 1  # (B, 1) where the first draft token goes
        if self.tree_topk:
            return self._tree(seqs, budget, first, nxt_pos, rows)

        def next_logits(j: int, prev: torch.Tensor | None) -> torch.Tensor:
            if prev is None:
                return first
            return self._logits(prev[:, None], nxt_pos + j - 1, rows)[:, -1]

        draft = autoregressive_draft(seqs, budget, next_logits, self.confidence_threshold, dev,
                                    gumbel=self.verify == "gumbel")
        for s, kb in zip(seqs, budget):
            self.n_before[s.row] = s.num_tokens
            self.valid[s.row] = s.num_tokens + max(kb - 1, 0)
        return draft

    def _logits(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, at="all", **kw) -> torch.Tensor:
        """The drafter's logits (B, T', V) at ``at``, through the reduced head when there is one."""
        return reduced_logits(self.runner.model, self.head, tokens, pos, self.runner.cache, at=at, rows=rows, **kw)

    def _tree(self, seqs: list[Sequence], budget: list[int], first: torch.Tensor, nxt_pos: torch.Tensor,
              rows: torch.Tensor) -> Draft:
        """A dynamic tree; fed node f sits at the drafter's position after the pending token + f."""
        dev = self.runner.device

        def forward(tokens: torch.Tensor, depth: torch.Tensor, fed: int, mask: torch.Tensor) -> torch.Tensor:
            slots = nxt_pos + fed + torch.arange(tokens.shape[1], device=dev)  # (B, W)
            return self._logits(tokens, nxt_pos - 1 + depth, rows, cache_pos=slots, attn_mask=mask)

        tree = dynamic_tree(first, budget, self.tree_topk, self.tree_depth, forward, seqs,
                            gumbel=self.verify == "gumbel")
        for s, fed in zip(seqs, tree.fed):
            self.n_before[s.row] = s.num_tokens
            self.valid[s.row] = s.num_tokens  # the pending token; on_path adds the kept fed nodes
            self.fed[s.row] = fed
        return tree.draft

    def on_path(self, seqs: list[Sequence], paths: list[list[int]]) -> None:
        """Move the kept nodes the drafter was fed to the slots after the pending token."""
        cache = self.runner.cache
        for s, path in zip(seqs, paths):
            fed = self.fed.pop(s.row, None)
            if fed is None:
                continue
            moved = fed_prefix(path, fed)
            base = self.n_before[s.row] - self.skip[s.row]  # the drafter's slot after the pending token
            if moved:
                cache.copy_slots(torch.tensor([s.row]), torch.tensor([[base + f for f in moved]]),
                                 torch.tensor([[base + j for j in range(len(moved))]]))
            self.valid[s.row] = self.n_before[s.row] + len(moved)

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s, a in zip(seqs, num_accepted):
            n = self.n_before.pop(s.row, None)
            if n is not None:
                self.valid[s.row] = min(self.valid[s.row], n + a)
