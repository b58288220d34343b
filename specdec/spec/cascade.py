"""Cascades: a cheaper proposer drafts for a stronger drafter, which drafts for the target
(e.g. n-gram -> qwen2.5-coder-0.5b -> qwen2.5-coder-1.5b; cf. Chen et al. 2024, "Cascade
Speculative Drafting").

The drafter produces its k tokens by running the project's own generation loop on itself: an
``Engine`` over the drafter's runner, with the cheaper proposer drafting and the drafter
verifying. Each stage is therefore lossless with respect to the next: greedy drafts are exactly the
drafter's greedy tokens, sampled drafts follow the drafter's distribution. The target treats the
cascade's tokens as a deterministic draft (one-hot proposals), which keeps it lossless whatever
produced them.

The drafter is either a draft model with its own cache, or the target's own weights quantized
(``shared``: the target's runner), which drafts in the target's cache rows like layer_skip's
quantized self-draft: no prefill or catch-up of its own. It writes only slots past the pending
token, and the target's verification rewrites every slot it keeps.
"""
from __future__ import annotations

import torch

from specdec.engine import Engine
from specdec.runtime.runner import ModelRunner
from specdec.runtime.sequence import Sequence
from specdec.spec.adaptive import AdaptiveK, FixedK
from specdec.spec.base import Draft, Proposer, autoregressive_draft, draft_budget


class _Silent:
    """Detokenizer stand-in: drafts need no text."""

    def feed(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


class CascadeProposer:
    """The last stage (a draft model's runner) verifies the drafts of ``inner``."""

    def __init__(self, runner: ModelRunner, inner: Proposer, inner_k: int, shared: ModelRunner | None = None,
                 adaptive: bool = False) -> None:
        self.runner, self.inner, self.inner_k, self.shared = runner, inner, inner_k, shared
        self.adaptive = adaptive
        self.policy: AdaptiveK | FixedK = FixedK(inner_k)  # the inner stage's draft length
        self.valid: dict[int, int] = {}  # leading positions of the drafter's cache that hold real tokens
        self.n_before: dict[int, int] = {}  # sequence length when its draft was made
        self.shadows: dict[int, Sequence] = {}  # row -> the drafter's latest sequence (the policy's key)

    def prepare(self, rows: int, max_len: int) -> None:
        # the inner loop may write up to inner_k + 1 slots past the outer draft
        if self.shared is not None:  # grow the target's cache (nothing runs yet) and draft in it
            self.runner.cache = self.shared.ensure_cache(rows, max_len + self.inner_k + 1)
        else:
            self.runner.ensure_cache(rows, max_len + self.inner_k + 1)
        self.inner.prepare(rows, max_len + self.inner_k + 1)
        # adaptive: the inner stage's K and its measured-speed pauses carry over from one outer step
        # to the next (one shadow request id per sequence), so an n-gram stage that does not pay
        # stops costing the drafter verification rows
        self.policy = AdaptiveK(self.inner_k) if self.adaptive else FixedK(self.inner_k)

    def add(self, seq: Sequence) -> None:
        if self.shared is None:
            self.runner.prefill(seq.row, seq.tokens[:-1])
        self.valid[seq.row] = seq.num_tokens - 1

    def remove(self, seq: Sequence) -> None:
        self.valid.pop(seq.row, None)
        shadow = self.shadows.pop(seq.row, None)
        if shadow is not None:
            self.policy.forget(shadow)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        budget = draft_budget(seqs, ks)
        shadows: list[Sequence | None] = []
        heads: list[list[int]] = []  # per row, draft tokens made while catching up (0 or 1)
        for s, kb in zip(seqs, budget):
            # catch the drafter up to the sequence (the tokens it has not seen, but the pending one)
            lo = s.num_tokens - 1 if self.shared is not None else self.valid[s.row]  # shared: verified
            head = []
            if lo == s.num_tokens - 2 and kb > 0:
                # one token behind (the target kept the whole last draft): feed it with the pending
                # token in one forward, whose last logits give the first draft token
                head = [self._catch_up_and_draft(s, lo)]
            elif lo < s.num_tokens - 1:
                self.runner.prefill(s.row, s.tokens[lo:s.num_tokens - 1], start=lo)
            heads.append(head)
            if kb - len(head) <= 0:
                shadows.append(None)
                continue
            sh = Sequence(request_id=f"{s.request_id}/draft", prompt=None, prompt_ids=s.tokens + head,
                          params=s.params.replace(max_tokens=kb - len(head), stop=(), ignore_eos=True),
                          detokenizer=_Silent(), eos_ids=frozenset(), max_len=s.max_len + kb,
                          generator=s.generator, row=s.row)
            shadows.append(sh)
            self.shadows[s.row] = sh
        live = [sh for sh in shadows if sh is not None]
        engine = Engine(self.runner, self.inner, self.policy)
        for sh in live:
            self.inner.add(sh)
        engine.running = live
        while engine.running:
            engine.step()
        drafts = [head + (sh.output_ids if sh is not None else []) for head, sh in zip(heads, shadows)]
        for s, d in zip(seqs, drafts):
            # the drafter's cache now holds the sequence and all but the last drafted token
            self.valid[s.row] = s.num_tokens - 1 + len(d)
        tokens = torch.zeros(len(seqs), max(map(len, drafts), default=0), dtype=torch.long)
        for i, d in enumerate(drafts):
            tokens[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        self.n_before.update({s.row: s.num_tokens for s in seqs})
        return Draft(tokens=tokens, num_tokens=torch.tensor([len(d) for d in drafts]))

    @torch.inference_mode()
    def _catch_up_and_draft(self, s: Sequence, lo: int) -> int:
        """Feed tokens ``lo..`` (the missing one and the pending one) to the drafter; its next token,
        chosen as every drafter token is (``autoregressive_draft``: argmax or the request's sampling)."""
        dev = self.runner.device
        logits = self.runner.forward(torch.tensor([s.tokens[lo:]], device=dev),
                                     torch.arange(lo, s.num_tokens, device=dev)[None],
                                     torch.tensor([s.row], device=dev), logits_positions="last").logits[:, -1]
        return int(autoregressive_draft([s], [1], lambda j, prev: logits, 0.0, dev).tokens[0, 0])

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s, a in zip(seqs, num_accepted):
            n = self.n_before.pop(s.row, None)
            if n is not None:
                # drafted tokens beyond the accepted ones are not the sequence's: their keys are stale
                self.valid[s.row] = min(self.valid[s.row], n + a)
