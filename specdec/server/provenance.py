"""Per-token provenance of a streamed choice: which tokens were drafts the target accepted.

A request that sends ``"specdec": {"provenance": true}`` gets, in each chunk's choice, an extension
field ``specdec`` (docs/server-provenance.md): the chunk's text split into its tokens, each marked
``"draft"`` (a draft token the target accepted) or ``"target"`` (the target's own token: its
correction at a rejection, or the bonus token after a fully accepted draft, or every token of a
plain step), and the choice's running counts (tokens, target steps, drafted and accepted tokens,
by draft position). The playground (``server/static``) colours tokens and draws its chart from it.

How a token's source is known: every engine step appends a row's accepted draft tokens first and
then one token of the target's own (``engine.step.accept``), and counts the accepted ones in
``Sequence.num_accepted``; so after a step, of the ``n`` new output tokens the first
``min(accepted now - accepted before, n)`` are drafts and the rest the target's (a stop may keep
fewer than were emitted: the kept ones are still the first). The same rule marks the terminal
demo's answer (``demo.DraftMarks``). It runs on the engine thread, right after the step, while the
sequence holds still.

Text alignment: the tokens are decoded here with an incremental detokenizer of their own into
character ranges of ``Sequence.text``; a chunk carries exactly the ranges of the text it sends (the
scheduler holds back a possible stop string's start, and a stop string cuts the text: ranges are
clipped to what is sent), so the segments of a chunk joined are its text. A token with no text of
its own (the end-of-turn token, or the first byte of a character another token completes) has no
segment; the character goes to the token that completed it.
"""
from __future__ import annotations

import collections

from specdec.formats.tokenizer import IncrementalDetokenizer
from specdec.runtime.sequence import Sequence

DRAFT, TARGET = "draft", "target"


class Provenance:
    """One choice's token sources and their places in its text; ``observe`` after each engine step,
    ``take`` when text is sent. Engine thread only."""

    def __init__(self, tokenizer, k: int) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.k = k  # the request's draft length cap (0: speculation off for it)
        self.seen = 0  # output tokens already marked
        self.accepted = 0  # Sequence.num_accepted when last observed
        self.end = 0  # characters of Sequence.text the marked tokens cover
        self.source = TARGET  # of the last marked token (a final flush's text is its)
        self.pending: collections.deque[list] = collections.deque()  # [start, end, source], not yet sent

    def observe(self, seq: Sequence) -> None:
        """Mark the tokens ``seq`` gained in the step just run."""
        new = seq.output_ids[self.seen:]
        drafted = min(max(seq.num_accepted - self.accepted, 0), len(new))
        self.seen += len(new)
        self.accepted = seq.num_accepted
        for j, tok in enumerate(new):
            self.source = DRAFT if j < drafted else TARGET
            ends_turn = tok in seq.eos_ids and not seq.params.ignore_eos  # Sequence.append decodes it not
            piece = "" if ends_turn else self.detok.feed([tok])
            self._add(len(piece))
        if seq.finished and len(seq.text) > self.end:  # the detokenizer's flush at the end
            self._add(len(seq.text) - self.end)

    def _add(self, n: int) -> None:
        if n:
            self.pending.append([self.end, self.end + n, self.source])
            self.end += n

    def take(self, text: str, upto: int) -> list[dict]:
        """The segments of ``text[:upto]`` not taken yet: ``{"text", "source"}`` per token (a token
        the cut at ``upto`` splits gives its first part now and the rest later)."""
        out = []
        upto = min(upto, len(text))
        while self.pending and self.pending[0][0] < upto:
            start, end, source = self.pending[0]
            if end <= upto:
                self.pending.popleft()
            else:
                self.pending[0][0] = end = upto
            out.append({"text": text[start:end], "source": source})
        return out

    def stats(self, seq: Sequence) -> dict:
        """The choice's running counts, sent beside the tokens."""
        return {"completion_tokens": len(seq.output_ids), "steps": seq.num_steps, "k": self.k,
                "draft_tokens": seq.num_draft, "accepted_tokens": seq.num_accepted,
                "drafted_at": list(seq.drafted_at), "accepted_at": list(seq.accepted_at),
                "speculation_off": seq.spec_off}

    def chunk_field(self, seq: Sequence, upto: int) -> dict:
        """The ``specdec`` field of the chunk that sends ``seq.text`` up to ``upto``."""
        return {"tokens": self.take(seq.text, upto), **self.stats(seq)}
