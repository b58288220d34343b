"""N-gram prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's ngram proposer).

Match the last n tokens of a sequence (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
against everything before them, prompt and generated text alike, and propose the tokens that
followed the most recent earlier occurrence. No model, no probabilities: the draft is
deterministic, so the verifier treats it as one-hot proposals (still lossless).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.proposers.base import Draft, Proposer, draft_budget
from specdec.proposers.options import SpecOptions, option
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class NgramOptions(SpecOptions):
    method = "ngram"
    summary = "prompt lookup: the tokens that followed the latest earlier match of the last n tokens"

    prompt_lookup_min: int = option(1, lo=1, hi=64, help="shortest n-gram to match")
    prompt_lookup_max: int = option(4, lo=1, hi=64, help="longest n-gram to match")

    def check(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpecdecError(f"ngram needs prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                               f"and {self.prompt_lookup_max}")

    def build(self, store) -> "NgramProposer":
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram.

    tokens: (L,) int array. Returns a (m,) array, m <= k (empty when nothing matches). The
    search is vectorised over positions: O(L * n) comparisons per n, a few hundred microseconds
    on a 16k-token context.
    """
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return tokens[:0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        # candidate starts i with tokens[i:i+n] == suffix and i + n < L (something follows)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)  # (L-n, n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence wins
            return tokens[start:start + k]
    return tokens[:0]


class NgramProposer(Proposer):
    """Looks each sequence up afresh every step: no state to keep in sync."""

    drafts_after_unkept_tokens = True  # it catches up on any tokens it has not seen

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        budget = draft_budget(seqs, ks)
        found = [ngram_lookup(np.asarray(s.tokens, dtype=np.int64), self.min_n, self.max_n, kb)
                 for s, kb in zip(seqs, budget)]
        width = max((len(f) for f in found), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, f in enumerate(found):
            tokens[i, :len(f)] = torch.from_numpy(f)
        return Draft(tokens=tokens, num_tokens=torch.tensor([len(f) for f in found]), probs=None)
