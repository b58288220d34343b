"""How many tokens to draft, per sequence and step: the engine core owns one of these.

``FixedK`` always asks for K. ``AdaptiveK`` follows the acceptance seen so far in the request,
like transformers' heuristic schedule (all drafts accepted: K + 2; a rejection: K - 1), and caps K
by batch size as vLLM does per batch size: a step verifies B x (K + 1) rows, and on this CPU a
forward costs about what one row costs up to ~8 rows, 1.2x at 8 and 1.55x at 16 (BENCHMARKS.md),
so K shrinks as B grows to keep B x (K + 1) within ``rows_budget``. ``LoadAwareK`` (the server's)
caps any of them by batch size and turns drafting off above ``spec_max_batch``.

A seeded sampled request under rejection sampling is the exception (``own_history``): its tokens
depend on the K of every step (another K tests other drafts with other keyed draws), and a seed
promises the same tokens alone or in any batch, so its K follows only its own history: no cap by
batch size, no plain step forced to time a batch size, pauses by acceptance instead of measured
seconds (``k_for(seq, None)``). Under Gumbel verification any K gives plain sampling's tokens, so
the batch caps it as any other request's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runtime.sequence import Sequence


def own_history(seq: Sequence, verify: str) -> bool:
    """Whether ``seq``'s draft length must depend on its own history only: a seeded sampled request
    verified by rejection sampling (its tokens depend on each step's K; a greedy row's and a Gumbel-
    verified row's do not)."""
    return verify != "gumbel" and seq.params.seed is not None and not seq.params.greedy


def request_cap(seq: Sequence, k: int) -> int:
    """A request may ask for fewer draft tokens (or none) than the engine would use."""
    return k if seq.num_speculative_tokens is None else min(k, seq.num_speculative_tokens)


@dataclass
class FixedK:
    k: int

    @property
    def max_k(self) -> int:
        return self.k

    def k_for(self, seq: Sequence, batch_size: int | None) -> int:
        return request_cap(seq, self.k)

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        pass

    def needs_plain_step(self, batch_size: int) -> bool:
        return False

    def observe_plain(self, batch_size: int, seconds: float, asked: bool = False) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


@dataclass
class _RowState:
    k: int
    acceptance: float = 1.0  # moving average of the per-token acceptance rate
    paused: int = 0  # steps left without drafting
    rate: float | None = None  # moving average of tokens per second while drafting
    spec_steps: int = 0  # drafting steps since the last pause
    pause_len: int = 0  # length of the next pause (doubles while probes keep losing)
    own: bool = False  # its K follows its own history only (asked for with batch_size None)


@dataclass
class AdaptiveK:
    """Per-request K from its own acceptance; a request whose drafts do not pay pauses drafting.

    K follows transformers' heuristic schedule (all drafts accepted: K + 2; a rejection: K - 1),
    capped by batch size. Whether drafting pays is measured, not guessed: the engine reports each
    step's seconds, the policy keeps the plain step time per batch size (steps without drafts) and
    each request's tokens per second while drafting. A request that drafts slower than plain
    decoding (by ``margin``) decodes plainly for ``pause_steps`` steps, doubling up to
    ``max_pause`` while probes keep losing, then probes again. Without timings (``seconds=None``)
    the pause falls back to acceptance below ``min_acceptance`` at K = 1. This is what keeps hard
    text (and cheap-to-verify but expensive-to-draft methods) from running slower than plain decoding.
    A request asked for with ``batch_size=None`` (``own_history``) is neither capped nor timed: its K
    and pauses follow its acceptance alone, so they are the same in any batch and any run.
    """

    k_max: int
    k_start: int | None = None
    rows_budget: int = 16
    min_acceptance: float = 0.3
    pause_steps: int = 8
    max_pause: int = 64
    margin: float = 0.03
    min_spec_steps: int = 3
    smoothing: float = 0.3
    rows: dict[str, _RowState] = field(default_factory=dict)
    plain_seconds: dict[int, float] = field(default_factory=dict)  # batch size -> step seconds (EMA)

    @property
    def max_k(self) -> int:
        return self.k_max

    def k_for(self, seq: Sequence, batch_size: int | None) -> int:
        """This step's K of ``seq`` in a batch of ``batch_size`` rows (None: from its own history only)."""
        st = self.rows.get(seq.request_id)
        if st is None:
            st = self.rows[seq.request_id] = _RowState(self.k_start or max(1, self.k_max // 2))
        st.own = batch_size is None
        if st.paused > 0:
            st.paused -= 1
            return 0
        cap = self.k_max if batch_size is None else max(1, self.rows_budget // max(batch_size, 1) - 1)
        return request_cap(seq, min(st.k, cap, self.k_max))

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        st = self.rows.get(seq.request_id)
        if st is None or drafted == 0:
            return
        st.acceptance += self.smoothing * (accepted / drafted - st.acceptance)
        st.k = min(self.k_max, st.k + 2) if accepted == drafted else max(1, st.k - 1)
        if seconds is None or st.own:  # no timings, or none wanted: pause on acceptance
            if st.k == 1 and st.acceptance < self.min_acceptance:
                self._pause(st, self.pause_steps)
                st.acceptance = self.min_acceptance  # one more failed probe pauses again
            return
        rate = (accepted + 1) / max(seconds, 1e-9)
        st.rate = rate if st.rate is None else st.rate + self.smoothing * (rate - st.rate)
        st.spec_steps += 1
        plain = self.plain_seconds.get(batch_size)
        if plain is None or st.spec_steps < self.min_spec_steps:
            return
        if st.rate < (1 - self.margin) / plain:
            self._pause(st, st.pause_len or self.pause_steps)
            st.pause_len = min(self.max_pause, 2 * (st.pause_len or self.pause_steps))
        elif st.spec_steps >= 2 * self.min_spec_steps:
            st.pause_len = 0  # drafting pays again: the next pause starts short

    def needs_plain_step(self, batch_size: int) -> bool:
        """No plain step time for this batch size yet: the engine should run one to measure it."""
        return batch_size not in self.plain_seconds

    def observe_plain(self, batch_size: int, seconds: float, asked: bool = False) -> None:
        """The engine ran a step without drafts for ``batch_size`` rows in ``seconds`` (``asked``: the
        proposer was asked and drafted nothing; ``seconds`` are then the verification's alone)."""
        old = self.plain_seconds.get(batch_size)
        self.plain_seconds[batch_size] = seconds if old is None else old + self.smoothing * (seconds - old)

    @staticmethod
    def _pause(st: _RowState, steps: int) -> None:
        st.paused, st.rate, st.spec_steps = steps, None, 0

    def forget(self, seq: Sequence) -> None:
        self.rows.pop(seq.request_id, None)


@dataclass
class CappedK:
    """A policy wrapping ``base``: everything is the base's but the cap ``k_for`` puts on its K."""

    base: "FixedK | AdaptiveK | CappedK"

    @property
    def max_k(self) -> int:
        return self.base.max_k

    def k_for(self, seq: Sequence, batch_size: int | None) -> int:
        k = self.base.k_for(seq, batch_size)
        return k if batch_size is None else min(k, self.cap(batch_size))  # None: never capped by the batch

    def cap(self, batch_size: int) -> int:
        raise NotImplementedError

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        self.base.update(seq, drafted, accepted, seconds, batch_size)

    def needs_plain_step(self, batch_size: int) -> bool:
        return self.base.needs_plain_step(batch_size)

    def observe_plain(self, batch_size: int, seconds: float, asked: bool = False) -> None:
        self.base.observe_plain(batch_size, seconds, asked=asked)

    def forget(self, seq: Sequence) -> None:
        self.base.forget(seq)


@dataclass
class LoadAwareK(CappedK):
    """Per-row draft length: the configured policy's, capped by batch size, 0 above ``spec_max_batch``."""

    spec_max_batch: int = 0
    rows_budget: int = 16

    def cap(self, batch_size: int) -> int:
        if batch_size > self.spec_max_batch:
            return 0
        return max(1, self.rows_budget // max(batch_size, 1) - 1)


Policy = FixedK | AdaptiveK | CappedK


def make_policy(k: int, adaptive: bool = False, spec_max_batch: int | None = None,
                rows_budget: int = 16) -> Policy:
    """The draft-length policy for draft length ``k``: fixed or adaptive, load-aware when a
    ``spec_max_batch`` is given (the server's)."""
    base: FixedK | AdaptiveK = AdaptiveK(k, rows_budget=rows_budget) if adaptive else FixedK(k)
    return base if spec_max_batch is None else LoadAwareK(base, spec_max_batch, rows_budget)


def draft_lengths(policy: Policy, seqs: list[Sequence], verify: str = "rejection") -> list[int]:
    """Each row's draft length this step (``verify``: how sampled rows are verified); all 0 when the
    policy first needs a plain step timed at this batch size (that step tells it what drafting must
    beat), unless a row whose K follows its own history (``own_history``) drafts: then no step is
    plain and the others draft as well, untimed against plain decoding until one is."""
    B = len(seqs)
    own = [own_history(s, verify) for s in seqs]
    ks = [policy.k_for(s, None if o else B) for s, o in zip(seqs, own)]
    if any(ks) and policy.needs_plain_step(B) and not any(k for k, o in zip(ks, own) if o):
        return [0] * B
    return ks
