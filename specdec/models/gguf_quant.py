"""GGUF quantized blocks straight into ``qmm.QWeight`` (codes + fp16 scale and offset per 32 inputs).

Bit-exact where the block type is an affine code per 32 inputs whose scale and offset are fp16 values
(``W = s * q + m``; each offset below is an fp16 field or the scale times a power of two, exact in fp16):

    Q4_0  W = d (q - 8)          4-bit      Q5_0  W = d (q - 16)      codes 0..31 in 8 bits
    Q4_1  W = d q + m            4-bit      Q5_1  W = d q + m         codes 0..31 in 8 bits
    Q8_0  W = d q, q signed      8-bit (q + 128, offset -128 d)

MXFP4 (gpt-oss's experts: 32 e2m1 values and one power-of-two scale ``2^(e-127)`` a block) is affine too:
each value is a whole number ``v`` of half-steps in -12..12 times ``2^(e-128)``, so ``W = s (q - 12)`` with
``q = v + 12`` in 8 bits and ``s = 2^(e-128)``: exact wherever ``s`` and ``12 s`` are fp16 values (scales
2^-24 .. 2^12, the weights' own range); a tensor with a block outside it stays a bf16 Linear.

Q4_K is close, not bit-exact: ``W = d sc q - dmin mn`` per 32-input sub-block keeps its 4-bit codes,
but ``d*sc`` and ``dmin*mn`` (an fp16 times a 6-bit integer: up to 17 significant bits) are rounded
to fp16 (relative error <= 2^-11 on the scale and offset, far below the 4-bit step).

Other types (Q6_K, Q5_K, Q3_K, Q2_K) are dequantized and re-coded with 8-bit min/max codes per 32
inputs, whose step is a quarter or less of the original's: close to the file, not bit-exact.
F32/F16/BF16 weights stay unquantized (bf16). Fused layers (q|k|v, gate|up) take the wider code
width of their parts (4-bit codes are valid 8-bit codes with the same scale and offset).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.models.gguf_file import column_order, open_gguf, row_order, tensor_plan

Codes = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # codes (N, K) u8, scale, offset (N, K/32) f16, bits


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (..., 2) bytes -> float32 (...)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs (..., 16)`` bytes -> 32 codes: element i < 16 in the low nibble of byte i, i >= 16 in the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _blocks(raw: np.ndarray, n: int, k: int, block: int, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(n, k // block, size)


def decode_q4_0(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 32, 18)
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]).reshape(n, k), d, -8 * d, 4


def decode_q4_1(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 32, 20)
    return _nibbles(b[..., 4:20]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4


def _q5_codes(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # (..., 1)
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # (..., 32)
    return _nibbles(qs) | (high.astype(np.uint8) << 4)


def decode_q5_0(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 32, 22)
    d = _f16(b[..., 0:2])
    return _q5_codes(b[..., 2:6], b[..., 6:22]).reshape(n, k), d, -16 * d, 8


def decode_q5_1(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 32, 24)
    return _q5_codes(b[..., 4:8], b[..., 8:24]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8


def decode_q8_0(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 32, 34)
    d = _f16(b[..., 0:2])
    codes = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes.reshape(n, k), d, -128 * d, 8


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs for its 8 sub-blocks -> two (..., 8) arrays."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode_q4_k(raw, n, k) -> Codes:
    b = _blocks(raw, n, k, 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (n, k/256)
    sc, mn = _k_scales(b[..., 4:16])  # (n, k/256, 8)
    qs = b[..., 16:144].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 inputs: low nibbles, then high
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, k // 32)
    offset = -(dmin[..., None] * mn).reshape(n, k // 32)
    return codes, scale, offset, 4


_E2M1_HALVES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)  # e2m1 x 2


def decode_mxfp4(raw, n, k) -> Codes | None:
    """MXFP4 blocks (a scale byte, 16 bytes of 4-bit e2m1 codes: element i < 16 in the low nibble of
    byte i) as 8-bit codes ``v + 12`` with scale ``2^(e-128)`` and offset ``-12`` scales; None when some
    block's scale is not exact in fp16 (a block of zeros takes any)."""
    b = _blocks(raw, n, k, 32, 17)
    halves = _E2M1_HALVES[_nibbles(b[..., 1:17])]  # (n, k/32, 32): values in half-steps of the scale
    e = b[..., 0].astype(np.int32)  # (n, k/32)
    if not (((e >= 128 - 24) & (e <= 128 + 12)) | ~halves.any(axis=-1)).all():
        return None
    scale = np.ldexp(np.float32(1.0), np.clip(e, 128 - 24, 128 + 12) - 128)  # a block of zeros: any scale
    codes = (halves + 12).astype(np.uint8).reshape(n, k)
    return codes, scale.astype(np.float32), (-12 * scale).astype(np.float32), 8


