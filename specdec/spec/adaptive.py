"""How many tokens to draft, per sequence and step.

``FixedK`` always asks for K. ``AdaptiveK`` follows the acceptance seen so far in the request,
like transformers' heuristic schedule (all drafts accepted: K + 2; a rejection: K - 1), and caps K
by batch size as vLLM does per batch size: a step verifies B x (K + 1) rows, and on this CPU a
forward costs about what one row costs up to ~8 rows, 1.2x at 8 and 1.55x at 16 (BENCHMARKS.md),
so K shrinks as B grows to keep B x (K + 1) within ``rows_budget``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runtime.sequence import Sequence


def request_cap(seq: Sequence, k: int) -> int:
    """A request may ask for fewer draft tokens (or none) than the engine would use."""
    return k if seq.num_speculative_tokens is None else min(k, seq.num_speculative_tokens)


@dataclass
class FixedK:
    k: int

    def k_for(self, seq: Sequence, batch_size: int) -> int:
        return request_cap(seq, self.k)

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


@dataclass
class _RowState:
    k: int
    acceptance: float = 1.0  # moving average of the per-token acceptance rate
    paused: int = 0  # steps left without drafting


@dataclass
class AdaptiveK:
    """Per-request K from its own acceptance; a request whose drafts keep failing pauses drafting.

    At K = 1 a step costs one draft token plus a 2-token verification and gains ``acceptance``
    tokens; below ``min_acceptance`` (about the draft's cost relative to a target step) that is a
    loss, so the request decodes plainly for ``pause_steps`` steps, then probes with K = 1 again.
    This is what keeps hard text from running slower than plain decoding.
    """

    k_max: int
    k_start: int | None = None
    rows_budget: int = 16
    min_acceptance: float = 0.3
    pause_steps: int = 8
    smoothing: float = 0.3
    rows: dict[str, _RowState] = field(default_factory=dict)

    def k_for(self, seq: Sequence, batch_size: int) -> int:
        st = self.rows.get(seq.request_id)
        if st is None:
            st = self.rows[seq.request_id] = _RowState(self.k_start or max(1, self.k_max // 2))
        if st.paused > 0:
            st.paused -= 1
            return 0
        cap = max(1, self.rows_budget // max(batch_size, 1) - 1)
        return request_cap(seq, min(st.k, cap, self.k_max))

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        st = self.rows.get(seq.request_id)
        if st is None or drafted == 0:
            return
        st.acceptance += self.smoothing * (accepted / drafted - st.acceptance)
        st.k = min(self.k_max, st.k + 2) if accepted == drafted else max(1, st.k - 1)
        if st.k == 1 and st.acceptance < self.min_acceptance:
            st.paused = self.pause_steps
            st.acceptance = self.min_acceptance  # one more failed probe pauses again

    def forget(self, seq: Sequence) -> None:
        self.rows.pop(seq.request_id, None)
