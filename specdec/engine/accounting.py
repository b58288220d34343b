"""What one verification step counts: one definition for the engine, the acceptance simulator and
the replay tool.

A step drafts ``drafted`` tokens; the verifier keeps the first ``accepted`` (a tree: the accepted
path's depth) and adds the target's own token, ``accepted + 1`` tokens in all. The sequence then
takes them one by one and may stop early: at EOS, a stop string or a length limit. Tokens it did not
take were never emitted, so they are not counted as accepted: a step counts
``min(accepted, taken)`` accepted draft tokens, and tokens per step is tokens emitted over steps
(``metrics``), not ``accepted + 1``. Drafted counts every token the target verified, taken or not
(they cost a verification slot). Counting before the cut overstated ``acceptance_rate``,
``mean_accepted_length`` and the server's ``num_accepted_tokens`` on every request that ended
inside an accepted draft (issue 33).

``count_step`` updates any object with the engine's counter names (a ``Sequence``, a
``StepCounts``), so the engine (``engine.step.accept``), ``train.acceptance`` and
``tools.bench.replay`` count with the same code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Counters(Protocol):
    """The step counters a ``Sequence`` carries (and a ``StepCounts`` holds on its own)."""

    num_steps: int
    num_draft: int
    num_accepted: int
    drafted_at: list[int]  # by draft position: steps that drafted a token there
    accepted_at: list[int]  # by draft position: steps whose token there was accepted and emitted


@dataclass
class StepCounts:
    """Counters of many steps, outside a sequence (a simulated or replayed walk)."""

    num_steps: int = 0
    num_draft: int = 0
    num_accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def widen(self, positions: int) -> None:
        """Report at least ``positions`` draft positions (zeros where nothing was drafted yet)."""
        grow = positions - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)


def count_step(c: Counters, drafted: int, accepted: int, taken: int, positions: int | None = None) -> int:
    """Count one step of one sequence into ``c``: ``drafted`` tokens verified, ``accepted`` of them
    kept by the verifier, ``taken`` tokens (of the ``accepted + 1`` emitted) kept by the sequence.
    ``positions``: the draft positions the step drafted (a chain: ``drafted``; a tree: at most its
    depth). Returns the accepted tokens counted: those the sequence emitted."""
    kept = max(0, min(accepted, taken))
    npos = drafted if positions is None else positions
    c.num_steps += 1
    c.num_draft += drafted
    c.num_accepted += kept
    grow = npos - len(c.drafted_at)
    if grow > 0:
        c.drafted_at.extend([0] * grow)
        c.accepted_at.extend([0] * grow)
    for j in range(npos):
        c.drafted_at[j] += 1
        c.accepted_at[j] += int(j < kept)
    return kept
