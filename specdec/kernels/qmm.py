"""Quantized weights in the layout of ``csrc/qmm.c`` and the product ``y = x W^T`` on them.

A weight is unsigned 4- or 8-bit codes ``q`` with, per output column and group of inputs, a scale ``s``
and an offset ``m``: ``W[n, k] = s * q + m``. Three formats of the scales (``QWeight.fmt``), each exact
for the GGUF blocks it holds:

    AFFINE  (1)  fp16 s, m per group of 32: our own min/max codes, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4
    KQUANT  (2)  two levels, as Q4_K and Q5_K: fp16 d, dm per 256 inputs, u8 sc, mn per 32: s = d sc,
                 m = dm mn (Q4_K: dm = -dmin)
    HALVES  (3)  two levels on halves of 16, as Q6_K: fp16 d, dm per 256, s8 sc, mn per 16 (Q6_K: dm = -32 d,
                 mn = sc, so W = d sc (q - 32)); codes below 64 packed in 6 bits (the file's size) or in 8. Q4_K and Q5_K blocks fit it too, which
                 is how a fused layer of Q4_K and Q6_K parts (q|k|v) stays exact.

In every format the products of an fp16 and a small integer are exact in fp32, so the weights are the
file's, bit for bit as the ``gguf`` package dequantizes them (``gguf_blocks.py``).

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
BITS = (4, 8)  # our own min/max codes
PACKED_BITS = (4, 6, 8)  # the code widths the kernels read (6: codes below 64, a file's 5- and 6-bit types)
SUPER = 256  # inputs per super-block of the two-level formats
AFFINE, KQUANT, HALVES = 1, 2, 3
FORMATS = {AFFINE: "affine", KQUANT: "kquant", HALVES: "halves"}


@dataclass
class QWeight:
    """Packed codes ``data`` uint8 (tiles, K/32, 256|384|512: 4, 6 or 8 bits) and ``scales``: AFFINE fp16 (tiles, K/32, 2, 16);
    KQUANT uint8 (tiles, K/256, 320); HALVES uint8 (tiles, K/256, 576) (``qmm.c`` says the bytes)."""
    bits: int
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None  # fp32 (N,)
    fmt: int = AFFINE

    @property
    def nbytes(self) -> int:
        return (self.data.numel() + self.scales.numel() * self.scales.element_size()
                + (4 * self.bias.numel() if self.bias is not None else 0))


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
    _check_bits(codes, bits)
    g, t = k // GROUP, -(-n // TILE)
    s, m = _pad_rows(scale.to(torch.float16), t), _pad_rows(offset.to(torch.float16), t)
    st = torch.stack([s.reshape(t, TILE, g).permute(0, 2, 1), m.reshape(t, TILE, g).permute(0, 2, 1)], dim=2)
    return QWeight(bits, n, k, _tile_codes(codes, bits), st.contiguous(), _bias(bias))


def _check_bits(codes: torch.Tensor, bits: int) -> None:
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}")
    if int(codes.max()) >= (1 << bits):
        raise ValueError(f"codes do not fit in {bits} bits")


def _pad_rows(x: torch.Tensor, tiles: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, tiles * TILE - x.shape[0]))


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


def _tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (N, K) -> (tiles, K/32, 256|384|512) bytes: lane c of vector j holds 4 consecutive inputs of
    column c (4-bit: inputs 4j+b in the low nibble, 16+4j+b in the high; 6-bit: the 4-bit layout of the low
    nibbles, then two vectors whose byte (c, b) holds the high bit pairs of inputs 16i+4j+b at bits 2j)."""
    n, k = codes.shape
    g, t = k // GROUP, -(-n // TILE)
    c = _pad_rows(codes.to(torch.uint8), t)
    if bits in (4, 6):
        q = (c & 15).reshape(t, TILE, g, 2, 4, 4)  # (tile, col, group, half, j, byte)
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # low nibble: inputs 4j+b, high: 16+4j+b
        nib = q.permute(0, 2, 3, 1, 4).reshape(t, g, 256)
        if bits == 4:
            return nib.contiguous()
        hi = (c >> 4).reshape(t, TILE, g, 2, 4, 4)  # (tile, col, group, i, j, byte)
        packed = hi[:, :, :, :, 0] | (hi[:, :, :, :, 1] << 2) | (hi[:, :, :, :, 2] << 4) | (hi[:, :, :, :, 3] << 6)
        return torch.cat([nib, packed.permute(0, 2, 3, 1, 4).reshape(t, g, 128)], dim=-1).contiguous()
    return c.reshape(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512).contiguous()


