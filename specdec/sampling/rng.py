"""Per-row random streams: a seeded request draws from its own generator, whatever else is batched."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specdec.config import SamplingParams


class RowGenerators:
    """One random stream per batch row, so a seeded request is repeatable whatever else is batched.

    Rows with a seed own a ``torch.Generator`` seeded with it. Rows without one need no
    repeatability, so they share one generator (seeded from a fresh random value, or from
    ``unseeded_seed`` for reproducible tests and benchmarks) and are drawn in one call.
    Every ``sample`` call consumes exactly one uniform per row, every ``uniform(n)`` n per row.
    """

    def __init__(self, seeds: Sequence[int | None], device: torch.device | str = "cpu",
                 unseeded_seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.gens: list[torch.Generator | None] = [
            None if s is None else torch.Generator(device=self.device).manual_seed(int(s))
            for s in seeds]
        self.shared = torch.Generator(device=self.device)
        if unseeded_seed is None:
            self.shared.seed()
        else:
            self.shared.manual_seed(int(unseeded_seed))
        self._index()

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu",
                    unseeded_seed: int | None = None) -> "RowGenerators":
        return cls([p.seed for p in params], device, unseeded_seed)

    @classmethod
    def from_generators(cls, gens: Sequence[torch.Generator], device: torch.device | str = "cpu"
                        ) -> "RowGenerators":
        """Rows whose streams live elsewhere (a request keeps its generator across steps)."""
        return cls([], device)._derive(list(gens))

    def _index(self) -> None:
        self._seeded = [i for i, g in enumerate(self.gens) if g is not None]
        unseeded = [i for i, g in enumerate(self.gens) if g is None]
        self._unseeded = torch.tensor(unseeded, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return len(self.gens)

    def _derive(self, gens: list[torch.Generator | None]) -> "RowGenerators":
        new = object.__new__(RowGenerators)
        new.device, new.gens, new.shared = self.device, gens, self.shared
        new._index()
        return new

    def select(self, indices: Sequence[int]) -> "RowGenerators":
        """The rows ``indices`` (in that order), each keeping its stream: drop finished requests."""
        return self._derive([self.gens[int(i)] for i in indices])

    def concat(self, other: "RowGenerators") -> "RowGenerators":
        """These rows followed by ``other``'s: add new requests. Unseeded rows use self's stream."""
        return self._derive(self.gens + other.gens)

    def uniform(self, n: int) -> Tensor:
        """(B, n) float64 uniforms in [0, 1), row b drawn from row b's generator."""
        B = len(self.gens)
        kw = dict(dtype=torch.float64, device=self.device)
        if not self._seeded:
            return torch.rand(B, n, generator=self.shared, **kw)
        out = torch.empty(B, n, **kw)  # (B, n)
        if len(self._unseeded):
            out[self._unseeded] = torch.rand(len(self._unseeded), n, generator=self.shared, **kw)
        for i in self._seeded:
            out[i] = torch.rand(n, generator=self.gens[i], **kw)
        return out

    def sample(self, weights: Tensor) -> Tensor:
        """(B, V) non-negative weights (need not sum to 1) -> (B,) long, by inverse CDF.

        One uniform per row; the CDF is accumulated in float64 and a zero-weight token is never
        returned. A one-hot row (greedy) returns its hot index. All-zero rows are invalid input.
        """
        B, V = weights.shape
        u = self.uniform(1)  # (B, 1)
        cdf = weights.to(torch.float64).cumsum(-1)  # (B, V)
        total = cdf[:, -1:]  # (B, 1)
        below_total = torch.nextafter(total, torch.zeros_like(total))  # (B, 1)
        target = torch.minimum(u * total, below_total)  # (B, 1) strictly below the total mass
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=V - 1)
