"""The native repacking (csrc/repack.c) lays a file's blocks into the tiles byte for byte as the NumPy decoding
and ``qmm`` packing do, for every type it reads, alone and as the parts of a fused layer."""
import mmap
import sys

import numpy as np
import pytest
import torch

from test_gguf_blocks import Tensor, random_blocks
from specdec.config import ModelConfig
from specdec.formats import gguf_blocks

needs_native = pytest.mark.usefixtures("native_kernels")
CONFIG = ModelConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128)
NAME = "model.layers.0.mlp.down_proj.weight"  # no rows or columns moved by any converter


def _affine_raw(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    import gguf
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def _raw(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    if kind.endswith("_K"):
        return random_blocks(kind, n, k, seed)
    return _affine_raw(kind, n, k, seed)


@needs_native
@pytest.mark.parametrize("kinds", [["Q4_0"], ["Q4_1"], ["Q5_0"], ["Q5_1"], ["Q8_0"], ["Q4_K"], ["Q5_K"], ["Q6_K"],
                                   ["Q4_K", "Q4_K", "Q6_K"], ["Q4_K", "Q5_K"], ["Q5_0", "Q8_0"], ["Q4_0", "Q4_1"]])
def test_repacked_tiles_are_the_numpy_packing(kinds):
    k = 512
    tensors = [Tensor(_raw(kind, 16 * (i + 1) + 3 * i, k, seed=i), kind, 16 * (i + 1) + 3 * i, k)
               for i, kind in enumerate(kinds)]
    fast = gguf_blocks._repacked([(NAME, t) for t in tensors], CONFIG)
    slow = gguf_blocks.pack(gguf_blocks.fuse([gguf_blocks.decode(t) for t in tensors]))
    assert fast is not None
    assert (fast.fmt, fast.bits, fast.out_features, fast.in_features) == (slow.fmt, slow.bits, slow.out_features, k)
    assert torch.equal(fast.data, slow.data) and torch.equal(fast.scales.view(torch.uint8), slow.scales.view(torch.uint8))


@needs_native
def test_what_repacking_does_not_take_goes_the_numpy_way():
    mixed = [Tensor(_raw("Q8_0", 16, 256), "Q8_0", 16, 256), Tensor(_raw("Q4_K", 16, 256), "Q4_K", 16, 256)]
    assert gguf_blocks._repacked([(NAME, t) for t in mixed], CONFIG) is None  # per 32 beside two levels
    other = [Tensor(_raw("Q3_K", 16, 256), "Q3_K", 16, 256)]
    assert gguf_blocks._repacked([(NAME, t) for t in other], CONFIG) is None


def _resident_kib(path) -> int:
    """Resident KiB of this process's maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            inside = line.rstrip().endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


@needs_native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED and /proc/self/smaps are Linux's")
def test_the_files_pages_leave_the_resident_set_once_repacked_and_copies_are_never_dropped(tmp_path):
    """A load would otherwise hold the whole file's pages beside the tiles made of them (1.1 GB more at the peak
    for the 1.5B); the tiles are the same either way, and memory of our own (a copy) is never advised away."""
    n, k = 1024, 4096  # 4.3 MB of Q8_0
    raw = _raw("Q8_0", n, k)
    path = tmp_path / "blocks.bin"
    path.write_bytes(raw.tobytes())
    want = gguf_blocks._repacked([(NAME, Tensor(raw.copy(), "Q8_0", n, k))], CONFIG)  # from memory of our own
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, dtype=np.uint8).reshape(raw.shape)
    assert gguf_blocks._of_a_file_map(view) and not gguf_blocks._of_a_file_map(raw)
    assert int(view.sum(dtype=np.int64)) == int(raw.sum(dtype=np.int64))  # every page read in
    before = _resident_kib(path)
    got = gguf_blocks._repacked([(NAME, Tensor(view, "Q8_0", n, k))], CONFIG)
    after = _resident_kib(path)
    assert before >= 0.9 * raw.nbytes / 1024 and after <= 0.05 * before, (before, after)
    assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
    assert np.array_equal(view, raw)  # the file's bytes read back (faulted in again) unchanged
    del view
    mapped.close()
