"""The one module every weight matmul of a model goes through, and batch-invariant products.

Quantized weights (int8/int4 kernels) replace ``Linear`` with a module of the same call shape,
``y = layer(x)`` for ``x (..., in_features) -> (..., out_features)``, so the model code never changes.

Batch invariance. Speculative decoding is exact only if the target scores a token identically
whether it is verified alone, in a block of K+1, or beside other requests. On CPU, PyTorch's
bf16 product takes a different kernel for one row than for two or more (and fp32 for the rows
left over from a block of four), which changes the last bits. Every product here therefore runs with the row count
``padded_rows`` picks (padding with copies of the first row), and a row's result is then
bit-identical for any number of rows (tests/quant/test_linear.py checks it). For bf16 the padded
product is also faster: 1.02 ms against 1.30 ms for an 8960x1536 matrix on this machine.

Past a number of rows the libraries switch kernels again, and where depends on the CPU: on an Intel
Xeon (AVX-512) fp32 rows change past 12 and bf16 (oneDNN) rows past 32, while an AMD EPYC kept them
equal. Products of more rows than ``row_block`` therefore run as products of at most that many
rows. That costs a second read of the weights for a verification block of 33+ rows (batch x (K+1)),
so prompt prefill, whose products are path-independent anyway (every prompt is prefilled alone, the
same way, with or without speculation), opts out with ``whole_products`` (a 512-row bf16 product in
32-row pieces takes 2.35x as long on this machine).
"""
from __future__ import annotations

import functools

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specdec import kernels
from specdec.kernels import tiles

