"""Quantized weights in the layout of ``csrc/qmm.c`` and the product ``y = x W^T`` on them.

A weight is unsigned 4- or 8-bit codes ``q`` with, per output column and group of 32 inputs, an
fp16 scale ``s`` and offset ``m``: ``W[n, k] = s * q + m``. That one form holds our own min/max
quantization, GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks exactly, and Q4_K's codes exactly with its
scale ``d * sc`` and offset ``-dmin * mn`` rounded to fp16 (within 2^-11 of the file's, not bit-exact;
``gguf_quant.py``).

``linear(x, w)`` quantizes each row of ``x`` to int8 per group of 32 (scale max|x|/127) and sums
integer group products: the native kernel when it is built (``specdec.kernels.library()``), else
``linear_reference``, which does the same arithmetic with PyTorch ops. Both are batch-invariant: a
row's result does not depend on the other rows or their number.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import kernels

GROUP = 32
TILE = 16
BITS = (4, 8)


@dataclass
class QWeight:
    """Packed codes ``data`` uint8 (tiles, K/32, 256|512) and ``scales`` fp16 (tiles, K/32, 2, 16)."""
    bits: int
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None  # fp32 (N,)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 2 * self.scales.numel() + (4 * self.bias.numel() if self.bias is not None else 0)


def check_shape(n: int, k: int) -> None:
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    if n <= 0:
        raise ValueError("out_features must be positive")


def quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantization per group of 32: ``w (N, K)`` -> codes uint8 (N, K), scale and offset
    fp16 (N, K/32), with the codes computed from the fp16-rounded scale and offset."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}")
    n, k = w.shape
    check_shape(n, k)
    levels = (1 << bits) - 1
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / levels).to(torch.float16)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # a constant group: codes 0
    offset = lo.to(torch.float16)
    codes = ((g - offset.float()[..., None]) / scale.float()[..., None]).round().clamp(0, levels)
    return codes.to(torch.uint8).reshape(n, k), scale, offset


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
         bias: torch.Tensor | None = None) -> QWeight:
    """Lay codes (N, K) and per-group scale/offset (N, K/32) out in 16-column tiles (see qmm.c)."""
    n, k = codes.shape
    check_shape(n, k)
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}")
    if int(codes.max()) >= (1 << bits):
        raise ValueError(f"codes do not fit in {bits} bits")
    g, t = k // GROUP, -(-n // TILE)
    pad = t * TILE - n
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    s = torch.nn.functional.pad(scale.to(torch.float16), (0, 0, 0, pad))
    m = torch.nn.functional.pad(offset.to(torch.float16), (0, 0, 0, pad))
    if bits == 4:
        q = c.reshape(t, TILE, g, 2, 4, 4)  # (tile, col, group, half, j, byte)
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # low nibble: inputs 4j+b, high: 16+4j+b
        data = q.permute(0, 2, 3, 1, 4).reshape(t, g, 256)
    else:
        data = c.reshape(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512)
    st = torch.stack([s.reshape(t, TILE, g).permute(0, 2, 1), m.reshape(t, TILE, g).permute(0, 2, 1)], dim=2)
    return QWeight(bits, n, k, data.contiguous(), st.contiguous(),
                   None if bias is None else bias.detach().float().contiguous())


def from_float(w: torch.Tensor, bits: int, bias: torch.Tensor | None = None, rows: int = 4096) -> QWeight:
    """``w (N, K)`` quantized and packed ``rows`` rows at a time (a multiple of ``TILE``): tiles are
    independent, so the result is the whole matrix's, while the fp32 temporaries stay at ``rows`` x K
    (a 151936-row LM head at once took 1.9 GB of transient memory)."""
    if rows % TILE:
        raise ValueError(f"rows must be a multiple of {TILE}")
    parts = [pack(*quantize(w[r:r + rows], bits), bits) for r in range(0, w.shape[0], rows)]
    if len(parts) == 1:
        data, scales = parts[0].data, parts[0].scales
    else:
        data, scales = torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts])
    return QWeight(bits, w.shape[0], w.shape[1], data, scales,
                   None if bias is None else bias.detach().float().contiguous())


def unpack(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: codes uint8 (N, K), scale and offset fp16 (N, K/32)."""
    t, g = w.data.shape[:2]
    if w.bits == 4:
        lo, hi = w.data.reshape(t, g, 4, TILE, 4) & 15, w.data.reshape(t, g, 4, TILE, 4) >> 4
        q = torch.stack([lo, hi], dim=2)  # (t, g, half, j, col, byte)
        codes = q.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, g * GROUP)
    else:
        codes = w.data.reshape(t, g, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t * TILE, g * GROUP)
    st = w.scales.permute(0, 3, 1, 2).reshape(t * TILE, g, 2)
    n = w.out_features
    return codes[:n], st[:n, :, 0], st[:n, :, 1]


def dequantize(w: QWeight) -> torch.Tensor:
    """The fp32 weights (N, K) the codes stand for."""
    codes, scale, offset = unpack(w)
    n, k = codes.shape
    q = codes.float().reshape(n, k // GROUP, GROUP)
    return (q * scale.float()[..., None] + offset.float()[..., None]).reshape(n, k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel does to activations, in PyTorch: bf16 ``x (M, K)`` -> int8 codes (M, K),
    scale ``a`` (M, K/32) and ``a * sum(codes)`` per group, bit for bit as ``sd_quantize_rows``."""
    m, k = x.shape
    g = x.to(torch.bfloat16).float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None])  # half to even, as the vector conversion
    a = amax / 127.0
    am = a * q.sum(-1)
    return q.to(torch.int8).reshape(m, k), a, am


def linear_reference(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype = torch.bfloat16,
                     chunk: int = 4096) -> torch.Tensor:
    """``x (M, K) -> (M, N)`` with the kernel's arithmetic in PyTorch (the always-correct fallback)."""
    m, k = x.shape
    xq, a, am = quantize_rows(x)
    g = k // GROUP
    xg = xq.float().reshape(m, g, GROUP).transpose(0, 1)  # (G, M, 32)
    codes, scale, offset = unpack(w)
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    for n0 in range(0, w.out_features, chunk):
        n1 = min(n0 + chunk, w.out_features)
        qg = codes[n0:n1].float().reshape(n1 - n0, g, GROUP).permute(1, 2, 0)  # (G, 32, n)
        dots = torch.bmm(xg, qg)  # (G, M, n): exact integers
        s, o = scale[n0:n1].float().t()[:, None, :], offset[n0:n1].float().t()[:, None, :]  # (G, 1, n)
        terms = o * am.t()[:, :, None] + dots * (s * a.t()[:, :, None])
        out[:, n0:n1] = terms.sum(0)
    if w.bias is not None:
        out += w.bias
    return out.to(out_dtype)


def linear(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x (M, K) -> (M, N)`` in ``out_dtype`` (bf16 or fp32): native kernel or the reference."""
    lib = kernels.library()
    if lib is None or x.device.type != "cpu":
        return linear_reference(x, w, out_dtype)
    xb = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
    m = xb.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32 if out_dtype == torch.float32 else torch.bfloat16)
    rc = lib.sd_linear(xb.data_ptr(), m, w.in_features, w.data.data_ptr(), w.scales.data_ptr(),
                       w.out_features, w.bits, w.bias.data_ptr() if w.bias is not None else None,
                       y.data_ptr(), int(y.dtype == torch.float32))
    if rc != 0:
        raise MemoryError("qmm: out of memory for the activation scratch")
    return y if y.dtype == out_dtype else y.to(out_dtype)

