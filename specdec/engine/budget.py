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

from specdec.engine.policies import CappedK

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
class MeasuredBudget(CappedK):
    """The base policy's draft length capped by the node budget measured for the batch size."""

    measure: Callable[[int], dict[int, float]] = verify_costs  # batch size -> verify_costs
    tolerance: float = 1.25
    budgets: dict[int, int] = field(default_factory=dict)  # batch size -> nodes

    def cap(self, batch_size: int) -> int:
        if batch_size not in self.budgets:
            self.budgets[batch_size] = max(1, budget_from_costs(self.measure(batch_size), self.tolerance))
        return self.budgets[batch_size]