def padded_rows(m: int, dtype: torch.dtype, device: str = "cpu") -> int:
    """Rows to compute for ``m`` real ones: bf16/fp16 take >= 2; fp32 a multiple of 4 (MKL's
    kernel for the rows left over from a block of 4 rounds differently). On a GPU every product of a
    block runs with the block's full row count: cuBLAS picks its kernel (tiles, split-K) by the row
    count, so that is the one way to keep a row's bits, and a product of 32 rows costs a GPU about what
    one row does (it reads the same weights)."""
    block = row_block(dtype)
    if device != "cpu" and block is not None:
        return max(m, block)
    if dtype == torch.float32:
        return -(-m // 4) * 4
    return max(m, 2)


_BLOCKED: ContextVar[bool] = ContextVar("specdec_row_blocks", default=True)


def row_block(dtype: torch.dtype) -> int | None:
    """Most rows one batch-invariant product may have (see the module docstring); None: no limit."""
    if not _BLOCKED.get():
        return None
    return 4 if dtype == torch.float32 else 32


@functools.cache
def packed_row_block() -> int:
    """Most rows of one product on a oneDNN-packed bf16 weight: on a CPU with AMX, oneDNN takes another
    kernel for some blocks of 18 rows or more (an Intel Xeon with AMX, oneDNN in PyTorch 2.11: a row of
    an 18, 20, ..., 30 or 32+-row product differed from the same row alone; 1-17 and the odd counts up to
    31 agreed), so there the packed products run in blocks of 16; elsewhere ``row_block``'s 32."""
    from specdec.kernels import _cpu_flags  # noqa: PLC0415
    return 16 if "amx_bf16" in _cpu_flags() else 32


@contextmanager
def whole_products() -> Iterator[None]:
    """Products of any number of rows in one call (prompt prefill: faster, not batch-invariant)."""
    token = _BLOCKED.set(False)
    try:
        yield
    finally:
        _BLOCKED.reset(token)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x (..., M, N)`` with dim -2 grown to ``rows`` (if fewer) by repeating row 0."""
    m = x.shape[-2]
    if m >= rows:
        return x
    fill = x[..., :1, :].expand(*x.shape[:-2], rows - m, x.shape[-1])
    return torch.cat([x, fill], dim=-2)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (..., M, K) @ b (..., K, N)`` whose rows do not depend on M (see module docstring)."""
    m, block = a.shape[-2], row_block(a.dtype)
    if block is not None and m > block:
        return torch.cat([matmul(a[..., i:i + block, :], b) for i in range(0, m, block)], dim=-2)
    out = pad_rows(a, padded_rows(m, a.dtype, a.device.type)) @ b
    return out if out.shape[-2] == m else out[..., :m, :]


@functools.cache
def can_pack() -> bool:
    """Whether oneDNN's packed bf16 linear works here: a CPU build with mkldnn, on a CPU it accepts (its bf16
    path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU the reorder raises, so it is tried
    once on a small weight rather than assumed)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=torch.bfloat16), 2)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, native: bool = True) -> int:
    """Re-lay out every bf16 ``Linear`` of ``model`` for fast small products: the native tiles where the
    native kernels are built and ``native`` (``Linear.tile``), else oneDNN's blocked format
    (``Linear.pack``); returns how many were re-laid."""
    return sum((native and mod.tile()) or mod.pack() for mod in model.modules() if isinstance(mod, Linear))


def tile_bf16(w: torch.Tensor) -> torch.Tensor:
    """``w (N, K)`` bf16 -> the native kernel's layout ``(ceil(N/16), K/2, 16, 2)``: tiles of 16 output
    columns, each input pair of a column next to the same pair of the tile's other columns (one 64-byte
    load feeds one ``vdpbf16ps``; csrc/forward.c)."""
    n, k = w.shape
    t = -(-n // 16)
    wp = F.pad(w, (0, 0, 0, t * 16 - n)) if t * 16 != n else w
    return wp.reshape(t, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def untile_bf16(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``tile_bf16``: the ``(N, K)`` weight (a copy)."""
    t, p = tiled.shape[:2]
    return tiled.permute(0, 2, 1, 3).reshape(t * 16, 2 * p)[:n]


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
    tiled: torch.Tensor | None = None  # the native kernel's layout of the weight (see ``tile``)
    bias_f32: torch.Tensor | None = None  # the bias as the native kernel adds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if self.tiled is not None:
            if row_block(x.dtype) is None:  # prompt prefill: one large product, any kernel
                return F.linear(x2, untile_bf16(self.tiled, self.out_features), self.bias).view(*lead, -1)
            return tiles.matmul(self.tiled, self.out_features, self.in_features, self.bias_f32, x2).view(*lead, -1)
        m, block = x2.shape[0], row_block(x.dtype)
        if block is not None and self.packed is not None:
            block = min(block, packed_row_block())
        if block is not None and m > block:  # see row_block
            return torch.cat([self._rows(x2[i:i + block]) for i in range(0, m, block)]).view(*lead, -1)
        return self._rows(x2).view(*lead, self.out_features)

    def _rows(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 (M, in) -> (M, out)`` as one product of ``padded_rows(M)`` rows."""
        m = x2.shape[0]
        xp = pad_rows(x2, padded_rows(m, x2.dtype, x2.device.type))  # (M', in)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(xp, self.weight, self.bias)  # (M', out)
        return y if y.shape[0] == m else y[:m]

    def pack(self) -> bool:
        """Re-lay the weight out in oneDNN's blocked format (CPU, bf16 only) and drop the original.

        On this machine an 8960x1536 product then reads its weight at 0.7 ms instead of
        1.0-1.3 ms, rows stay batch-invariant, and 2-16 rows cost about what 2 do.
        """
        w = self.weight
        if self.packed is not None or self.tiled is not None or not (can_pack() and w.device.type == "cpu" and w.dtype == torch.bfloat16):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 2)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # frees the copy
        return True

    def dense_weight(self) -> torch.Tensor:
        """The ``(out, in)`` weight whatever its layout (a copy when re-laid for the native kernels)."""
        if self.tiled is not None:
            return untile_bf16(self.tiled, self.out_features)
        if self.packed is not None:
            raise ValueError("a oneDNN-packed weight cannot be read back")
        return self.weight.detach()

    def tile(self) -> bool:
        """Re-lay the weight out for the native small-block kernels (CPU, bf16, native library built,
        even in_features) and drop the original; results of any number of rows are batch-invariant.
        Prompt prefill (``whole_products``) rebuilds the plain weight per call (a copy, small next to a
        512-row product)."""
        w = self.weight
        if (self.tiled is not None or self.packed is not None or w.device.type != "cpu" or w.dtype != torch.bfloat16
                or self.in_features % 2 or w.numel() == 0 or kernels.library() is None):
            return False
        self.tiled = tile_bf16(w.detach())
        if self.bias is not None:
            self.bias_f32 = self.bias.detach().float().contiguous()
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # frees the copy
        return True

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
