"""The Proposer interface every speculation method implements, and the Draft it returns.

A proposer knows nothing of acceptance rules: it proposes, the verifier decides, and the engine
tells the proposer how many tokens each row accepted (the begin / draft / accept life cycle of
llama.cpp's drafters; transformers' get_candidates / update_candidate_strategy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.runtime.sequence import Sequence


@dataclass
class Draft:
    """Draft tokens for each running sequence.

    tokens: (B, K) long, row b's draft in ``tokens[b, :num_tokens[b]]`` (the rest is padding).
    num_tokens: (B,) long.
    probs: (B, K, V) float, the distribution each draft token was sampled from (after the
        request's own temperature / top-k / top-p / min-p), or None for a deterministic draft
        (n-gram lookup): the verifier then treats each token as a one-hot proposal.
    """

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """What the engine calls, in this order: prepare, add, then propose/on_accept per step, remove."""

    def prepare(self, rows: int, max_len: int) -> None:
        """Size any per-row state (a draft model's KV cache) like the target's cache."""

    def add(self, seq: Sequence) -> None:
        """A sequence joined the batch in cache row ``seq.row`` (prefill own state)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        """Up to ``ks[i]`` draft tokens for sequence i, never more than ``seq.room - 1``."""

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Row i kept ``num_accepted[i]`` draft tokens (plus one token of the target's)."""

    def remove(self, seq: Sequence) -> None:
        """The sequence finished; forget it."""


def draft_budget(seqs: list[Sequence], ks: list[int]) -> list[int]:
    """Per-row draft length: at most ks[i], and leave room for the target's own extra token."""
    return [max(0, min(k, s.room - 1)) for s, k in zip(seqs, ks)]
