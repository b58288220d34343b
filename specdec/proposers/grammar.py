"""Grammar-forced drafts: where a request's grammar leaves one continuation, propose it, free.

In structured output much of the text is fixed by the grammar: ``{"name": "``, a schema's keys in
order, closing brackets. There the matcher names the forced tokens (llguidance's fast-forward
tokens) and no model need guess them; the target's masked distribution there is a one-hot on the
forced token, so each is accepted with probability 1, greedy or sampled (lossless either way: the
draft is a function of the kept tokens, a deterministic proposal).

``GrammarForced(inner)`` wraps any method's proposer: a constrained row whose grammar forces a
token this step drafts the forced tokens (up to its K), followed by the inner drafter's tokens drafted
after them where the drafter reads only the tokens (``Proposer.drafts_after_unkept_tokens``: n-gram,
suffix, draft model; it sees the row as if the forced tokens were kept, which they will be: the
masked target gives each probability 1). A drafter that needs the target's own states of every token
(EAGLE's features, a self-draft in the target's cache) skips such a row this step. Every other row
drafts with the inner proposer. The engine wraps the configured proposer this way unless
its options say ``grammar_draft: false``; the ``grammar`` method is the wrapper alone (no model).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specdec.proposers.base import Draft, Proposer, draft_budget, empty_draft
from specdec.proposers.options import SpecOptions
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class GrammarOptions(SpecOptions):
    method = "grammar"
    summary = "the tokens a structured-output request's grammar forces (no model; plain decoding elsewhere)"

    def build(self, store) -> "GrammarForced":
        return GrammarForced(None)


class GrammarForced(Proposer):
    """Forced tokens for constrained rows, then (or else) the inner proposer's drafts."""

    def __init__(self, inner: Proposer | None) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers if inner is not None else ()
        self.verify = inner.verify if inner is not None else Proposer.verify
        self.num_forced = 0  # forced tokens proposed so far (statistics)
        # request id -> forced tokens in front of its last draft; -1: forced only (the inner drafted none)
        self._lead: dict[str, int] = {}

    def lookahead(self) -> int:
        return self.inner.lookahead() if self.inner is not None else 0

    def set_verify(self, mode: str) -> None:
        self.verify = mode
        if self.inner is not None:
            self.inner.set_verify(mode)

    def reuse_prefix(self, seq: Sequence) -> int | None:
        return self.inner.reuse_prefix(seq) if self.inner is not None else None

    def fit_draft_length(self, k: int) -> None:
        if self.inner is not None:
            self.inner.fit_draft_length(k)

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        if self.inner is not None:
            self.inner.prepare(rows, max_len, num_blocks)

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        if self.inner is not None:
            self.inner.on_prefill(seq, start, forward)

    def add(self, seq: Sequence) -> None:
        if self.inner is not None:
            self.inner.add(seq)

    def remove(self, seq: Sequence) -> None:
        self._lead.pop(seq.request_id, None)
        if self.inner is not None:
            self.inner.remove(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        budget = draft_budget(seqs, ks)
        forced = [s.matcher.forced(k) if s.matcher is not None else [] for s, k in zip(seqs, budget)]
        self._lead = {}
        if not any(forced):
            return self._inner(seqs, ks)
        self.num_forced += sum(map(len, forced))
        if self.inner is None or not self.inner.drafts_after_unkept_tokens:
            self._lead = {s.request_id: -1 for s, f in zip(seqs, forced) if f}
            return merge(forced, self._inner(seqs, [0 if f else k for f, k in zip(forced, ks)]))
        # the inner drafter continues after the forced tokens, as if they were kept already
        views = [_ahead(s, f) if f else s for s, f in zip(seqs, forced)]
        self._lead = {s.request_id: len(f) for s, f in zip(seqs, forced) if f}
        try:
            inner = self._inner(views, [max(0, k - len(f)) for f, k in zip(forced, budget)])
        finally:
            for s, f in zip(seqs, forced):
                if f:
                    s.matcher.m.rollback(len(f))
        return merge(forced, inner, behind=True)

    def _inner(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        if self.inner is None or not any(ks):
            return empty_draft(len(seqs), "cpu")
        return self.inner.propose(seqs, ks)

    def on_path(self, seqs: list[Sequence], paths: list[list[int]]) -> None:
        if self.inner is not None:  # the inner's own nodes, numbered as it drafted them
            self.inner.on_path(seqs, [_inner_path(p, self._lead.get(s.request_id, 0)) for s, p in zip(seqs, paths)])

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        if self.inner is not None:
            self.inner.on_verified(seqs, forward)

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        if self.inner is not None:  # a drafter that drafted after forced tokens counts its own tokens
            self.inner.on_accept(seqs, [a - max(0, min(a, self._lead.get(s.request_id, 0)))
                                        for s, a in zip(seqs, num_accepted)])


def _ahead(seq: Sequence, forced: list[int]) -> Sequence:
    """``seq`` as if ``forced`` were kept (its matcher advanced; the caller rolls it back)."""
    view = copy.copy(seq)
    view.tokens = seq.tokens + forced
    view.output_ids = seq.output_ids + forced
    seq.matcher.m.try_consume_tokens(forced)
    return view


def _inner_path(path: list[int], lead: int) -> list[int]:
    if lead < 0:
        return []
    return [n - lead for n in path if n >= lead]


def merge(forced: list[list[int]], inner: Draft, behind: bool = False) -> Draft:
    """Rows with forced tokens draft them first (a one-hot q where the inner draft has probabilities),
    followed by the row's inner draft when ``behind`` (a tree's roots hang from the last forced
    token), else alone. Rows without keep the inner draft."""
    B = len(forced)
    n_in = inner.num_tokens.tolist()
    n = [len(f) + (n_in[b] if behind else 0) if f else n_in[b] for b, f in enumerate(forced)]
    K = max(n, default=0)
    dev = inner.tokens.device
    tokens = torch.zeros(B, K, dtype=torch.long, device=dev)
    parents = None if inner.parents is None else torch.full((B, K), -1, dtype=torch.long, device=dev)
    probs = None
    if inner.probs is not None:
        probs = torch.zeros(B, K, inner.probs.shape[-1], dtype=inner.probs.dtype, device=dev)
    for b, f in enumerate(forced):
        lead = len(f)
        m = n_in[b] if (behind or not f) else 0
        tokens[b, lead:lead + m] = inner.tokens[b, :m]
        if f:
            tokens[b, :lead] = torch.tensor(f, device=dev)
        if parents is not None:
            parents[b, :lead] = torch.arange(lead, device=dev) - 1
            own = inner.parents[b, :m]
            parents[b, lead:lead + m] = torch.where(own < 0, lead - 1, own + lead)
        if probs is not None:
            probs[b, lead:lead + m] = inner.probs[b, :m]
            if f:
                probs[b, torch.arange(lead), tokens[b, :lead]] = 1.0
    return Draft(tokens=tokens, num_tokens=torch.tensor(n), probs=probs, parents=parents)