def _untile_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_tile_codes``: (tiles * 16, K) codes (the padded columns included)."""
    t, g = data.shape[:2]
    if bits in (4, 6):
        nib = data[..., :256]
        lo, hi = nib.reshape(t, g, 4, TILE, 4) & 15, nib.reshape(t, g, 4, TILE, 4) >> 4
        q = torch.stack([lo, hi], dim=2)  # (t, g, half, j, col, byte)
        codes = q.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, g * GROUP)
        if bits == 6:
            h = data[..., 256:].reshape(t, g, 2, TILE, 4)  # (t, g, i, col, byte)
            pairs = torch.stack([(h >> (2 * j)) & 3 for j in range(4)], dim=3)  # (t, g, i, j, col, byte)
            codes = codes | (pairs.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, g * GROUP) << 4)
        return codes
    return data.reshape(t, g, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t * TILE, g * GROUP)


def _per_tile(x: torch.Tensor, t: int, sub: int) -> torch.Tensor:
    """Per-column values (N, S * sub) -> (tiles, S, sub, 16): the 16 columns of a tile last."""
    w = x.shape[1]
    return _pad_rows(x, t).reshape(t, TILE, w // sub, sub).permute(0, 2, 3, 1)


def _from_tile(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_per_tile``: (tiles, S, sub, 16) -> (n, S * sub)."""
    t, s, sub, _ = x.shape
    return x.permute(0, 3, 1, 2).reshape(t * TILE, s * sub)[:n]


