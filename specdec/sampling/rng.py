"""Keyed randomness: every random draw is a pure function of (seed, output position, purpose).

A seeded request must give the same tokens whatever else is batched with it, however many drafts
the other rows (or its own adaptive K) ask for, and whichever step happens to reach a position. A
sequential stream per request cannot promise that: a row that draws K uniforms in one step and K'
in another shifts every later draw. So nothing here is a stream. Each draw is addressed by a key

    (seed, position, purpose, stage, sub)

* ``seed``: the request's seed (``Sequence.seed``);
* ``position``: the index in ``Sequence.tokens`` of the token the draw decides;
* ``purpose``: ``ACCEPT`` (the acceptance test of a draft token), ``DRAFT`` (a drafter's own sample
  under rejection sampling) or ``NOISE`` (the Gumbel / exponential noise vector of Gumbel-max
  sampling, one value per target token id);
* ``stage``: 0 for the engine's own verification; a cascade's inner verification uses 1, so the
  draft tokens it emits are independent of the outer verifier's draws (rejection sampling needs
  that); Gumbel verification shares ``NOISE`` across stages on purpose (``shared_noise``);
* ``sub``: which draw among several of one kind at one position (a tree's sibling nodes).

The key is hashed with a counter-based mixer (SplitMix64's finaliser; Steele, Lea and Flood 2014,
"Fast Splittable Pseudorandom Number Generators", the same construction as Philox's and threefry's
keyed counters: output = bijective mix(key + counter)) in int64 torch ops, vectorised over rows.
A scalar uniform is the top 53 bits of its key's hash. A noise vector over a vocabulary of V
tokens is, for V <= ``HASH_MAX_V``, the hash of every (key, token id) counter, vectorised over rows
and tokens; on a larger vocabulary it is the float32 uniforms of a Mersenne Twister seeded with the
key's hash (``torch.rand``: five times faster on CPU than hashing 150k counters, but it costs ~15 us
per key, which a batch of 200k rows of a small vocabulary cannot afford). Either is a pure function
of (key, V).

Gumbel-max: ``argmax(log w + g)`` with ``g = -log(-log U)`` is an exact sample of ``w / sum(w)``
(Gumbel 1954; Maddison et al. 2014, "A* Sampling"); it is computed as ``argmax(w / E)`` with
``E = -log U`` (standard exponentials), one log fewer and exact for zero weights (filtered tokens).
Because the noise is indexed by target token id, a drafter (with a reduced vocabulary too) that
takes the Gumbel-argmax of its own distribution reads the very noise the verifier reads.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdec.runtime.sequence import Sequence

ACCEPT, DRAFT, NOISE = 1, 2, 3
HASH_MAX_V = 2048  # noise vectors up to this vocabulary hash every counter (else: a keyed Mersenne Twister)

_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_SALT = (0x632BE59BD9B4E019, 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x14057B7EF767814F)


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 (wrapping arithmetic): a bijection with full avalanche."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def to_int64(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def hash_keys(seeds: Tensor, positions: Tensor, purpose: int, stage: int = 0, sub: Tensor | int = 0) -> Tensor:
    """(B,) int64 seeds, (B, n) positions -> (B, n) int64 hashed keys (one per draw)."""
    h = mix64(seeds[:, None] + _SALT[0])  # (B, 1)
    h = mix64(h + positions * _GOLDEN)  # (B, n)
    h = mix64(h + to_int64((purpose * 1024 + stage) * _GOLDEN + _SALT[1]))
    sub = torch.as_tensor(sub, dtype=torch.long, device=seeds.device)
    return mix64(h + (sub + 1) * _SALT[2])


_CACHE_BYTES = 64 << 20
_cache: OrderedDict[tuple[int, int], Tensor] = OrderedDict()


def _twister_noise(key: int, V: int) -> Tensor:
    """(V,) exponentials of a Mersenne Twister seeded with ``key``. The last few are cached (64 MiB):
    under Gumbel verification the drafter and the verifier read the same positions' noise."""
    hit = _cache.get((key, V))
    if hit is not None:
        _cache.move_to_end((key, V))
        return hit
    e = torch.rand(V, generator=torch.Generator().manual_seed(key & 0xFFFFFFFFFFFFFFFF)).log_().neg_()
    _cache[(key, V)] = e
    while len(_cache) * V * 4 > _CACHE_BYTES:
        _cache.popitem(last=False)
    return e


