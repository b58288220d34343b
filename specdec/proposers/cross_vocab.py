"""Drafting with a model whose tokenizer is not the target's (SmolLM2's 49,152 tokens for Qwen2.5's 151,936).

The drafter reads the committed text, tokenized its own way, and its drafts come back as target
tokens; the target verifies target tokens as for any drafter, so the engine never knows.

Greedy rows (a batch where every row is greedy, without penalties, logit bias or a grammar): the drafter drafts K of its own tokens freely, the
drafted text is re-tokenized for the target after the last few committed target tokens (so a token
merging across the boundary is tokenized as the target would), and those target tokens are the draft
(Hugging Face's universal assisted generation; Timor et al., ICML 2025, "Accelerating LLM Inference
with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", call its exact form
SLEM). Greedy verification accepts a token only where it is the target's argmax: exact whatever the
draft, and the drafter keeps its own tokenization, so it drafts as well as it can.

Sampled rows (T > 0): the string-level draft has no distribution q over target tokens that the
rejection rule could use (a text has many tokenizations; its probability is a sum over them), and
treating it as a one-hot proposal accepts a token only with probability p(x). So at T > 0 the
drafter drafts with Timor et al.'s token-level intersection (TLI): its distribution restricted to the
tokens both vocabularies share (the same bytes, mapped to target ids) and renormalized, with the
request's penalties, temperature, top-k/p and grammar mask applied in target ids through the shared
``autoregressive_draft``. The sampled token is drawn from exactly that q, zero outside the shared
set, so standard rejection sampling keeps the target's law exactly. A batch mixing greedy and
sampled rows drafts TLI for all of them (exact for the greedy rows too), and so do greedy rows with
penalties, a logit bias or a grammar: those act on target ids, which TLI's drafts are, so the draft
follows the processed distribution the target verifies against.

The drafter's KV cache: a row's context is the draft tokenization of the committed text, in two
parts: a frozen prefix (draft tokens aligned with a target-token boundary at least ``MARGIN``
target tokens back, never re-tokenized) and a re-tokenized tail. Each step the context is compared
with what the cache holds (the context before plus the drafted tokens fed) and only the suffix
past their common prefix is prefilled again: after an accepted draft that suffix is usually one
or two tokens. Target tokens that end inside a UTF-8 character are held back from the drafter
until the character completes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec.models.llama import Transformer
from specdec.formats.vocab_map import VocabPair, clean_text
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget, empty_draft, trained_context
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence

MARGIN = 16  # target tokens at the end of a context that stay re-tokenized every step
LOOKBACK = 4  # committed target tokens re-tokenized with a drafted text (merges across the boundary)
FLOOR = -1e30  # logit of a target token the drafter cannot propose: probability exactly 0, yet finite
CACHE_FACTOR = 2  # drafter cache slots per target slot (its tokens may be shorter than the target's)
FEED = 8  # context tokens the drafter catches up on in its first forward of a step (more: a prefill first)


@dataclass
class _Row:
    base: int  # the first target token the drafter reads (draft_context, or a window after overflow)
    frozen_t: int  # target tokens [base, frozen_t) are ``frozen`` for good
    frozen: list[int]
    cached: list[int] = field(default_factory=list)  # draft ids the cache holds at positions 0..
    fed: int = 0  # drafted tokens the last propose fed to the cache


class CrossVocabProposer(Proposer):
    """A draft model of another tokenizer; see the module docstring for the method at T = 0 and T > 0."""

    drafts_after_unkept_tokens = True  # its context is re-read from the tokens at each step

    def __init__(self, model: Transformer, pair: VocabPair, target_vocab: int, confidence_threshold: float = 0.0,
                 context: int | None = None) -> None:
        self.runner = ModelRunner(model)
        self.pair, self.target_vocab = pair, target_vocab
        self.confidence_threshold, self.context = confidence_threshold, context
        self.rows: dict[int, _Row] = {}
        dev = self.runner.device
        self.shared_d, self.shared_t = pair.shared_draft.to(dev), pair.shared_target.to(dev)
        self.t2d = torch.full((target_vocab,), -1, dtype=torch.long, device=dev)
        self.t2d[self.shared_t] = self.shared_d
        hf = pair.draft_hf
        self.pad = next((i for i in (hf.bos_token_id, hf.eos_token_id) if i is not None), 0)

    def fit_draft_length(self, k: int) -> None:
        self.runner.model.fit_state_slots(k + 1, self.runner.cache)  # a hybrid drafter's rings, as its build's

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        self.runner.num_blocks = None if num_blocks is None else CACHE_FACTOR * num_blocks
        self.runner.ensure_cache(rows, CACHE_FACTOR * max_len)

    def add(self, seq: Sequence) -> None:
        skip = 0 if self.context is None else max(0, seq.num_tokens - 1 - self.context)
        st = _Row(base=skip, frozen_t=skip, frozen=self.pair.draft_lead() if skip == 0 else [])
        self.rows[seq.row] = st
        ctx = self._fit(st, seq.tokens, FEED)
        if len(ctx) > 1:
            self.runner.prefill(seq.row, ctx[:-1])
        st.cached = ctx[:-1]

    def remove(self, seq: Sequence) -> None:
        self.rows.pop(seq.row, None)
        if self.runner.cache is not None:
            self.runner.cache.free(seq.row)

    # ---- the drafter's context ----------------------------------------------------------------
    def _context(self, st: _Row, tokens: list[int]) -> list[int]:
        """The draft ids of the committed text from ``st.base`` (freezing an aligned older part)."""
        tail = tokens[st.frozen_t:]
        text, _ = clean_text(self.pair.target_text(tail))
        ids = self.pair.encode_draft(text)
        if len(tail) > 2 * MARGIN:
            i, j = self.pair.aligned(tail, ids, len(tail) - MARGIN)
            if j:
                st.frozen, st.frozen_t, ids = st.frozen + ids[:j], st.frozen_t + i, ids[j:]
        return st.frozen + ids or [self.pad]

    def _fit(self, st: _Row, tokens: list[int], k: int) -> list[int]:
        """The context, its window moved forward (read again from scratch) if it and ``k`` drafted
        tokens would not fit the drafter's cache row (a text its tokenizer splits very finely) or the
        positions it was trained on (``base.trained_context``)."""
        ctx = self._context(st, tokens)
        cap = min(self.runner.cache.max_len - k - 2, trained_context(self.runner.model))  # its cache, its positions
        while len(ctx) > cap:
            st.base = st.frozen_t = len(tokens) - max(1, (len(tokens) - st.base) // 2)
            st.frozen = []
            ctx = self._context(st, tokens)
        return ctx

    def _sync(self, seqs: list[Sequence], kmax: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Bring every row's cache up to its context; the drafter's logits (B, Vd) after it, the
        position (B, 1) of the first drafted token, and the contexts. The tokens past what the cache
        holds go in one forward with the logits (up to FEED of them; a longer catch-up is prefilled
        first); rows feeding fewer are right-padded (slots past their context, overwritten later)."""
        dev, ctxs, need = self.runner.device, [], []
        for s in seqs:
            st = self.rows[s.row]
            known = len(st.frozen)
            ctx = self._fit(st, s.tokens, max(kmax, FEED))
            same = min(known, len(st.cached), len(ctx)) if st.cached[:known] == ctx[:known] else 0
            while same < min(len(st.cached), len(ctx)) and st.cached[same] == ctx[same]:
                same += 1
            same = min(same, len(ctx) - 1)  # the last context token is fed below, for its logits
            if len(ctx) - same > FEED:
                self.runner.prefill(s.row, ctx[same:-FEED], start=same)
                same = len(ctx) - FEED
            st.cached = ctx
            ctxs.append(ctx)
            need.append(len(ctx) - same)
        feed = max(need)
        toks = torch.tensor([c[len(c) - n:] + [c[-1]] * (feed - n) for c, n in zip(ctxs, need)], device=dev)
        pos = torch.tensor([[len(c) - n] for c, n in zip(ctxs, need)], device=dev) + torch.arange(feed, device=dev)
        last = torch.tensor([[n - 1] for n in need], device=dev)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        logits = self.runner.forward(toks, pos, rows, logits_positions=last).logits[:, 0]  # (B, Vd)
        return logits, torch.tensor([[len(c)] for c in ctxs], device=dev), ctxs

    # ---- drafting ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        dev = self.runner.device
        budget = draft_budget(seqs, ks)
        kmax = max(budget, default=0)
        if kmax == 0:
            return empty_draft(len(seqs), dev)
        first, pos, ctxs = self._sync(seqs, kmax)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        if all(s.params.greedy and s.matcher is None and not s.params.has_penalties for s in seqs):
            return self._string_level(seqs, budget, first, pos, rows)
        fed: list[torch.Tensor] = []

        def next_logits(j: int, prev: torch.Tensor | None) -> torch.Tensor:
            if prev is None:
                return self._to_target_logits(first)
            d = self.t2d[prev]
            d = torch.where(d >= 0, d, torch.full_like(d, self.pad))  # a floor-level pick: any input is exact
            fed.append(d)
            return self._to_target_logits(self.runner.forward(d[:, None], pos + j - 1, rows).logits[:, -1])

        draft = autoregressive_draft(seqs, budget, next_logits, self.confidence_threshold, dev)
        self._record_fed(seqs, fed)
        return draft

    def _to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, Vd) drafter logits -> (B, V) over target ids: the shared tokens' logits, FLOOR elsewhere
        (TLI: softmax then renormalizes over the shared tokens)."""
        out = torch.full((logits.shape[0], self.target_vocab), FLOOR, device=logits.device)
        out[:, self.shared_t] = logits[:, self.shared_d].float()
        return out

    def _record_fed(self, seqs: list[Sequence], fed: list[torch.Tensor]) -> None:
        if fed:
            cols = torch.stack(fed, 1).tolist()  # (B, fed)
            for s, c in zip(seqs, cols):
                self.rows[s.row].cached = self.rows[s.row].cached + c

    def _string_level(self, seqs: list[Sequence], budget: list[int], first: torch.Tensor, pos: torch.Tensor,
                      rows: torch.Tensor) -> Draft:
        """Greedy: the drafter's own argmax tokens, their text re-tokenized for the target."""
        kmax, logits, drafted, fed = max(budget), first, [], []
        stop = list(budget)
        for j in range(kmax):
            tok = logits.argmax(-1)  # (B,)
            drafted.append(tok)
            if self.confidence_threshold > 0:
                conf = torch.softmax(logits.float(), -1).max(-1).values
                for b in torch.nonzero(conf < self.confidence_threshold).flatten().tolist():
                    stop[b] = min(stop[b], j + 1)
            if j + 1 >= max(stop):
                break
            fed.append(tok)
            logits = self.runner.forward(tok[:, None], pos + j, rows).logits[:, -1]
        self._record_fed(seqs, fed)
        cols = torch.stack(drafted, 1).tolist()
        out = [self._to_target(s, c[:n])[:b] for s, c, n, b in zip(seqs, cols, stop, budget)]
        width = max(len(o) for o in out)
        dev = self.runner.device
        tokens = torch.tensor([o + [0] * (width - len(o)) for o in out], dtype=torch.long, device=dev)
        return Draft(tokens=tokens.view(len(seqs), width), num_tokens=torch.tensor([len(o) for o in out], device=dev))

    def _to_target(self, seq: Sequence, drafted: list[int]) -> list[int]:
        """Target ids continuing ``seq.tokens`` with the drafted text: re-tokenized after the last
        LOOKBACK committed tokens where that re-spells them, else on its own."""
        data, _ = self.pair.draft_text(drafted)
        st = self.rows[seq.row]
        tail = self.pair.target_text(seq.tokens[st.frozen_t:])
        held = tail[clean_text(tail)[1]:]  # an unfinished character the drafter has not seen
        if not data.startswith(held):
            return []
        rest = data[len(held):]
        back = seq.tokens[-LOOKBACK:]
        text, _ = clean_text(self.pair.target_text(back) + rest)
        ids = self.pair.encode_target(text)
        if ids[:len(back)] == back:
            return self._valid(ids[len(back):])
        if held:
            return []
        return self._valid(self.pair.encode_target(clean_text(rest)[0]))

    def _valid(self, ids: list[int]) -> list[int]:
        """``ids`` up to the first one past the target's embedding rows (none, for a sane tokenizer)."""
        return list(itertools.takewhile(lambda i: i < self.target_vocab, ids))
