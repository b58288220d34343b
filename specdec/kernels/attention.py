"""Attention over the paged KV cache on the native kernel (``csrc/attention.c``), read in place
through the block table.

``cached_attention`` returns None where the kernel does not apply (no native library, not bf16 on
the CPU, a head size it does not take): the caller then runs ``models.llama.attention``. Both are
batch-invariant; their results differ in the last bits (another exp and summation order), which is
fine because a model always takes the same one for a given dtype and machine.
"""
from __future__ import annotations

import torch

from specdec import kernels


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor | None, mask: torch.Tensor, scale: float) -> torch.Tensor | None:
    """``q (B, nh, T, hd)``, one layer's paged cache ``(blocks, nkv, block, hd)`` with its block
    ``table (table rows, max_blocks)``, table ``rows (B,)`` (None: 0..B-1), ``mask (B, 1, T, L)`` bool
    -> ``(B, T, nh * hd)``, or None (use the PyTorch path)."""
    lib = kernels.library()
    if (lib is None or q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or q.device.type != "cpu"
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return None
    B, nh, T, hd = q.shape
    nkv, block = k_cache.shape[1], k_cache.shape[2]
    L = mask.shape[-1]
    if hd % 16 or hd > 256 or nh % nkv or nh // nkv > 16 or block & (block - 1):
        return None
    q = q.contiguous()
    m = mask.reshape(B, T, L).contiguous().view(torch.uint8)
    r = torch.arange(B, dtype=torch.int64) if rows is None else rows.to(torch.int64).contiguous()
    tab = table.contiguous()
    out = torch.empty(B, T, nh * hd, dtype=torch.bfloat16)
    rc = lib.sd_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tab.data_ptr(), r.data_ptr(),
                          m.data_ptr(), out.data_ptr(), B, nh, nkv, T, hd, L, tab.shape[1], block.bit_length() - 1,
                          scale)
    if rc == -2:
        raise MemoryError("attention: out of memory for the score buffer")
    return out if rc == 0 else None
