"""Weights on 2 MB pages: one anonymous mapping per model, advised ``MADV_HUGEPAGE`` before it is touched.

A decode forward streams every weight once, in pieces of a few hundred kilobytes per product. On 4 KB
pages that is a TLB miss every 4 KB (~250,000 a forward for the 1.5B int4 model, whose page-table
entries no cache keeps across a forward) and a restart of the hardware prefetchers' streams at every
page; on 2 MB pages the walks all but vanish. Measured in one process, the same weights both ways
(qwen2.5-coder-1.5b and smollm2-135m, AMD EPYC, 2 cores): a T=1 forward 3-9% faster, T=8 3-15%.

PyTorch's allocator does the same for every allocation of 2 MB or more when ``THP_MEM_ALLOC_ENABLE=1``
is set before its first allocation; a library cannot count on that (torch is often imported first),
so the tensors the native kernels stream are copied here, packed one after another (64-byte aligned)
into one mapping: no 2 MB of padding per tensor. Where Linux's transparent huge pages are off
(``never``) or ``madvise`` is missing, the tensors stay where they are.

    moved = rehome(model)   # bytes moved onto huge pages (0: left as they were)
"""
from __future__ import annotations

import math
import mmap
import os
import weakref
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20
ALIGN = 64
_LIVE: set[int] = set()  # the storage addresses of the arenas whose mappings live
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether an advised mapping can get huge pages here (Linux THP ``always`` or ``madvise``)."""
    if os.environ.get("SPECDEC_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


class Arena:
    """One mapping advised for huge pages, 2 MB-aligned, handed out in 64-byte-aligned pieces."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.map.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are faulted in 2 MB at a time
        except OSError:  # a kernel without THP: still a valid mapping, on 4 KB pages
            pass
        whole = torch.frombuffer(self.map, dtype=torch.uint8)  # the tensor keeps the mapping alive
        storage = whole.untyped_storage().data_ptr()
        _LIVE.add(storage)
        weakref.finalize(self.map, _LIVE.discard, storage)
        start = (-whole.data_ptr()) % HUGE
        self.buf = whole[start:start + nbytes]
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized (untouched: zero when first read) contiguous tensor in the arena."""
        n = math.prod(shape) * dtype.itemsize
        at = self.used
        if at + n > self.buf.numel():
            raise ValueError(f"arena of {self.buf.numel()} bytes has no room for {n} more")
        self.used = at + padded(n)
        return self.buf[at:at + n].view(dtype).view(shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values in the arena, same dtype and shape (contiguous)."""
        out = self.take(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


def padded(nbytes: int) -> int:
    """What a piece of ``nbytes`` takes of an arena (each piece ``ALIGN``-byte aligned)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def arena(nbytes: int) -> Arena | None:
    """An arena of ``nbytes`` where huge pages help (2 MB or more, THP available), else None."""
    return Arena(nbytes) if nbytes >= HUGE and available() else None


def in_arena(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in an arena (on huge pages already)."""
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _LIVE


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty`` on huge pages where that helps (a CPU tensor of 2 MB or more, THP available): the
    KV cache's pool, whose attention reads a 4 KB page per 32-slot block of 64-wide heads. Untouched
    until written, so only the 2 MB pieces written become resident."""
    n = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or n < HUGE or not available():
        return torch.empty(shape, dtype=dtype, device=device)
    return Arena(n).take(shape, dtype)


def _streamed(module: nn.Module) -> list[tuple[object, str]]:
    """(holder, attribute) of every weight tensor a decode forward streams: the native tiles of bf16
    linears (``quant.linear.Linear.tiled``) and the codes and scales of quantized ones (``QLinear.qweight``),
    found by what the modules hold (no import of ``models``: the kernels sit below it)."""
    from specdec.kernels.qmm import QWeight  # noqa: PLC0415

    out: list[tuple[object, str]] = []
    for m in module.modules():
        q = getattr(m, "qweight", None)
        if isinstance(q, QWeight):
            out += [(q, "data"), (q, "scales")]
        elif isinstance(getattr(m, "tiled", None), torch.Tensor):
            out.append((m, "tiled"))
    return out


def rehome(module: nn.Module) -> int:
    """Move the weights ``module``'s decode forward streams onto huge pages (CPU tensors only); returns
    the bytes moved. Pointers taken before (a ``NativeForward``) must be taken again."""
    slots = [(h, a) for h, a in _streamed(module)
             if getattr(h, a).device.type == "cpu" and getattr(h, a).is_contiguous() and not in_arena(getattr(h, a))]
    sizes = [getattr(h, a).numel() * getattr(h, a).element_size() for h, a in slots]
    total = sum(padded(n) for n in sizes)
    if not slots or total < HUGE or not available():
        return 0
    arena = Arena(total)
    for h, a in slots:
        setattr(h, a, arena.copy(getattr(h, a)))
    return sum(sizes)
