"""Static KV cache addressed by position (gpt-fast style).

Row ``r`` of the cache holds one sequence; slot ``s`` holds the keys and values of the token at
position ``s``. A rejected draft needs no rollback: its slots lie beyond the sequence's current
length, every query masks keys past its own position, and the next step overwrites them.
"""
from __future__ import annotations

import torch

KV_BLOCK = 32  # attention reads keys in whole blocks of this many slots (see models.llama.attention)


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is ``(rows, n_kv_heads, max_len, head_dim)``."""

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        max_len = -(-max_len // KV_BLOCK) * KV_BLOCK
        shape = (n_layers, rows, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.rows = rows

    def write(self, layer: int, index: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v (B, H, T, D)`` at the slots named by ``index`` (from :meth:`slot_index`)."""
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def read(self, layer: int, rows: torch.Tensor | int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, length)`` of the given rows (an int B: rows 0..B-1)."""
        if isinstance(rows, int):
            return self.k[layer, :rows, :, :length], self.v[layer, :rows, :, :length]
        return self.k[layer, rows, :, :length], self.v[layer, rows, :, :length]

    def slot_index(self, rows: torch.Tensor | None, cache_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Index tuple for ``index_put_`` writing ``(B, H, T, D)`` values at ``cache_pos (B, T)``."""
        b, t = cache_pos.shape
        if rows is None:
            rows = torch.arange(b, device=cache_pos.device)
        n_heads = self.k.shape[2]
        heads = torch.arange(n_heads, device=cache_pos.device)
        return rows.view(b, 1, 1), heads.view(1, n_heads, 1), cache_pos.view(b, 1, t)

    def copy_from(self, other: "KVCache") -> None:
        """Take every row and slot of a smaller cache (growing one while requests run)."""
        self.k[:, :other.rows, :, :other.max_len] = other.k
        self.v[:, :other.rows, :, :other.max_len] = other.v

    def copy_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move slots ``src (B, N)`` to ``dst (B, N)`` in every layer (compacting an accepted tree path)."""
        r = rows.view(-1, 1)
        for cache in (self.k, self.v):
            vals = cache[:, r, :, src]  # (B, N, L, H, D): advanced indices first
            cache[:, r, :, dst] = vals
