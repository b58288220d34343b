"""A GGUF file's metadata and tensor table read in a fraction of a second, its tensors as views of its map.

The ``gguf`` package's ``GGUFReader`` builds a NumPy view for every part of every metadata value: for a
151,936-token vocabulary and its merges that is 900,000 views, 3 to 17 seconds before a model can start.
This reader parses the same format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md: a header, the
key/value pairs, the tensor infos, the aligned data) with ``struct`` over the memory map and keeps arrays of
strings as offsets until asked, so a model whose weights come straight from the file starts in seconds.

It offers what specdec reads of a ``GGUFReader``: ``get_field(key).contents()``, ``tensors`` (``name``,
``tensor_type``, ``shape``, ``n_elements``, ``n_bytes``, ``data_offset``, ``data``: the same dtypes and
shapes as gguf's reader gives) and ``path``; tests/formats/test_gguf_reading.py holds it against gguf's.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_FLOAT_DATA = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass
class Field:
    """One metadata value, decoded on ``contents()``: a number, a str, or a list of either."""
    buf: memoryview
    kind: int
    offset: int  # where the value starts (for an array: its element type)

    def contents(self) -> Any:
        value, _ = _value(self.buf, self.kind, self.offset)
        return value

    def count(self) -> int:
        """The number of elements of an array (1 for a single value), nothing decoded."""
        return struct.unpack_from("<IQ", self.buf, self.offset)[1] if self.kind == 9 else 1

    def string_indexes(self, texts: list[str]) -> dict[str, int]:
        """Where each of ``texts`` first stands in this array of strings, those found, by one walk over the
        lengths that decodes nothing (a vocabulary of 152k strings: a fraction of ``contents()``'s time)."""
        item, count = struct.unpack_from("<IQ", self.buf, self.offset) if self.kind == 9 else (None, 0)
        if item != 8:
            raise ValueError("not an array of strings")
        want = {t.encode("utf-8"): t for t in texts}
        sizes = {len(b) for b in want}
        found: dict[str, int] = {}
        off, buf = self.offset + 12, self.buf
        for i in range(count):
            (n,) = struct.unpack_from("<Q", buf, off)
            if n in sizes:
                text = want.get(bytes(buf[off + 8:off + 8 + n]))
                if text is not None and text not in found:
                    found[text] = i
                    if len(found) == len(want):
                        break
            off += 8 + n
        return found


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


def _string(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    end = off + 8 + n
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return bytes(buf[off + 8:end]).decode("utf-8", errors="replace"), end


def _skip(buf: memoryview, kind: int, off: int) -> int:
    """The offset just past a value of type ``kind`` at ``off`` (strings' lengths read, nothing decoded)."""
    if kind in _SCALARS:
        return off + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        (n,) = struct.unpack_from("<Q", buf, off)
        return off + 8 + n
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if item in _SCALARS:
            return off + count * struct.calcsize(_SCALARS[item])
        if item == 8:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, off)
                off += 8 + n
            return off
        for _ in range(count):
            off = _skip(buf, item, off)
        return off
    raise ValueError(f"unknown GGUF value type {kind}")


def _value(buf: memoryview, kind: int, off: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        (v,) = struct.unpack_from(_SCALARS[kind], buf, off)
        return v, off + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(buf, off)
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if item in _NUMPY:
            arr = np.frombuffer(buf, dtype=_NUMPY[item], count=count, offset=off)
            return arr.tolist(), off + arr.nbytes
        out = []
        for _ in range(count):
            v, off = _value(buf, item, off)
            out.append(v)
        return out, off
    raise ValueError(f"unknown GGUF value type {kind}")


class GGUFFile:
    """The metadata, tensor table and tensors of a GGUF file (little-endian, version 2 or 3)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # noqa: PLC0415  (the type enum and block sizes)

        self.path = str(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 or 3 are read)")
        off = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, off = _string(buf, off)
            (kind,) = struct.unpack_from("<I", buf, off)
            off += 4
            self.fields[key] = Field(buf, kind, off)
            off = _skip(buf, kind, off)
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (nd,) = struct.unpack_from("<I", buf, off)
            dims = np.array(struct.unpack_from(f"<{nd}Q", buf, off + 4), dtype=np.uint64)
            kind, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * nd)
            off += 4 + 8 * nd + 12
            infos.append((name, dims, kind, rel))
        align = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else 32
        start = -(-off // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, kind, rel in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if len(dims) else 1
            nbytes = n * size // block
            where = start + rel
            if where + nbytes > len(self.data):
                raise ValueError(f"tensor {name} runs past the end of the file")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            raw = self.data[where:where + nbytes]
            if qtype.name in _FLOAT_DATA:
                data = raw.view(_FLOAT_DATA[qtype.name]).reshape(np_dims)
            else:
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * size)
            self.tensors.append(Tensor(name, qtype, dims, n, nbytes, where, data))

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)