class RowKeys:
    """The keys of a batch's rows: each row's seed and the position of the next token it decides.

    ``base[b]`` is row b's next position (``Sequence.num_tokens``); callers address draws by an
    offset from it (the verification block's j-th position decides token ``base + j``).
    ``shared_noise``: ``NOISE`` ignores ``stage`` (Gumbel verification: every stage of a cascade
    reads the same noise at a position, which is what makes its drafts agree with the target's).
    """

    def __init__(self, seeds: Seq[int], base: Seq[int] | Tensor, device: torch.device | str = "cpu",
                 stage: int = 0, shared_noise: bool = False) -> None:
        self.device = torch.device(device)
        self.seeds = torch.tensor([to_int64(s) for s in seeds], dtype=torch.long, device=self.device)  # (B,)
        self.base = torch.as_tensor(base, dtype=torch.long).to(self.device).reshape(-1)  # (B,)
        if self.base.shape != self.seeds.shape:
            raise ValueError(f"{len(self.seeds)} seeds for {len(self.base)} positions")
        self.stage, self.shared_noise = stage, shared_noise

    @classmethod
    def from_seqs(cls, seqs: "Seq[Sequence]", device: torch.device | str = "cpu",
                  shared_noise: bool = False) -> "RowKeys":
        """The rows of running sequences; a cascade's draft runs carry their ``noise_stage``."""
        stages = {getattr(s, "noise_stage", 0) for s in seqs}
        if len(stages) > 1:
            raise ValueError("a batch mixes verification stages")
        return cls([s.seed for s in seqs], [s.num_tokens for s in seqs], device,
                   stages.pop() if stages else 0, shared_noise)

    @classmethod
    def independent(cls, rows: int, seed: int = 0, device: torch.device | str = "cpu") -> "RowKeys":
        """``rows`` rows with distinct seeds derived from ``seed``, all at position 0: independent
        draws for simulations (many rows, one law)."""
        new = object.__new__(RowKeys)
        new.device, new.stage, new.shared_noise = torch.device(device), 0, False
        new.seeds = mix64(torch.arange(rows, dtype=torch.long, device=new.device) + to_int64(seed * _GOLDEN))
        new.base = torch.zeros(rows, dtype=torch.long, device=new.device)
        return new

    def __len__(self) -> int:
        return self.seeds.shape[0]

    def advanced(self, n: Tensor | int) -> "RowKeys":
        """The same rows ``n`` positions further on (after emitting n tokens)."""
        new = object.__new__(RowKeys)
        new.device, new.seeds, new.stage, new.shared_noise = self.device, self.seeds, self.stage, self.shared_noise
        new.base = self.base + (n.to(self.device) if isinstance(n, Tensor) else n)
        return new

    def _offsets(self, offsets: Tensor | int) -> Tensor:
        if isinstance(offsets, int):
            return torch.arange(offsets, device=self.device).expand(len(self), offsets)
        return offsets.to(self.device).reshape(len(self), -1)

    def keys(self, offsets: Tensor | int, purpose: int, sub: Tensor | int = 0) -> Tensor:
        """(B, n) int64 keys at ``base + offsets`` (an int n: offsets 0..n-1)."""
        stage = 0 if purpose == NOISE and self.shared_noise else self.stage
        return hash_keys(self.seeds, self.base[:, None] + self._offsets(offsets), purpose, stage, sub)

    def uniform(self, offsets: Tensor | int, purpose: int, sub: Tensor | int = 0) -> Tensor:
        """(B, n) float64 uniforms in [0, 1), one per key."""
        bits = _srl(mix64(self.keys(offsets, purpose, sub)), 11)  # (B, n) 53 random bits
        return bits.to(torch.float64) * (1.0 / (1 << 53))

    def exponentials(self, offsets: Tensor, V: int, purpose: int = NOISE, rows: Tensor | None = None) -> Tensor:
        """(N, V) float32 standard exponentials E = -log U, row i keyed by the position ``base[rows[i]] +
        offsets[i]`` (``rows``: default every row, ``offsets`` then (B,)). Never 0 (U < 1), so
        ``w / E`` is never NaN; U = 0 gives E = inf, a token that cannot win."""
        rows = torch.arange(len(self), device=self.device) if rows is None else rows.to(self.device)
        pos = self.base[rows] + offsets.to(self.device).reshape(-1)  # (N,)
        stage = 0 if purpose == NOISE and self.shared_noise else self.stage
        keys = mix64(hash_keys(self.seeds[rows], pos[:, None], purpose, stage))  # (N, 1)
        if V <= HASH_MAX_V:
            bits = _srl(mix64(keys + torch.arange(V, device=self.device) * _GOLDEN), 40)  # (N, V) 24 bits
            out = bits.to(torch.float32) * (1.0 / (1 << 24))
        else:
            return torch.stack([_twister_noise(k, V) for k in keys[:, 0].tolist()]).to(self.device)
        return out.log_().neg_().to(self.device)  # U in [0, 1): E in (0, inf]

    def gumbel_argmax(self, weights: Tensor, offsets: Tensor | int = 0, purpose: int = NOISE,
                      rows: Tensor | None = None) -> Tensor:
        """(N, V) non-negative weights -> (N,) long: ``argmax(weights / E)``, the Gumbel-max sample of
        ``weights / sum(weights)`` with the noise of position ``base[rows] + offsets``. A row with one
        non-zero weight (greedy, a one-hot) returns it without drawing noise. All-zero rows: invalid."""
        N, V = weights.shape
        rows = torch.arange(len(self), device=self.device) if rows is None else rows.to(self.device)
        offsets = torch.as_tensor(offsets, dtype=torch.long, device=self.device).expand(N).clone()
        out = weights.argmax(-1)  # (N,)
        random = ((weights > 0).sum(-1) > 1).nonzero()[:, 0]  # rows with a choice to make
        if len(random):
            w = weights[random].to(torch.float32)
            e = self.exponentials(offsets[random], V, purpose, rows[random])  # (n, V)
            out[random] = (w / e).argmax(-1)
        return out

    def sample_cdf(self, weights: Tensor, offsets: Tensor | int = 0, purpose: int = DRAFT) -> Tensor:
        """(B, V) non-negative weights -> (B,) long by inverse CDF with one keyed uniform per row:
        cheaper than Gumbel-max where no other party must read the same noise (a drafter's sample
        under rejection sampling). The CDF is float64; a zero-weight token is never returned."""
        B, V = weights.shape
        offsets = torch.as_tensor(offsets, dtype=torch.long, device=self.device).expand(B).clone()
        u = self.uniform(offsets[:, None], purpose)  # (B, 1)
        cdf = weights.to(torch.float64).cumsum(-1)  # (B, V)
        total = cdf[:, -1:]  # (B, 1)
        below_total = torch.nextafter(total, torch.zeros_like(total))  # (B, 1)
        target = torch.minimum(u * total, below_total)  # (B, 1) strictly below the total mass
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=V - 1)
