"""The one module every weight matmul of a model goes through, and batch-invariant products.

Quantized weights (int8/int4 kernels) replace ``Linear`` with a module of the same call shape,
``y = layer(x)`` for ``x (..., in_features) -> (..., out_features)``, so the model code never changes.

Batch invariance. Speculative decoding is exact only if the target scores a token identically
whether it is verified alone, in a block of K+1, or beside other requests. On CPU, PyTorch's
bf16 product takes a different kernel for one row than for two or more (and fp32 for the rows
left over from a block of four), which changes the last bits. Every product here therefore runs with the row count
``padded_rows`` picks (padding with copies of the first row), and a row's result is then
bit-identical for any number of rows (tests/models/test_linear.py checks it). For bf16 the padded
product is also faster: 1.02 ms against 1.30 ms for an 8960x1536 matrix on this machine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

def padded_rows(m: int, dtype: torch.dtype) -> int:
    """Rows to compute for ``m`` real ones: bf16/fp16 take >= 2; fp32 a multiple of 4 (MKL's
    kernel for the rows left over from a block of 4 rounds differently)."""
    if dtype == torch.float32:
        return -(-m // 4) * 4
    return max(m, 2)


FP32_BLOCK = 4  # fp32 products of more rows run as 4-row products: past ~12 rows MKL (Intel Xeon) sums
# in another order than for 4, so a row's result would depend on the batch again


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x (..., M, N)`` with dim -2 grown to ``rows`` (if fewer) by repeating row 0."""
    m = x.shape[-2]
    if m >= rows:
        return x
    fill = x[..., :1, :].expand(*x.shape[:-2], rows - m, x.shape[-1])
    return torch.cat([x, fill], dim=-2)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (..., M, K) @ b (..., K, N)`` whose rows do not depend on M (see module docstring)."""
    m = a.shape[-2]
    if a.dtype == torch.float32 and m > FP32_BLOCK:
        return torch.cat([matmul(a[..., i:i + FP32_BLOCK, :], b) for i in range(0, m, FP32_BLOCK)], dim=-2)
    out = pad_rows(a, padded_rows(m, a.dtype)) @ b
    return out if out.shape[-2] == m else out[..., :m, :]


def can_pack() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (CPU builds with mkldnn do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model`` (see ``Linear.pack``); returns how many were packed."""
    return sum(mod.pack() for mod in model.modules() if isinstance(mod, Linear))


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored (out_features, in_features) as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    packed: torch.Tensor | None = None  # oneDNN-blocked copy of the weight (see ``pack``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        m = x2.shape[0]
        if x.dtype == torch.float32 and m > FP32_BLOCK:  # see FP32_BLOCK
            return torch.cat([self(x2[i:i + FP32_BLOCK]) for i in range(0, m, FP32_BLOCK)]).view(*lead, -1)
        x2 = pad_rows(x2, padded_rows(m, x.dtype))  # (M', in)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x2, self.weight, self.bias)  # (M', out)
        return y[:m].view(*lead, self.out_features)

    def pack(self) -> bool:
        """Re-lay the weight out in oneDNN's blocked format (CPU, bf16 only) and drop the original.

        On this machine an 8960x1536 product then reads its weight at 0.7 ms instead of
        1.0-1.3 ms, rows stay batch-invariant, and 2-16 rows cost about what 2 do.
        """
        w = self.weight
        if self.packed is not None or not (can_pack() and w.device.type == "cpu" and w.dtype == torch.bfloat16):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 2)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # frees the copy
        return True

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