EXACT = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q5_0": decode_q5_0, "Q5_1": decode_q5_1,
         "Q8_0": decode_q8_0, "Q4_K": decode_q4_k, "MXFP4": decode_mxfp4}
UNQUANTIZED = ("F32", "F16", "BF16")


def decode(tensor) -> Codes | None:
    """A GGUF reader tensor of shape (N, K) (or one expert's: ``gguf_file.TensorRows``) -> codes, or None
    where our form does not hold it (an unquantized tensor; MXFP4 with a scale beyond fp16's)."""
    import gguf  # noqa: PLC0415
    k, n = (int(v) for v in tensor.shape[:2])
    kind = tensor.tensor_type.name
    if kind in UNQUANTIZED:
        return None
    if k % 32:
        raise SpecdecError(f"tensor {tensor.name}: {k} inputs are not a multiple of 32")
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n, -1)
    if kind in EXACT:
        out = EXACT[kind](raw, n, k)
        if out is None:
            return None
        c, s, o, bits = out
        return c, s.astype(np.float16), o.astype(np.float16), bits
    w = torch.from_numpy(np.asarray(gguf.dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(n, k))
    codes, scale, offset = qmm.quantize(w, 8)
    return codes.numpy(), scale.numpy(), offset.numpy(), 8


def _parts(qual: str, tied: bool, tensors: dict) -> list[str]:
    """The HF tensor names whose rows make our (possibly fused) linear ``qual``: the file's own fused
    tensor where it has one (Phi-3's ``attn_qkv`` and gate+up ``ffn_up``), else the parts (a Qwen3.5
    delta-net's ``in_proj``: its ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``)."""
    if qual.endswith(".linear_attn.in_proj"):
        return [f"model.{qual}_{p}.weight" for p in ("qkv", "z", "b", "a")]
    if qual.endswith(".qkv_proj") or qual.endswith(".gate_up_proj"):
        fused = f"model.{qual}.weight"
        if fused in tensors:
            return [fused]
        base, kind = qual.rsplit(".", 1)
        parts = "qkv" if kind == "qkv_proj" else ("gate", "up")
        return [f"model.{base}.{p}_proj.weight" for p in parts]
    if qual == "lm_head":
        return ["lm_head.weight"] + (["model.embed_tokens.weight"] if tied else [])
    return [f"model.{qual}.weight"]


def _in_place(name: str, codes: Codes, config: ModelConfig) -> Codes | None:
    """HF tensor ``name``'s codes with the rows and columns the family's converter moved put back, as the bf16
    conversion puts them (``gguf_file.row_order``, ``gguf_file.column_order``); None where a column order
    splits a block of 32 inputs (Qwen3.5's ``out_proj`` with value heads of a size not a multiple of 32)."""
    c, s, o, bits = codes
    rows = row_order(name, c.shape[0], config)
    if rows is not None:
        c, s, o = c[rows], s[rows], o[rows]
    columns = column_order(name, c.shape[1], config)
    if columns is not None:
        groups = columns.reshape(-1, 32)
        if not (groups == groups[:, :1] + np.arange(32)).all() or (groups[:, 0] % 32).any():
            return None
        blocks = groups[:, 0] // 32  # whole blocks move: their codes, scales and offsets together
        c, s, o = c[:, columns], s[:, blocks], o[:, blocks]
    return c, s, o, bits


def gguf_weights(path: Path, config: ModelConfig, linears: list[str]) -> dict[str, qmm.QWeight]:
    """QWeights for our linears (qualified names) from the GGUF file; unquantized ones are left out.

    The file's tensors are named, fused, un-permuted and reordered as the bf16 conversion does
    (``gguf_file.tensor_plan``, ``gguf_file.row_order``, ``gguf_file.column_order``): per family, from
    llama.cpp's names.
    """
    reader = open_gguf(path)
    tensors = dict(tensor_plan(reader, config))
    out = {}
    for qual in linears:
        names = _parts(qual, config.tie_word_embeddings, tensors)
        if qual == "lm_head":  # the file's own output head, else the tied embedding
            names = [next((n for n in names if n in tensors), names[0])]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise SpecdecError(f"'{path}' has no tensor for {missing[0]}: is it the file this model came from?")
        parts = [(n, decode(tensors[n])) for n in names]
        parts = [(n, None if p is None else _in_place(n, p, config)) for n, p in parts]
        if any(p is None for _, p in parts):
            continue
        bits = max(p[3] for _, p in parts)
        codes, scales, offsets = [], [], []
        for n, (c, s, o, _) in parts:
            codes.append(c)
            scales.append(s)
            offsets.append(o)
        out[qual] = qmm.pack(torch.from_numpy(np.concatenate(codes)), torch.from_numpy(np.concatenate(scales)),
                             torch.from_numpy(np.concatenate(offsets)), bits)
    return out
