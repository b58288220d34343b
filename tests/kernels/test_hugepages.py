"""Weights and the KV cache's pool on 2 MB pages (kernels/hugepages.py): same values, same results,
the mapping advised for huge pages, and nothing moved where that is off."""
from __future__ import annotations

import pytest
import torch

from specdec.config import ModelConfig
from specdec.kernels import hugepages
from specdec.models.llama import build_model
from specdec.quant.qlinear import quantize_model
from specdec.runtime.kv_cache import KVCache

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="transparent huge pages are off here")


def _no_arena(*_a, **_k):
    raise AssertionError("an Arena (a huge-page mapping) was made where none should be")


def _vm_flags(ptr: int) -> set[str]:
    """The VmFlags of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    return set()


@needs_thp
def test_arena_pieces_are_aligned_copies_in_one_advised_mapping():
    arena = hugepages.Arena(3 << 20)
    assert arena.buf.data_ptr() % hugepages.HUGE == 0
    a = torch.randn(1000, 3).bfloat16()
    b = torch.arange(777, dtype=torch.int32)
    ca, cb = arena.copy(a), arena.copy(b)
    assert torch.equal(ca, a) and torch.equal(cb, b)
    assert ca.data_ptr() % hugepages.ALIGN == 0 and cb.data_ptr() % hugepages.ALIGN == 0
    assert cb.data_ptr() >= ca.data_ptr() + a.numel() * 2  # packed one after another, no overlap
    assert "hg" in _vm_flags(ca.data_ptr())  # MADV_HUGEPAGE on the mapping
    with pytest.raises(ValueError, match="no room"):
        arena.take((4 << 20,), torch.uint8)


def _model(quant: str | None) -> torch.nn.Module:
    # 4 layers of hidden 384: ~13 MB of streamed bf16 weights, ~4 MB in int4 (an arena takes 2 MB or more)
    cfg = ModelConfig(vocab_size=500, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, architecture="qwen2",
                      attention_bias=True)
    m = build_model(cfg, dtype=torch.bfloat16, seed=5)
    if quant:
        quantize_model(m, quant)
    return m


@needs_thp
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("quant", [None, "int4"])
def test_rehomed_weights_give_the_same_logits(quant, monkeypatch):
    tokens = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).view(1, -1)
    out = {}
    for huge in ("0", "1"):
        monkeypatch.setenv("SPECDEC_HUGEPAGES", huge)
        m = _model(quant)
        with monkeypatch.context() as mp:
            if huge == "0":  # not the VMA's flags: NumPy advises its own large heap blocks, which the heap reuses
                mp.setattr(hugepages, "Arena", _no_arena)
            assert m.make_native()
        w = m.layers[0].mlp.gate_up_proj
        ptr = w.qweight.data.data_ptr() if quant else w.tiled.data_ptr()
        if huge == "1":
            assert "hg" in _vm_flags(ptr)
        with torch.inference_mode():
            cache = m.new_cache(1, 64)
            prefill = m(tokens[:, :8], pos[:, :8], cache).logits
            block = m(tokens[:, 8:], pos[:, 8:], cache).logits  # a block of 4 on the native path
        out[huge] = (prefill, block)
    assert torch.equal(out["0"][0], out["1"][0]) and torch.equal(out["0"][1], out["1"][1])


@needs_thp
def test_what_is_on_huge_pages_already_is_not_moved_again():
    """rehome leaves weights already in an arena where they are (a GGUF load lays its tiles there: copying
    them again cost 2.5 s of a 1.5B load), and moves the others."""
    m = _model("int4")
    w = m.layers[0].mlp.gate_up_proj.qweight
    assert not hugepages.in_arena(w.data)
    moved = hugepages.rehome(m)
    assert moved > 0 and hugepages.in_arena(w.data) and hugepages.in_arena(w.scales)
    assert hugepages.rehome(m) == 0  # all of it there already
    assert not hugepages.in_arena(torch.empty(4 << 20, dtype=torch.uint8))


def test_nothing_moves_when_turned_off_or_too_small(monkeypatch):
    m = _model(None)
    monkeypatch.setenv("SPECDEC_HUGEPAGES", "0")
    assert not hugepages.available()
    # no mapping of ours is made (the VMA's "hg" flag cannot tell: NumPy advises its large heap blocks with
    # MADV_HUGEPAGE, and the heap hands that memory on to the next torch.empty)
    monkeypatch.setattr(hugepages, "Arena", _no_arena)
    assert hugepages.rehome(m) == 0
    t = hugepages.empty((4 << 20,), torch.uint8)
    assert t.untyped_storage().nbytes() == 4 << 20
    monkeypatch.delenv("SPECDEC_HUGEPAGES")
    small = torch.nn.Sequential()  # nothing streamed: nothing to move
    assert hugepages.rehome(small) == 0


@needs_thp
def test_a_large_kv_pool_is_advised_and_grows_keeping_its_blocks():
    cache = KVCache(8, 4, 2, 512, 64, dtype=torch.bfloat16)  # 8 layers x 65 blocks x 8 KB: 4 MB each
    assert "hg" in _vm_flags(cache.k.data_ptr()) and "hg" in _vm_flags(cache.v.data_ptr())
    assert torch.count_nonzero(cache.k[:, 0]) == 0  # the null block reads zeros
    cache.prepare_writes(torch.tensor([0]), torch.arange(40).view(1, -1))
    blocks = list(cache.blocks[0])
    cache.k[:, blocks] = 1.5
    cache.grow(8, 512)
    assert "hg" in _vm_flags(cache.k.data_ptr())
    assert torch.all(cache.k[:, blocks] == 1.5)
