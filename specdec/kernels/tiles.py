"""The bf16 product on the native tiles (``csrc/forward.c``'s ``sd_matmul``): ``y = x W^T (+ b)`` for a
weight re-laid by ``quant.linear.tile_bf16``, batch-invariant for any number of rows.

``Mat`` is the kernels' view of one weight matrix (``sd_mat``), shared with ``models.native``.
"""
from __future__ import annotations

import ctypes

import torch

from specdec import kernels

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class Mat(ctypes.Structure):
    """``sd_mat``: one weight matrix as the kernels read it (kind 0: bf16 tiles, 1: quantized codes)."""
    _fields_ = [("kind", _i64), ("bits", _i64), ("N", _i64), ("K", _i64), ("w", _p), ("st", _p), ("bias", _p)]


def bf16_mat(tiled: torch.Tensor, out_features: int, in_features: int, bias_f32: torch.Tensor | None) -> Mat:
    return Mat(0, 16, out_features, in_features, tiled.data_ptr(), None,
               bias_f32.data_ptr() if bias_f32 is not None else None)


def matmul(tiled: torch.Tensor, out_features: int, in_features: int, bias_f32: torch.Tensor | None,
           x: torch.Tensor) -> torch.Tensor:
    """``x (M, in) @ W^T (+ b)``, bf16 out (in ``x``'s dtype if another)."""
    lib = kernels.library()
    xb = x.to(torch.bfloat16).contiguous()
    m = bf16_mat(tiled, out_features, in_features, bias_f32)
    y = torch.empty(xb.shape[0], out_features, dtype=torch.bfloat16)
    rc = lib.sd_matmul(ctypes.byref(m), xb.data_ptr(), xb.shape[0], y.data_ptr(), 0, None, 0)
    if rc == -4:
        raise MemoryError("native product: out of memory for a thread's scratch (rows widened to fp32)")
    if rc != 0:
        raise RuntimeError(f"native product failed ({rc})")
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
