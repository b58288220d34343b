"""GGUF quantized blocks straight into ``qmm.QWeight``: the file's own codes and scales, bit-exact.

Each block type goes to the scale format of ``qmm`` that holds it exactly (the weights equal the ``gguf``
package's ``dequantize`` of the tensor, bit for bit):

    Q4_0  W = d (q - 8)            AFFINE, 4-bit      Q5_0  W = d (q - 16)      AFFINE, codes 0..31 in 6 bits
    Q4_1  W = d q + m              AFFINE, 4-bit      Q5_1  W = d q + m         AFFINE, codes 0..31 in 6 bits
    Q8_0  W = d q, q signed        AFFINE, 8-bit (q + 128, offset -128 d)
    Q4_K  W = d sc q - dmin mn     KQUANT, 4-bit: fp16 d, dmin per 256 inputs, 6-bit sc, mn per 32
    Q5_K  the same, 5-bit codes    KQUANT, codes 0..31 in 6 bits
    Q6_K  W = d sc (q - 32)        HALVES, codes 0..63 in 6 bits: fp16 d per 256, s8 sc per 16 (dm = -32 d)

MXFP4 (gpt-oss's experts: 32 e2m1 values and one power-of-two scale ``2^(e-127)`` a block) is affine too:
each value is a whole number ``v`` of half-steps in -12..12 times ``2^(e-128)``, so ``W = s (q - 12)`` with
``q = v + 12`` in 8 bits and ``s = 2^(e-128)``: exact wherever ``s`` and ``12 s`` are fp16 values (scales
2^-24 .. 2^12, the weights' own range); a tensor with a block outside it stays a bf16 Linear.

Other types (Q2_K, Q3_K, the IQ types) are dequantized and re-coded with 8-bit min/max codes per 32
inputs (a step a quarter or less of the original's: close to the file, not bit-exact), and say so once per
load. F32/F16/BF16 weights stay unquantized (bf16). Fused layers (q|k|v, gate|up) take one format for
their parts: AFFINE parts the wider code width (narrower codes are valid wider codes with the same scale and
offset); Q4_K or Q5_K parts beside a Q6_K part go to HALVES, which holds them exactly (each half of a group
takes the group's sc and mn); AFFINE parts beside two-level ones are re-coded (said so too).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec import kernels
from specdec.kernels import hugepages, qmm
from specdec.formats.gguf_file import column_order, open_gguf, row_order, tensor_plan
from specdec.quant.qlinear import check_cpu, install, linear_names

Blocks = tuple[dict, int]  # per-row arrays as qmm.fields names them (numpy), and the code width


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (..., 2) bytes -> float16 (...), exactly the file's values."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs (..., 16)`` bytes -> 32 codes: element i < 16 in the low nibble of byte i, i >= 16 in the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _blocks(raw: np.ndarray, n: int, k: int, block: int, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(n, k // block, size)


def _affine(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> Blocks:
    return {"codes": codes, "scale": scale.astype(np.float16), "offset": offset.astype(np.float16)}, bits


def decode_q4_0(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 32, 18)
    d = _f16(b[..., 0:2]).astype(np.float32)
    return _affine(_nibbles(b[..., 2:18]).reshape(n, k), d, -8 * d, 4)


def decode_q4_1(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 32, 20)
    return _affine(_nibbles(b[..., 4:20]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4)


def _q5_codes(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # (..., 1)
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # (..., 32)
    return _nibbles(qs) | (high.astype(np.uint8) << 4)


def decode_q5_0(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 32, 22)
    d = _f16(b[..., 0:2]).astype(np.float32)
    return _affine(_q5_codes(b[..., 2:6], b[..., 6:22]).reshape(n, k), d, -16 * d, 6)


def decode_q5_1(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 32, 24)
    return _affine(_q5_codes(b[..., 4:8], b[..., 8:24]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 6)


def decode_q8_0(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 32, 34)
    d = _f16(b[..., 0:2]).astype(np.float32)
    codes = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return _affine(codes.reshape(n, k), d, -128 * d, 8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit (scale, min) pairs for their 8 sub-blocks -> two (..., 8) arrays."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _two_level_k(b: np.ndarray, n: int, k: int, codes: np.ndarray, bits: int) -> Blocks:
    """Q4_K / Q5_K: fp16 d and dmin (bytes 0-3) and the 12 bytes of scales of each super-block."""
    sc, mn = _k_scales(b[..., 4:16])  # (n, k/256, 8)
    return {"codes": codes, "d": _f16(b[..., 0:2]), "dm": -_f16(b[..., 2:4]),
            "sc": sc.reshape(n, k // 32), "mn": mn.reshape(n, k // 32)}, bits


def decode_q4_k(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 256, 144)
    qs = b[..., 16:144].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 inputs: low nibbles, then high
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)
    return _two_level_k(b, n, k, codes, 4)


def decode_q5_k(raw, n, k) -> Blocks:
    b = _blocks(raw, n, k, 256, 176)
    qh = b[..., 16:48].reshape(n, k // 256, 1, 32)  # bit j of byte l: the high bit of sub-block j's input l
    qs = b[..., 48:176].reshape(n, k // 256, 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    return _two_level_k(b, n, k, (low | (high << 4)).reshape(n, k), 6)


def decode_q6_k(raw, n, k) -> Blocks:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 s8 scales (one per 16 inputs), fp16 d."""
    b = _blocks(raw, n, k, 256, 210)
    ql = b[..., 0:128].reshape(n, k // 256, 2, 1, 64)
    low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(n, k // 256, 2, 128)
    qh = b[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(n, k // 256, 2, 128)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, k // 16)
    d = _f16(b[..., 208:210])
    return {"codes": (low | (high << 4)).reshape(n, k), "d": d, "dm": (d * np.float16(-32)).astype(np.float16),
            "sc": sc, "mn": sc.copy()}, 6


_E2M1_HALVES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)  # e2m1 x 2


def decode_mxfp4(raw, n, k) -> Blocks | None:
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
    return _affine(codes, scale.astype(np.float32), (-12 * scale).astype(np.float32), 8)


EXACT = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q5_0": decode_q5_0, "Q5_1": decode_q5_1,
         "Q8_0": decode_q8_0, "Q4_K": decode_q4_k, "Q5_K": decode_q5_k, "Q6_K": decode_q6_k,
         "MXFP4": decode_mxfp4}
UNQUANTIZED = ("F32", "F16", "BF16")


def _recode(w: np.ndarray) -> Blocks:
    """fp32 weights (N, K) -> our 8-bit min/max codes per 32 inputs (close to the file's, not exact)."""
    codes, scale, offset = qmm.quantize(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), 8)
    return {"codes": codes.numpy(), "scale": scale.numpy(), "offset": offset.numpy()}, 8


def decode(tensor, notes: set[str] | None = None) -> Blocks | None:
    """A GGUF reader tensor of shape (N, K) (or one expert's: ``gguf_file.TensorRows``) -> its blocks, or None
    where our form does not hold it (an unquantized tensor; MXFP4 with a scale beyond fp16's). A type
    re-coded adds its name to ``notes``."""
    import gguf  # noqa: PLC0415
    k, n = (int(v) for v in tensor.shape[:2])
    kind = tensor.tensor_type.name
    if kind in UNQUANTIZED:
        return None
    if k % 32:
        raise SpecdecError(f"tensor {tensor.name}: {k} inputs are not a multiple of 32")
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n, -1)
    if kind in EXACT:
        return EXACT[kind](raw, n, k)
    if notes is not None:
        notes.add(kind)
    return _recode(np.asarray(gguf.dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(n, k))


def dequantized(blocks: Blocks) -> np.ndarray:
    """The fp32 weights (N, K) of decoded blocks: ``qmm.dequantize`` of their packing."""
    return qmm.dequantize(pack(blocks)).numpy()


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


def _in_place(name: str, blocks: Blocks, config: ModelConfig) -> Blocks | None:
    """HF tensor ``name``'s blocks with the rows and columns the family's converter moved put back, as the bf16
    conversion puts them (``gguf_file.row_order``, ``gguf_file.column_order``); None where a column order
    splits a block (32 inputs, 256 for the two-level types: Qwen3.5's ``out_proj`` with value heads of a size
    not a multiple of it)."""
    f, bits = blocks
    rows = row_order(name, f["codes"].shape[0], config)
    if rows is not None:
        f = {key: v[rows] for key, v in f.items()}
    columns = column_order(name, f["codes"].shape[1], config)
    if columns is not None:
        size = 32 if "scale" in f else 256
        spans = columns.reshape(-1, size)
        if not (spans == spans[:, :1] + np.arange(size)).all() or (spans[:, 0] % size).any():
            return None
        moved = spans[:, 0] // size  # whole blocks move: their codes and scales together
        out = {"codes": f["codes"][:, columns]}
        for key, v in f.items():
            if key != "codes":
                per = v.shape[1] // len(moved)
                out[key] = v[:, (moved[:, None] * per + np.arange(per)).reshape(-1)]
        f = out
    return f, bits


def _to_halves(f: dict) -> dict:
    """KQUANT fields as HALVES (each half of a group takes the group's sc and mn): the same weights."""
    if f["sc"].shape[1] * 32 != f["codes"].shape[1]:
        return f
    return {"codes": f["codes"], "d": f["d"], "dm": f["dm"],
            "sc": np.repeat(f["sc"], 2, axis=1).astype(np.int8), "mn": np.repeat(f["mn"], 2, axis=1).astype(np.int8)}


def fuse(parts: list[Blocks], notes: set[str] | None = None) -> Blocks:
    """The parts of a fused linear (their rows stacked) in one format (the module docstring says which)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(b for _, b in parts)
    affine = ["scale" in f for f, _ in parts]
    if all(affine):
        fs = [f for f, _ in parts]
    elif not any(affine):
        halves = any(f["sc"].shape[1] * 32 != f["codes"].shape[1] for f, _ in parts)
        fs = [_to_halves(f) if halves else f for f, _ in parts]
        bits = 6 if halves else bits
    else:
        if notes is not None:
            notes.add("fused layers mixing per-32 and two-level types")
        return _recode(np.concatenate([dequantized(p) for p in parts]))
    return {key: np.concatenate([f[key] for f in fs]) for key in fs[0]}, bits


def pack(blocks: Blocks) -> qmm.QWeight:
    f, bits = blocks
    return qmm.from_fields({key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in f.items()}, bits)


# ggml's ids of the types the native repacking reads (csrc/repack.c), and those of them with two levels
_REPACK = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_TWO_LEVEL = ("Q4_K", "Q5_K", "Q6_K")


@dataclass
class _Repack:
    """One linear's rows as ``sd_repack`` lays them into tiles: the rows' addresses in the file's map and their
    ggml types, the output's shapes, and the arrays that keep the map's pages referenced until it runs (``mapped``:
    those that are the map's own pages, not copies)."""

    addr: np.ndarray
    kind: np.ndarray
    k: int
    fmt: int
    bits: int
    data: tuple[int, ...]
    scales: tuple[tuple[int, ...], torch.dtype]
    keep: list
    mapped: list

    @property
    def nbytes(self) -> int:
        """What its two tensors take of a huge-page arena."""
        shape, dtype = self.scales
        return hugepages.padded(math.prod(self.data)) + hugepages.padded(math.prod(shape) * dtype.itemsize)

    def run(self, take=None) -> qmm.QWeight | None:
        """The tiles, in tensors from ``take(shape, dtype)`` (default ``torch.empty``: a huge-page arena's
        ``take`` puts them where the forward streams them from, no copy later); None where the native repacking
        refuses."""
        take = take or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        data, st = take(self.data, torch.uint8), take(*self.scales)
        n = len(self.addr)
        if kernels.library().sd_repack(self.addr.ctypes.data, self.kind.ctypes.data, n, self.k, self.fmt, self.bits,
                                       data.data_ptr(), st.data_ptr()) != 0:
            return None
        for raw in self.mapped:
            _release(raw)
        return qmm.QWeight(self.bits, n, self.k, data, st, None, self.fmt)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _of_a_file_map(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a read-only file map (the reader's ``mmap.ACCESS_READ``), not of memory
    of our own."""
    b = a
    while isinstance(b, np.ndarray):
        b = b.base
    if isinstance(b, memoryview):
        b = b.obj
    return isinstance(b, mmap.mmap) and b.closed is False and not a.flags.writeable


def _release(raw: np.ndarray) -> None:
    """Take the file's pages behind ``raw`` (a view of the reader's read-only map) out of this process's
    resident set once their rows are repacked (Linux's MADV_DONTNEED: the page cache keeps them, a later read
    faults them in again): without it a load holds the whole file's pages beside the tiles made of them
    (the 1.5B: 1.1 GB more at the peak)."""
    if _LIBC is None:
        return
    page = mmap.PAGESIZE
    lo = -(-raw.ctypes.data // page) * page
    hi = (raw.ctypes.data + raw.nbytes) // page * page
    if hi > lo:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED; a failure costs memory only


def _repack_plan(parts: list[tuple[str, object]], config: ModelConfig) -> _Repack | None:
    """How the native ``sd_repack`` lays the parts' rows (HF names and reader tensors) into tiles straight from
    the file's map; None where it does not apply (no native kernels, another type, per-32 and two-level parts
    together, columns the converter moved)."""
    lib = kernels.library()
    kinds = [t.tensor_type.name for _, t in parts]
    if lib is None or any(kind not in _REPACK for kind in kinds):
        return None
    two = [kind in _TWO_LEVEL for kind in kinds]
    k = int(parts[0][1].shape[0])
    if any(two) != all(two) or k % (256 if all(two) else 32):
        return None
    if any(column_order(name, k, config) is not None for name, _ in parts):
        return None
    if all(two):
        fmt = qmm.HALVES if "Q6_K" in kinds else qmm.KQUANT
        bits = 4 if all(kind == "Q4_K" for kind in kinds) else 6
    else:
        fmt = qmm.AFFINE
        bits = 4 if all(kind in ("Q4_0", "Q4_1") for kind in kinds) else 8 if "Q8_0" in kinds else 6
    addrs, types, keep, mapped = [], [], [], []
    for name, t in parts:
        n = int(t.shape[1])
        raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
        if raw.flags.c_contiguous and _of_a_file_map(raw):
            mapped.append(raw)  # (a copy's pages must not be dropped: they would read back as zeros)
        elif not raw.flags.c_contiguous:
            raw = np.ascontiguousarray(raw)
        keep.append(raw)
        order = row_order(name, n, config)
        idx = np.arange(n, dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
        addrs.append(raw.ctypes.data + idx * raw.shape[1])
        types.append(np.full(n, _REPACK[t.tensor_type.name], np.int8))
    addr, kind = np.concatenate(addrs).astype(np.uint64), np.concatenate(types)
    tiles, g = -(-len(addr) // qmm.TILE), k // qmm.GROUP
    if fmt == qmm.AFFINE:
        scales = ((tiles, g, 2, qmm.TILE), torch.float16)
    else:
        scales = ((tiles, k // qmm.SUPER, 320 if fmt == qmm.KQUANT else 576), torch.uint8)
    return _Repack(addr, kind, k, fmt, bits, (tiles, g, {4: 256, 6: 384, 8: 512}[bits]), scales, keep, mapped)


def _repacked(parts: list[tuple[str, object]], config: ModelConfig) -> qmm.QWeight | None:
    """The parts' rows laid into tiles by the native ``sd_repack`` straight from the file's map (``_repack_plan``):
    the same bytes as ``pack(fuse(decoded parts))`` (tests/formats/test_gguf_blocks.py checks), a few seconds for a
    1.5B model instead of a minute; None where it does not apply."""
    plan = _repack_plan(parts, config)
    return None if plan is None else plan.run()


def gguf_weights(path: Path, config: ModelConfig, linears: list[str],
                 notes: set[str] | None = None, reader=None) -> dict[str, qmm.QWeight]:
    """QWeights for our linears (qualified names) from the GGUF file (``reader``: the file opened already, if
    it is); unquantized ones are left out. The block types re-coded rather than kept (not exact) are added to
    ``notes``.

    The file's tensors are named, fused, un-permuted and reordered as the bf16 conversion does
    (``gguf_file.tensor_plan``, ``gguf_file.row_order``, ``gguf_file.column_order``): per family, from
    llama.cpp's names.
    """
    reader = reader if reader is not None else open_gguf(path)
    tensors = dict(tensor_plan(reader, config))
    wanted = {}
    for qual in linears:
        names = _parts(qual, config.tie_word_embeddings, tensors)
        if qual == "lm_head":  # the file's own output head, else the tied embedding
            names = [next((n for n in names if n in tensors), names[0])]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise SpecdecError(f"'{path}' has no tensor for {missing[0]}: is it the file this model came from?")
        wanted[qual] = names
    plans = {qual: _repack_plan([(n, tensors[n]) for n in names], config) for qual, names in wanted.items()}
    # the tiles straight onto huge pages, where the forward streams them from (hugepages.rehome then moves nothing)
    arena = hugepages.arena(sum(p.nbytes for p in plans.values() if p is not None))
    out = {}
    for qual, names in wanted.items():
        fast = None if plans[qual] is None else plans[qual].run(arena and arena.take)
        plans[qual] = None  # its references to the map's pages go
        if fast is not None:
            out[qual] = fast
            continue
        parts = [(n, decode(tensors[n], notes)) for n in names]
        parts = [None if p is None else _in_place(n, p, config) for n, p in parts]
        if any(p is None for p in parts):
            continue
        fused = fuse(parts, notes)
        if "d" in fused[0] and fused[0]["codes"].shape[1] % qmm.SUPER:
            continue  # not whole super-blocks (cannot be: the file's own type needs them)
        out[qual] = pack(fused)
    return out


def quantize_from_file(model, gguf_path: str | Path) -> int:
    """``quantization="gguf"``: the model's linears replaced by the blocks of ``gguf_path`` (the file the model was
    converted from), exact where our form holds them (``quant.qlinear.install``); returns how many."""
    check_cpu(model, "gguf")
    return install(model, gguf_weights(Path(gguf_path), model.config, linear_names(model)))
