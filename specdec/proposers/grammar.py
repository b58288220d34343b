"""Grammar-forced drafts: where a request's grammar leaves one continuation, propose it, free.

In structured output much of the text is fixed by the grammar: ``{"name": "``, a schema's keys in
order, closing brackets. There the matcher names the forced tokens (llguidance's fast-forward
tokens) and no model need guess them; the target's masked distribution there is a one-hot on the
forced token, so each is accepted with probability 1, greedy or sampled (lossless either way: the
draft is a function of the kept tokens, a deterministic proposal).

``GrammarForced(inner)`` wraps any method's proposer: a constrained row whose grammar forces a
token this step drafts the forced tokens (up to its K) and the inner drafter skips it this step; every
other row drafts with the inner proposer. The engine wraps the configured proposer this way unless
its options say ``grammar_draft: false``; the ``grammar`` method is the wrapper alone (no model).
"""
from __future__ import annotations

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
    """Forced tokens for constrained rows, the inner proposer's drafts for the rest."""

    def __init__(self, inner: Proposer | None) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers if inner is not None else ()
        self.num_forced = 0  # forced tokens proposed so far (statistics)
        self._forced: set[str] = set()  # request ids whose last draft was forced (the inner drafted none)

    def lookahead(self) -> int:
        return self.inner.lookahead() if self.inner is not None else 0

    def prepare(self, rows: int, max_len: int) -> None:
        if self.inner is not None:
            self.inner.prepare(rows, max_len)

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        if self.inner is not None:
            self.inner.on_prefill(seq, start, forward)

    def add(self, seq: Sequence) -> None:
        if self.inner is not None:
            self.inner.add(seq)

    def remove(self, seq: Sequence) -> None:
        if self.inner is not None:
            self.inner.remove(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        budget = draft_budget(seqs, ks)
        forced = [s.matcher.forced(k) if s.matcher is not None else [] for s, k in zip(seqs, budget)]
        self._forced = {s.request_id for s, f in zip(seqs, forced) if f}
        if not any(forced):
            return self._inner(seqs, ks)
        self.num_forced += sum(map(len, forced))
        inner = self._inner(seqs, [0 if f else k for f, k in zip(forced, ks)])
        return merge(forced, inner)

    def _inner(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        if self.inner is None or not any(ks):
            return empty_draft(len(seqs), seqs[0].generator.device if seqs else "cpu")
        return self.inner.propose(seqs, ks)

    def on_path(self, seqs: list[Sequence], paths: list[list[int]]) -> None:
        if self.inner is not None:  # the inner drafted no node of a forced row
            self.inner.on_path(seqs, [[] if s.request_id in self._forced else p for s, p in zip(seqs, paths)])

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        if self.inner is not None:
            self.inner.on_verified(seqs, forward)

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        if self.inner is not None:
            self.inner.on_accept(seqs, num_accepted)


def merge(forced: list[list[int]], inner: Draft) -> Draft:
    """Rows with forced tokens take them (a chain; a one-hot q where the inner draft has probabilities);
    the other rows keep the inner draft."""
    B = len(forced)
    n = [len(f) if f else int(inner.num_tokens[b]) for b, f in enumerate(forced)]
    K = max(max(n), inner.tokens.shape[1])
    dev = inner.tokens.device
    tokens = torch.zeros(B, K, dtype=torch.long, device=dev)
    tokens[:, :inner.tokens.shape[1]] = inner.tokens
    parents = None
    if inner.parents is not None:
        parents = torch.arange(K, device=dev).expand(B, K) - 1
        parents = parents.clone()
        parents[:, :inner.parents.shape[1]] = inner.parents
    probs = None
    if inner.probs is not None:
        probs = torch.zeros(B, K, inner.probs.shape[-1], dtype=inner.probs.dtype, device=dev)
        probs[:, :inner.probs.shape[1]] = inner.probs
    for b, f in enumerate(forced):
        if not f:
            continue
        tokens[b] = 0
        tokens[b, :len(f)] = torch.tensor(f, device=dev)
        if parents is not None:
            parents[b] = torch.arange(K, device=dev) - 1
        if probs is not None:
            probs[b] = 0
            probs[b, torch.arange(len(f)), tokens[b, :len(f)]] = 1.0
    return Draft(tokens=tokens, num_tokens=torch.tensor(n), probs=probs, parents=parents)
