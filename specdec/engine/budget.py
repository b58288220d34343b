"""The node budget of a tree draft from the measured cost of verifying T tokens on the loaded target
(issue 15, item 4): on this CPU a forward of a few rows costs about one row's, so a tree should
spend exactly the rows that are nearly free, and that depends on the target's dtype, kernel and the
batch size, so it is measured, not assumed.

``verify_costs`` times the target's forward at T = 1, 2, 4, 8, 16, ... tokens per row for a batch
of B rows (in a scratch cache: no request's cache is touched); ``budget_from_costs`` picks T; the
``MeasuredBudget`` policy caps each row's draft at T - 1 nodes (T counts the pending token), measuring
once per batch size and caching. Enabled by ``"tree_budget": "auto"`` on tree methods.

On a mixture-of-experts target the curve is not flat: a block of K + 1 rows routes to many more
experts than one row does, and each touched expert's weights are read (Qwen3-30B-A3B: 8 of 128 experts
per token, 48 distinct ones for 8 random rows), so speculation that pays on a dense model can make an
MoE model slower. ``CostAwareK`` therefore picks each step's K from the measured cost of verifying
K + 1 tokens per row at the batch size, the acceptance seen so far and the drafter's measured time:
the K of most expected tokens per second, 0 (plain decoding) when no K beats plain, with a probe now
and then so a change of text is noticed.

A long context moves the curve too, on every target: each verified row reads the whole context's keys
and values, so a block of K + 1 rows at 16k tokens costs far more than one row at 16k (int4 1.5B, AVX2
build: 2.11x) where at 256 tokens it costs about one row's. So the policy also measures, once per
context bucket (1k, 2k, 4k, ... 32k: ``BUCKETS``), what a row at that length adds to a block of T
(one row, a scratch cache mapped to that length, nothing computed for its keys), scales it to the
request's own length (attention is linear in it) and chooses each request's K from its own context:
a long request may decode plainly (``row_off``: "length") while a short one beside it drafts. The
engine uses it for every target with drafts (``"cost_aware": false`` turns it off).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.engine.policies import CappedK
from specdec.runtime.sequence import Sequence

SIZES = (1, 2, 4, 8, 16, 32)
BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768)  # context lengths whose verification costs are measured


def bucket_of(length: int) -> int:
    """The measured context bucket a request of ``length`` tokens costs like (scaled by ``length / bucket``):
    the largest of ``BUCKETS`` not above it; 0 below the first (the short-context curve, as measured)."""
    return max((b for b in BUCKETS if b <= length), default=0)


def budget_from_costs(costs: dict[int, float], tolerance: float = 1.25,
                      expected: Callable[[int], float] | None = None) -> int:
    """Draft nodes per step (T - 1) from ``costs``: T tokens per row -> seconds of one verification.

    Without ``expected``: the largest measured T whose cost stays within ``tolerance`` times one
    token's. With ``expected(n)`` (tokens a step emits with n draft nodes, the target's own included):
    the T maximizing ``expected(T - 1) / costs[T]``, tokens per second (ties: the smaller T)."""
    one = costs[1]
    if expected is None:
        return max(t for t, c in costs.items() if c <= tolerance * one) - 1
    return max(sorted(costs), key=lambda t: (expected(t - 1) / costs[t], -t)) - 1


@torch.inference_mode()
def verify_costs(model, batch_size: int, sizes: tuple[int, ...] = SIZES, repeats: int = 3,
                 context: int = 0) -> dict[int, float]:
    """Seconds of one forward of ``batch_size`` rows x T tokens for each T of ``sizes`` (the best of
    ``repeats``, after one warm-up), in a cache of its own. The tokens are seeded random ones: on a
    mixture of experts they route like text of little repetition, to about as many experts as real
    drafts do or more (the cost is not underestimated). ``context``: the T tokens sit after that many
    slots of each row, mapped (zeros: no forward computes them) and read by every row's attention as a
    real context's keys are (a sliding window's layers read their window's)."""
    cache = model.new_cache(batch_size, context + max(sizes) + 1)
    dev = model.embed_tokens.weight.device
    if context:
        _map_context(model, cache, batch_size, context)
    gen = torch.Generator().manual_seed(0)  # varied tokens: a mixture of experts routes them to many experts
    out = {}
    for t in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, t), generator=gen).to(dev)
        pos = (context + torch.arange(t, device=dev)).expand(batch_size, t)
        best = float("inf")
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            model(tokens, pos, cache)
            if r:  # the first run warms up
                best = min(best, time.perf_counter() - t0)
        out[t] = best
    return out


def _map_context(model, cache, batch_size: int, context: int) -> None:
    """Slots ``[0, context)`` of every row of a scratch cache mapped (zeroed blocks) without a forward; a
    hybrid's recurrent rings told those positions were written (their states zeros: what a recurrent
    layer costs does not depend on them)."""
    rows = torch.arange(batch_size)
    for lo in range(0, context, 4096):  # a windowed group frees what leaves its window as it goes
        hi = min(context, lo + 4096)
        cache.prepare_writes(rows, torch.arange(lo, hi).expand(batch_size, hi - lo))
    mark = getattr(cache, "mark_written", None)
    if mark is not None:
        mark(rows, context)