def pack_two_level(codes: torch.Tensor, d: torch.Tensor, dm: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                   bits: int, bias: torch.Tensor | None = None) -> QWeight:
    """Two-level scales exactly as the file's: ``d``, ``dm`` fp16 (N, K/256); ``sc``, ``mn`` per group of
    32 (u8, (N, K/32): format KQUANT) or per 16 (s8, (N, K/16): format HALVES, codes below 64 packed in 6 bits,
    or in 8)."""
    n, k = codes.shape
    check_shape(n, k)
    if k % SUPER:
        raise ValueError(f"in_features {k} is not a multiple of {SUPER}")
    halves = sc.shape[1] == 2 * (k // GROUP)
    if halves and (bits == 4 or int(codes.max()) >= 64):
        raise ValueError("format HALVES takes codes below 64, in 6 or 8 bits")
    _check_bits(codes, bits)
    t, nsb = -(-n // TILE), k // SUPER
    small = torch.int8 if halves else torch.uint8
    per = 16 if halves else 8  # small values per super-block and column
    dd = _per_tile(d.to(torch.float16).contiguous().view(torch.int16), t, 1).reshape(t, nsb, 16)
    mm = _per_tile(dm.to(torch.float16).contiguous().view(torch.int16), t, 1).reshape(t, nsb, 16)
    scs = _per_tile(sc.to(small), t, per).reshape(t, nsb, 8, per // 8, 16)  # (tile, sb, group, half, col)
    mns = _per_tile(mn.to(small), t, per).reshape(t, nsb, 8, per // 8, 16)
    tail = torch.stack([scs, mns], dim=3).reshape(t, nsb, 32 * per).contiguous().view(torch.uint8)
    head = torch.cat([dd, mm], dim=-1).contiguous().view(torch.uint8)  # (t, nsb, 64)
    st = torch.cat([head, tail], dim=-1).contiguous()
    return QWeight(bits, n, k, _tile_codes(codes, bits), st, _bias(bias), HALVES if halves else KQUANT)


def fields(w: QWeight) -> dict[str, torch.Tensor]:
    """The per-column arrays ``w`` was packed from: codes (N, K) and AFFINE's scale, offset (fp16, (N, K/32))
    or the two-level formats' d, dm (fp16, (N, K/256)), sc, mn ((N, K/32) u8 or (N, K/16) s8)."""
    n = w.out_features
    codes = _untile_codes(w.data, w.bits)[:n]
    if w.fmt == AFFINE:
        t, g = w.scales.shape[:2]
        st = w.scales.permute(0, 3, 1, 2).reshape(t * TILE, g, 2)
        return {"codes": codes, "scale": st[:n, :, 0], "offset": st[:n, :, 1]}
    t, nsb = w.scales.shape[:2]
    per = 16 if w.fmt == HALVES else 8
    head = w.scales[..., :64].contiguous().view(torch.float16).reshape(t, nsb, 2, 1, 16)
    small = w.scales[..., 64:].contiguous().view(torch.int8 if w.fmt == HALVES else torch.uint8)
    small = small.reshape(t, nsb, 8, 2, per // 8, 16)  # (tile, sb, group, sc|mn, half, col)
    return {"codes": codes, "d": _from_tile(head[:, :, 0], n), "dm": _from_tile(head[:, :, 1], n),
            "sc": _from_tile(small[:, :, :, 0].reshape(t, nsb, per, 16), n),
            "mn": _from_tile(small[:, :, :, 1].reshape(t, nsb, per, 16), n)}


def from_fields(f: dict[str, torch.Tensor], bits: int, bias: torch.Tensor | None = None) -> QWeight:
    """Inverse of ``fields``: the format follows from the arrays given."""
    if "scale" in f:
        return pack(f["codes"], f["scale"], f["offset"], bits, bias)
    return pack_two_level(f["codes"], f["d"], f["dm"], f["sc"], f["mn"], bits, bias)


def select_rows(w: QWeight, rows: torch.Tensor) -> QWeight:
    """The output columns ``rows`` of ``w`` (e.g. a cut LM head), in the same format."""
    f = {key: v[rows] for key, v in fields(w).items()}
    return from_fields(f, w.bits, None if w.bias is None else w.bias[rows])


def group_params(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """codes (N, K) and fp32 scale and offset per group of ``gs`` inputs (32, or 16 for HALVES), as
    ``W = scale * q + offset``: the two levels' products, exact in fp32."""
    f = fields(w)
    if w.fmt == AFFINE:
        return f["codes"], f["scale"].float(), f["offset"].float(), GROUP
    per = f["sc"].shape[1] // f["d"].shape[1]  # small values per super-block
    d = f["d"].float().repeat_interleave(per, dim=1)
    dm = f["dm"].float().repeat_interleave(per, dim=1)
    return f["codes"], d * f["sc"].float(), dm * f["mn"].float(), SUPER // per


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
    """Inverse of ``pack`` (format AFFINE): codes uint8 (N, K), scale and offset fp16 (N, K/32)."""
    if w.fmt != AFFINE:
        raise ValueError(f"unpack takes format AFFINE, not {FORMATS[w.fmt]}: use fields()")
    f = fields(w)
    return f["codes"], f["scale"], f["offset"]


def dequantize(w: QWeight) -> torch.Tensor:
    """The fp32 weights (N, K) the codes stand for: ``scale * q + offset`` per group, in fp32."""
    codes, scale, offset, gs = group_params(w)
    n, k = codes.shape
    q = codes.float().reshape(n, k // gs, gs)
    return (q * scale[..., None] + offset[..., None]).reshape(n, k)


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
    codes, scale, offset, gs = group_params(w)
    g = k // gs
    if gs != GROUP:  # halves: each half's own sum of codes, the row's scale repeated
        a = a.repeat_interleave(GROUP // gs, dim=1)
        am = a * xq.float().reshape(m, g, gs).sum(-1)
    xg = xq.float().reshape(m, g, gs).transpose(0, 1)  # (G, M, gs)
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    for n0 in range(0, w.out_features, chunk):
        n1 = min(n0 + chunk, w.out_features)
        qg = codes[n0:n1].float().reshape(n1 - n0, g, gs).permute(1, 2, 0)  # (G, gs, n)
        dots = torch.bmm(xg, qg)  # (G, M, n): exact integers
        s, o = scale[n0:n1].t()[:, None, :], offset[n0:n1].t()[:, None, :]  # (G, 1, n)
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
                       w.out_features, w.bits, w.fmt, w.bias.data_ptr() if w.bias is not None else None,
                       y.data_ptr(), int(y.dtype == torch.float32))
    if rc != 0:
        raise MemoryError("qmm: out of memory for the activation scratch")
    return y if y.dtype == out_dtype else y.to(out_dtype)

