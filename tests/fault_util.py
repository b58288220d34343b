"""Fault injection for the engine and the server: a proposer that raises (or hangs) on chosen rows."""
from __future__ import annotations

import threading

from specdec.proposers.base import Proposer
from specdec.runtime.sequence import Sequence


class FaultyProposer(Proposer):
    """Wraps a proposer; raises in ``where`` ("add", "propose" or "remove") for the requests in ``bad``."""

    def __init__(self, inner: Proposer, where: str) -> None:
        self.inner, self.where = inner, where
        self.bad: set[str] = set()  # request ids whose rows raise
        self.everyone = False  # every row raises (an error of the engine itself)
        self.hang = threading.Event()  # set: ``propose`` blocks until ``release`` is set
        self.release = threading.Event()
        self.hidden_layers = inner.hidden_layers

    def _check(self, where: str, seqs: list[Sequence]) -> None:
        if where == self.where and (self.everyone or any(s.request_id in self.bad for s in seqs)):
            raise RuntimeError(f"injected fault in {where}")

    def lookahead(self) -> int:
        return self.inner.lookahead()

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        self.inner.prepare(rows, max_len, num_blocks)

    def reuse_prefix(self, seq):
        return self.inner.reuse_prefix(seq)

    def add(self, seq) -> None:
        self._check("add", [seq])
        self.inner.add(seq)

    def propose(self, seqs, ks):
        if self.hang.is_set():
            self.release.wait(30)
        self._check("propose", seqs)
        return self.inner.propose(seqs, ks)

    def on_verified(self, seqs, forward) -> None:
        self.inner.on_verified(seqs, forward)

    def on_accept(self, seqs, num_accepted) -> None:
        self.inner.on_accept(seqs, num_accepted)

    def remove(self, seq) -> None:
        self._check("remove", [seq])
        self.inner.remove(seq)
