"""Which cached slots each new token of a forward sees (the PyTorch path and the native one share it)."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def attention_mask(cache_pos: torch.Tensor, attn_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor:
    """Which of the slots ``[0, kv_len)`` each new token sees, ``(B, T, kv_len)`` bool, for tokens at
    cache slots ``cache_pos (B, T)`` and an optional ``attn_mask (B, T, W)`` (see ``Transformer.forward``)."""
    B, T = cache_pos.shape
    key_pos = torch.arange(kv_len, device=cache_pos.device)
    if attn_mask is None:
        return key_pos.view(1, 1, kv_len) <= cache_pos.view(B, T, 1)
    W = attn_mask.shape[-1]
    first = cache_pos[:, -1:] - (W - 1)  # (B, 1) the window's first slot
    mask = (key_pos.view(1, 1, kv_len) < first.view(B, 1, 1)).expand(B, T, kv_len).clone()
    window = first + torch.arange(W, device=cache_pos.device)  # (B, W)
    block = torch.zeros(B, T, kv_len, dtype=torch.bool, device=cache_pos.device)
    block.scatter_(2, window.view(B, 1, W).expand(B, T, W), attn_mask)
    return mask | block


def check_window(cache_pos: torch.Tensor, attn_mask: torch.Tensor) -> None:
    """Refuse an ``attn_mask (B, T, W)`` whose window reaches before slot 0 (``attention_mask``'s
    caller checks it: a host synchronization, kept out of the part a CUDA graph captures)."""
    W = attn_mask.shape[-1]
    if int(cache_pos[:, -1].min()) - (W - 1) < 0:
        raise ValueError(f"a {W}-slot attention window reaches before slot 0")


def sliding(mask: torch.Tensor, input_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``mask (B, 1, T, L)`` narrowed to a sliding window: a token at position p sees the keys of slots
    ``> p - window`` (transformers' ``kv_idx > q_idx - sliding_window``). Slots stand for positions: exact
    for chains, and for token trees whose depth is below the window (a tree's slots are never before
    its nodes' positions, so only a window shorter than the tree could let a far ancestor in)."""
    L = mask.shape[-1]
    keys = torch.arange(L, device=mask.device).view(1, 1, 1, L)
    B, T = input_pos.shape
    return mask & (keys > (input_pos.view(B, 1, T, 1) - window))


def first_slots(rows: torch.Tensor | None, cache_pos: torch.Tensor, chunks: Sequence = (), width: int = 0
                ) -> dict[int, int] | None:
    """Per row, the first slot of a forward, over all its parts: of ``cache_pos (B, T)`` of ``rows`` (None:
    0..B-1); of the ``width`` slots ending at each row's last one (a token tree's mask, which a drafter
    growing a tree over several calls widens over the nodes fed before: it reads them, and moves the kept
    path back to the tree's root after); of the prompt chunks riding the forward (``models.llama.PromptChunk``:
    ``row``, ``start``). ``KVCache.prepare_writes``'s ``since``; None where that is each row's first slot
    written (no chunk, no wider mask)."""
    B, T = cache_pos.shape
    if not chunks and width <= T:
        return None
    los = cache_pos.amin(1)
    if width > T:
        los = torch.minimum(los, cache_pos[:, -1] - (width - 1))
    first: dict[int, int] = {}
    ids = range(B) if rows is None else rows.tolist()
    for r, lo in [*zip(ids, los.tolist()), *((pc.row, pc.start) for pc in chunks)]:
        first[r] = min(first.get(r, lo), lo)
    return first
