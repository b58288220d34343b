"""The node budget of a tree draft from the measured cost of verifying T tokens on the loaded target
(issue 15, item 4): on this CPU a forward of a few rows costs about one row's, so a tree should
spend exactly the rows that are nearly free, and that depends on the target's dtype, kernel and the
batch size, so it is measured, not assumed.

``verify_costs`` times the target's forward at T = 1, 2, 4, 8, 16, ... tokens per row for a batch
of B rows (in a scratch cache: no request's cache is touched); ``budget_from_costs`` picks T; the
``MeasuredBudget`` policy caps each row's draft at T - 1 nodes (T counts the pending token), measuring
once per batch size and caching. Enabled by ``"tree_budget": "auto"`` on tree methods.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.runtime.sequence import Sequence

SIZES = (1, 2, 4, 8, 16, 32)


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
def verify_costs(model, batch_size: int, sizes: tuple[int, ...] = SIZES, repeats: int = 3) -> dict[int, float]:
    """Seconds of one forward of ``batch_size`` rows x T tokens for each T of ``sizes`` (the best of
    ``repeats``, after one warm-up), in a cache of its own."""
    cache = model.new_cache(batch_size, max(sizes) + 1)
    dev = model.embed_tokens.weight.device
    out = {}
    for t in sizes:
        tokens = torch.zeros(batch_size, t, dtype=torch.long, device=dev)
        pos = torch.arange(t, device=dev).expand(batch_size, t)
        best = float("inf")
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            model(tokens, pos, cache)
            if r:  # the first run warms up
                best = min(best, time.perf_counter() - t0)
        out[t] = best
    return out


@dataclass
class MeasuredBudget:
    """The base policy's draft length capped by the node budget measured for the batch size."""

    base: object  # a policies.Policy
    measure: Callable[[int], dict[int, float]]  # batch size -> verify_costs
    tolerance: float = 1.25
    budgets: dict[int, int] = field(default_factory=dict)  # batch size -> nodes

    @property
    def max_k(self) -> int:
        return self.base.max_k

    def budget(self, batch_size: int) -> int:
        if batch_size not in self.budgets:
            self.budgets[batch_size] = max(1, budget_from_costs(self.measure(batch_size), self.tolerance))
        return self.budgets[batch_size]

    def k_for(self, seq: Sequence, batch_size: int) -> int:
        k = self.base.k_for(seq, batch_size)
        return min(k, self.budget(batch_size)) if k else 0

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        self.base.update(seq, drafted, accepted, seconds, batch_size)

    def needs_plain_step(self, batch_size: int) -> bool:
        return self.base.needs_plain_step(batch_size)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.base.observe_plain(batch_size, seconds)

    def forget(self, seq: Sequence) -> None:
        self.base.forget(seq)