@dataclass
class MeasuredBudget(CappedK):
    """The base policy's draft length capped by the node budget measured for the batch size."""

    measure: Callable[[int], dict[int, float]] = verify_costs  # batch size -> verify_costs
    tolerance: float = 1.25
    budgets: dict[int, int] = field(default_factory=dict)  # batch size -> nodes

    def cap(self, batch_size: int) -> int:
        if batch_size not in self.budgets:
            self.budgets[batch_size] = max(1, budget_from_costs(self.measure(batch_size), self.tolerance))
        return self.budgets[batch_size]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step emits with ``k`` drafts each accepted with probability ``alpha`` until the
    first rejection, the target's own token included: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def interpolate(costs: dict[int, float], t: int) -> float:
    """``costs`` (T -> seconds) at ``t``: linear between the measured sizes, the last slope beyond them."""
    ts = sorted(costs)
    if t in costs:
        return costs[t]
    lo = max([x for x in ts if x < t], default=ts[0])
    hi = min([x for x in ts if x > t], default=None)
    if hi is None:
        lo, hi = ts[-2], ts[-1]
    return costs[lo] + (costs[hi] - costs[lo]) * (t - lo) / (hi - lo)


def best_k(costs: dict[int, float], alpha: float, k_max: int, draft_seconds: float = 0.0,
           margin: float = 0.0) -> int:
    """The K in 0..k_max of most expected tokens per second: ``expected_tokens(alpha, K)`` over the
    verification of K + 1 tokens (``costs``) plus K drafts (``draft_seconds`` each); a K > 0 must beat
    plain decoding by ``margin`` (ties: the smaller K)."""
    plain = 1.0 / interpolate(costs, 1)
    best, rate = 0, plain * (1.0 + margin)
    for k in range(1, k_max + 1):
        r = expected_tokens(alpha, k) / (interpolate(costs, k + 1) + k * draft_seconds)
        if r > rate:
            best, rate = k, r
    return best


@dataclass
class DraftRecord:
    """What a drafter's drafts have done on a target so far: a decaying count of accepted tokens against
    rejections (the estimate of a per-token acceptance rate), and the plain steps before the next probe.
    ``LLM`` keeps one per proposer (its config: method and options) and draft length across its engines
    (one per ``generate`` call), so a request starts from what the requests before it saw, not from the
    even prior again, as one engine serving many requests does; another method starts from its own."""

    accepted: float = 1.0  # prior: one accepted, one rejected (alpha 1/2) until drafts are seen
    rejected: float = 1.0
    probe_gap: int = 0  # plain steps before a probe (0: the policy's probe_every)
    plain_steps: int = 0  # steps in a row without drafts
    # (batch size, context bucket) -> seconds per draft token (EMA): a draft model's step grows with the context
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)


