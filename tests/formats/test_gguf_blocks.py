"""GGUF blocks into our quantized form: exact for the affine block types, close for the rest, and a
model loaded with quantization='gguf' computes with the file's own weights."""
import numpy as np
import pytest
import torch

from test_loading import home, make_hf_weights, write_gguf  # noqa: F401  (home: a fresh SPECDEC_HOME)
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.formats import gguf_blocks
from specdec.formats.gguf_file import unpermute_qk
from specdec.quant.qlinear import QLinear


class Tensor:
    """The fields of a gguf reader tensor that ``decode`` reads."""

    def __init__(self, raw: np.ndarray, kind: str, n: int, k: int):
        import gguf
        self.data, self.name = raw, "blk.0.test.weight"
        self.tensor_type = gguf.GGMLQuantizationType[kind]
        self.shape = np.array([k, n])


def decoded_weights(blocks):
    return gguf_blocks.dequantized(blocks)


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 6), ("Q5_1", 6), ("Q8_0", 8)])
def test_affine_block_types_are_exact(kind, bits):
    import gguf
    w = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qt)
    blocks = gguf_blocks.decode(Tensor(raw, kind, 24, 128))
    assert blocks[1] == bits and blocks[0]["codes"].max() < 2 ** bits and "scale" in blocks[0]
    np.testing.assert_array_equal(decoded_weights(blocks), gguf.dequantize(raw, qt).reshape(24, 128))
    packed = gguf_blocks.pack(blocks)
    assert packed.fmt == qmm.AFFINE
    np.testing.assert_array_equal(qmm.dequantize(packed).numpy(), gguf.dequantize(raw, qt).reshape(24, 128))


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes with sane fp16 super-block scales (d, dmin) for the k-quant types."""
    import gguf
    qt = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[..., 0:4] = d.reshape(n, k // block, 4)
    elif kind == "Q2_K":  # d, dmin last
        raw[..., size - 4:] = d.reshape(n, k // block, 4)
    else:  # Q6_K, Q3_K: d is the last two bytes
        raw[..., size - 2:] = d[..., :2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind,fmt,bits", [("Q4_K", qmm.KQUANT, 4), ("Q5_K", qmm.KQUANT, 6), ("Q6_K", qmm.HALVES, 6)])
def test_k_quants_are_the_files_weights_bit_for_bit(kind, fmt, bits):
    """The two levels of scales as the format defines them (no rounding to fp16, no re-coding of Q6_K):
    the packed weights equal the gguf package's dequantize of the same blocks, bit for bit."""
    import gguf
    raw = random_blocks(kind, 19, 512, seed=3)
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(19, 512)
    blocks = gguf_blocks.decode(Tensor(raw, kind, 19, 512))
    assert blocks[1] == bits
    np.testing.assert_array_equal(decoded_weights(blocks), ref)
    packed = gguf_blocks.pack(blocks)
    assert packed.fmt == fmt and packed.bits == bits
    np.testing.assert_array_equal(qmm.dequantize(packed).numpy(), ref)


def test_a_fused_layer_of_q4_k_and_q6_k_parts_stays_exact():
    """q|k|v of a Q4_K_M file: Q4_K q and k, a Q6_K v. All three go to HALVES, the file's weights."""
    import gguf
    kinds = ["Q4_K", "Q5_K", "Q6_K"]
    raws = [random_blocks(kind, 16 * (i + 1), 256, seed=i) for i, kind in enumerate(kinds)]
    parts = [gguf_blocks.decode(Tensor(r, kind, r.shape[0], 256)) for r, kind in zip(raws, kinds)]
    fused = gguf_blocks.pack(gguf_blocks.fuse(parts))
    ref = np.concatenate([gguf.dequantize(r, gguf.GGMLQuantizationType[kind]).reshape(r.shape[0], 256)
                          for r, kind in zip(raws, kinds)])
    assert fused.fmt == qmm.HALVES
    np.testing.assert_array_equal(qmm.dequantize(fused).numpy(), ref)
    two = gguf_blocks.pack(gguf_blocks.fuse(parts[:2]))  # no Q6_K part: per 32 (KQUANT), the wider codes
    assert two.fmt == qmm.KQUANT and two.bits == 6
    np.testing.assert_array_equal(qmm.dequantize(two).numpy(), ref[:48])


def test_a_fused_layer_mixing_per_32_and_two_level_types_is_recoded_and_said():
    import gguf
    w = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    parts = [gguf_blocks.decode(Tensor(q8, "Q8_0", 16, 256)), gguf_blocks.decode(Tensor(random_blocks("Q4_K", 16, 256),
                                                                                     "Q4_K", 16, 256))]
    notes = set()
    fused = gguf_blocks.fuse(parts, notes)
    assert notes and "scale" in fused[0] and fused[1] == 8


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_other_types_are_recoded_in_8_bits_and_said(kind):
    import gguf
    raw = random_blocks(kind, 16, 256)
    notes = set()
    blocks = gguf_blocks.decode(Tensor(raw, kind, 16, 256), notes)
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(16, 256)
    step = np.repeat(blocks[0]["scale"].astype(np.float32), 32, axis=1)
    assert notes == {kind} and blocks[1] == 8
    assert (np.abs(decoded_weights(blocks) - ref) <= 0.51 * step + 1e-6).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_loaded_with_gguf_quantization_uses_the_files_blocks(tmp_path, arch):
    import gguf
    w = make_hf_weights(arch, tied=arch == "llama")
    types = {n: "Q4_0" if ".self_attn." in n else "Q8_0" for n in w if n.endswith("proj.weight")}
    types["model.layers.0.self_attn.v_proj.weight"] = "Q5_0"  # a wider part in the fused q|k|v
    path = write_gguf(tmp_path / "m.gguf", arch, w, types=types)
    llm = LLM(str(path), quantization="gguf", progress=False)
    model = llm.target.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QLinear) and qkv.qweight.bits == 6  # Q5_0 codes (below 32) in 6 bits
    assert model.layers[1].self_attn.qkv_proj.qweight.bits == 4
    parts = []
    for p in "qkv":
        name = f"model.layers.0.self_attn.{p}_proj.weight"
        qt = gguf.GGMLQuantizationType[types[name]]
        deq = gguf.dequantize(gguf.quants.quantize(w[name], qt), qt).reshape(w[name].shape)
        if arch == "llama" and p in "qk":
            deq = llama_cpp_round_trip(deq, 4 if p == "q" else 2)
        parts.append(deq)
    np.testing.assert_array_equal(qmm.dequantize(qkv.qweight).numpy(), np.concatenate(parts))
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def llama_cpp_round_trip(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows as stored after llama.cpp's permute and our unpermute: the identity."""
    from test_loading import llama_cpp_permute
    return unpermute_qk(llama_cpp_permute(w, heads), heads)


def test_gguf_blocksization_needs_a_gguf_source(tmp_path):
    from conftest import make_model_dir
    d = make_model_dir(tmp_path / "hf", layers=1, hidden=32)
    with pytest.raises(SpecdecError, match="nor a .gguf file"):
        LLM(str(d), quantization="gguf", progress=False)
