"""Replay a model-free drafter (ngram, suffix) over recorded greedy outputs, without the target.

A drafter that reads only tokens proposes, at every step of greedy speculative decoding, a function of
the prompt and of the output so far, and the target keeps the longest drafted path that matches its
own greedy continuation plus one token of its own. With the greedy output recorded once (any lossless
run of ``specdec bench`` records it: every speculative output equals plain decoding's), the steps
each drafter configuration would take are counted exactly, in milliseconds instead of a model run:
tokens per step and tokens drafted per step, to tune a drafter's options before timing it. Requests
are replayed in the recorded order through one proposer, so a drafter that learns from finished
requests (suffix's tree of past outputs) learns as it would in the bench.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.engine.tree import depths
from specdec.proposers.base import Proposer
from specdec.runtime.sequence import Sequence


def accepted_length(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """Greedy verification against a known continuation: the depth of the deepest drafted node whose
    whole path equals ``truth``'s first tokens (a chain when ``parents`` is None)."""
    if not tokens:
        return 0
    par = torch.tensor(parents if parents is not None else list(range(-1, len(tokens) - 1)))
    depth = depths(par.unsqueeze(0))[0].tolist()  # 1 for children of the pending token
    good: list[bool] = []
    best = 0
    for i, (t, p) in enumerate(zip(tokens, par.tolist())):
        d = depth[i]
        ok = (p < 0 or good[p]) and d <= len(truth) and t == truth[d - 1]
        good.append(ok)
        if ok:
            best = max(best, d)
    return best


class _Silent:
    """A detokenizer that produces no text (the replay needs tokens only)."""

    def feed(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class ReplayStats:
    tokens: int = 0
    steps: int = 0
    drafted: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return (self.tokens - self.steps) / self.drafted if self.drafted else 0.0


def replay(proposer: Proposer, requests: list[tuple[list[int], list[int]]], k: int) -> list[ReplayStats]:
    """Count the steps ``proposer`` at budget ``k`` takes on each (prompt ids, greedy output ids)."""
    out = []
    for n, (prompt, output) in enumerate(requests):
        seq = Sequence(request_id=f"replay-{n}", prompt=None, prompt_ids=list(prompt),
                       params=SamplingParams(temperature=0.0, max_tokens=max(1, len(output)), ignore_eos=True),
                       detokenizer=_Silent(), eos_ids=frozenset(), max_len=len(prompt) + len(output) + k + 1,
                       seed=0)
        proposer.add(seq)
        st = ReplayStats()
        while len(seq.output_ids) < len(output):
            pos = len(seq.output_ids)
            d = proposer.propose([seq], [k])
            m = int(d.num_tokens[0])
            toks = d.tokens[0, :m].tolist()
            par = d.parents[0, :m].tolist() if d.parents is not None else None
            a = accepted_length(toks, par, output[pos:])
            kept = output[pos:pos + a + 1]
            seq.append(kept)
            proposer.on_accept([seq], [a])
            st.steps += 1
            st.drafted += m
            st.tokens += len(kept)
        seq.finish("length", None)
        proposer.remove(seq)
        out.append(st)
    return out