@dataclass
class CostAwareK(CappedK):
    """The base policy's K capped by ``best_k`` at the batch size and each request's context length:
    verification costs measured once per batch size (``measure(batch)``) and what a row adds at each
    context bucket (``measure(1, bucket)`` against ``measure(1)``), the acceptance rate of the drafts so
    far (``record``), and the drafter's seconds per draft token (each drafting step's time beyond its
    verification, per batch size and bucket). When the cap is 0 the step decodes plainly; after
    ``probe_every`` plain steps one step drafts a token again (its acceptance may have changed), and after
    each probe that fails twice as many (up to ``probe_max``), at least as many as keep the probe's own cost
    (a draft model catching up on the tokens it has not seen) within ``probe_share`` of the plain steps'
    time: drafts that keep failing cost a probe every 256 steps, not every 16. ``reason`` says why drafting
    is off for the whole batch (cost), ``row_off`` which requests drafted nothing for their length alone,
    for the server's metrics and playground."""

    measure: Callable[..., dict[int, float]] = verify_costs  # (batch size[, context]) -> T -> seconds
    probe_every: int = 16
    probe_max: int = 256
    margin: float = 0.03
    decay: float = 0.98
    probe_share: float = 0.02
    record: DraftRecord = field(default_factory=DraftRecord)
    probing: bool = False  # the last cap was a probe's
    costs: dict[int, dict[int, float]] = field(default_factory=dict)
    extra: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> T -> seconds a row there adds
    reason: str | None = None  # why the last cap was 0 (None: drafting)
    row_off: dict[str, str] = field(default_factory=dict)  # request id -> why its K is 0 at its length

    @property
    def alpha(self) -> float:
        return self.record.accepted / (self.record.accepted + self.record.rejected)

    def cost(self, batch_size: int) -> dict[int, float]:
        if batch_size not in self.costs:
            self.costs[batch_size] = self.measure(batch_size)
        return self.costs[batch_size]

    def costs_at(self, batch_size: int, length: int) -> dict[int, float]:
        """Seconds of verifying T tokens per row for ``batch_size`` rows when one of them holds ``length``
        tokens: the batch's short-context curve plus what that row's context adds (its bucket's, measured
        once at batch 1, scaled by ``length / bucket``)."""
        base = self.cost(batch_size)
        b = bucket_of(length)
        if not b:
            return base
        if b not in self.extra:
            at, short = self.measure(1, b), self.cost(1)
            self.extra[b] = {t: max(0.0, at[t] - short[t]) for t in at if t in short}
        add = self.extra[b]
        return {t: c + length / b * interpolate(add, t) for t, c in base.items()} if add else base

    def _choose(self, batch_size: int, length: int, limit: int) -> int:
        return best_k(self.costs_at(batch_size, length), self.alpha, limit,
                      self.record.draft_seconds.get((batch_size, bucket_of(length)), 0.0), self.margin)

    def cap(self, batch_size: int) -> int:
        """This batch size's K by cost at a short context, within the cap of a wrapped capped policy (the
        server's load cap)."""
        limit = self.base.cap(batch_size) if isinstance(self.base, CappedK) else self.max_k
        if limit == 0:  # off for the wrapped policy's reason (the load), not for cost
            self.reason = None
            return 0
        k = self._choose(batch_size, 0, min(limit, self.max_k))
        if k > 0:
            self.reason = None
            self.probing = False  # a probe that drafted nothing (no update) does not carry over
            return k
        self.reason = (f"verifying a block costs more than its expected tokens save (acceptance "
                       f"{self.alpha:.2f}, batch {batch_size})")
        return 1 if self._probe_due() else 0  # a probe

    def _probe_due(self) -> bool:
        self.probing = self.record.plain_steps >= (self.record.probe_gap or self.probe_every)
        return self.probing

    def k_for(self, seq: Sequence, batch_size: int | None) -> int:
        """``seq``'s K: the batch's cap at a short context, and within it the K that pays at ``seq``'s own
        length (0 there: a plain step for this row alone, with the probes of a plain batch)."""
        k = self.base.k_for(seq, batch_size)
        if batch_size is None:  # its K follows its own history: never capped
            return k
        cap = min(k, self.cap(batch_size))
        self.row_off.pop(seq.request_id, None)
        if cap == 0 or self.probing or not bucket_of(seq.num_tokens):
            return cap
        kl = self._choose(batch_size, seq.num_tokens, cap)
        if kl == 0:
            self.row_off[seq.request_id] = (
                f"at {seq.num_tokens} tokens of context a block of drafts costs more than its expected tokens "
                f"save (acceptance {self.alpha:.2f}, batch {batch_size})")
            return 1 if self._probe_due() else 0
        return kl

    def forget(self, seq: Sequence) -> None:
        self.row_off.pop(seq.request_id, None)
        super().forget(seq)

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        super().update(seq, drafted, accepted, seconds, batch_size)
        if drafted == 0:
            return
        rec = self.record
        # the row's first drafting step also paid the drafter's prefill of the whole prompt (a draft model:
        # seconds at 2k tokens): no sample of its time per token
        sample = getattr(seq, "num_draft", drafted) > drafted
        rec.plain_steps = 0
        rec.accepted = self.decay * rec.accepted + accepted
        rec.rejected = self.decay * rec.rejected + (accepted < drafted)
        costs = self.costs_at(batch_size, seq.num_tokens) if batch_size in self.costs else None
        if self.probing:  # a failed probe waits twice as long for the next (and long enough to pay for
            self.probing = False  # itself); one that passes, probe_every
            gap = 0
            if accepted == 0:
                gap = 2 * (rec.probe_gap or self.probe_every)
                if seconds is not None and costs is not None:
                    plain = interpolate(costs, 1)
                    gap = max(gap, math.ceil(max(0.0, seconds - plain) / (self.probe_share * plain)))
                gap = min(gap, self.probe_max)
            rec.probe_gap = gap
        if sample and seconds is not None and costs is not None:
            spent = max(0.0, seconds - interpolate(costs, drafted + 1)) / drafted
            key = (batch_size, bucket_of(seq.num_tokens))
            old = rec.draft_seconds.get(key)
            # down at once, up a tenth of the way: what inflates a sample (a probe's catching up on the plain
            # steps' tokens, a busy machine) is one-off, and an estimate set too high by one sample would keep
            # K at 0, with only the rare probes to correct it
            rec.draft_seconds[key] = spent if old is None or spent < old else old + 0.1 * (spent - old)

    def observe_plain(self, batch_size: int, seconds: float, asked: bool = False) -> None:
        """A step without drafts; ``asked``: the drafter was asked and found none (no n-gram matched).
        A probe that drafts nothing has failed: the next waits twice as long (up to ``probe_max``), as
        after a probe whose draft was rejected (else it stayed a probe, and every step asked again)."""
        super().observe_plain(batch_size, seconds, asked=asked)
        rec = self.record
        if asked and self.probing:
            self.probing = False
            rec.probe_gap = min(2 * (rec.probe_gap or self.probe_every), self.probe_max)
            rec.plain_steps = 0
        else:
            rec.plain_steps += 1
