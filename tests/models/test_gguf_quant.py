"""GGUF blocks into our quantized form: exact for the affine block types, close for the rest, and a
model loaded with quantization='gguf' computes with the file's own weights."""
import numpy as np
import pytest
import torch

from test_loading import home, make_hf_weights, write_gguf  # noqa: F401  (home: a fresh SPECDEC_HOME)
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.models import gguf_quant
from specdec.models.gguf_file import unpermute_qk
from specdec.models.quant import QLinear


class Tensor:
    """The fields of a gguf reader tensor that ``decode`` reads."""

    def __init__(self, raw: np.ndarray, kind: str, n: int, k: int):
        import gguf
        self.data, self.name = raw, "blk.0.test.weight"
        self.tensor_type = gguf.GGMLQuantizationType[kind]
        self.shape = np.array([k, n])


def decoded_weights(codes, scale, offset):
    n, k = codes.shape
    q = codes.astype(np.float32).reshape(n, k // 32, 32)
    return (q * scale.astype(np.float32)[..., None] + offset.astype(np.float32)[..., None]).reshape(n, k)


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)])
def test_affine_block_types_are_exact(kind, bits):
    import gguf
    w = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qt)
    codes, scale, offset, b = gguf_quant.decode(Tensor(raw, kind, 24, 128))
    assert b == bits and codes.max() < 2 ** bits
    np.testing.assert_array_equal(decoded_weights(codes, scale, offset), gguf.dequantize(raw, qt).reshape(24, 128))


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes with sane fp16 super-block scales (d, dmin) for the k-quant types."""
    import gguf
    qt = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        raw[..., 0:4] = d.reshape(n, k // block, 4)
    else:  # Q6_K: d is the last two bytes
        raw[..., size - 2:] = d[..., :2]
    return raw.reshape(n, -1)


def test_q4_k_is_exact_up_to_fp16_scales():
    import gguf
    raw = random_blocks("Q4_K", 16, 512)
    codes, scale, offset, bits = gguf_quant.decode(Tensor(raw, "Q4_K", 16, 512))
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(16, 512)
    got = decoded_weights(codes, scale, offset)
    assert bits == 4
    assert np.abs(got - ref).max() <= 2 ** -10 * np.abs(ref).max()


def test_q4_k_scales_are_rounded_to_fp16_so_q4_k_is_close_not_exact():
    """qmm.py called Q4_K exact; gguf_quant.py rounds its d*sc and dmin*mn to fp16: this pins which
    is true (close within 2^-11, and not bit-exact) so the docstrings can say it."""
    raw = random_blocks("Q4_K", 16, 512)
    _, scale, offset, _ = gguf_quant.decode(Tensor(raw, "Q4_K", 16, 512))
    b = raw.reshape(16, 2, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    sc, mn = gguf_quant._k_scales(b[..., 4:16])
    exact_s = (d[..., None] * sc).reshape(16, 16)
    exact_o = -(dmin[..., None] * mn).reshape(16, 16)
    for got, exact in ((scale.astype(np.float64), exact_s), (offset.astype(np.float64), exact_o)):
        assert np.all(np.abs(got - exact) <= 2 ** -11 * np.abs(exact))
        assert np.any(got != exact)  # rounded: not the file's values bit for bit


def test_other_types_are_recoded_in_8_bits():
    import gguf
    raw = random_blocks("Q6_K", 16, 256)
    codes, scale, offset, bits = gguf_quant.decode(Tensor(raw, "Q6_K", 16, 256))
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(16, 256)
    step = np.repeat(scale.astype(np.float32), 32, axis=1)
    assert bits == 8 and (np.abs(decoded_weights(codes, scale, offset) - ref) <= 0.51 * step + 1e-6).all()


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
    assert isinstance(qkv, QLinear) and qkv.qweight.bits == 8
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


def test_gguf_quantization_needs_a_gguf_source(tmp_path):
    from conftest import make_model_dir
    d = make_model_dir(tmp_path / "hf", layers=1, hidden=32)
    with pytest.raises(SpecdecError, match="nor a .gguf file"):
        LLM(str(d), quantization="gguf", progress=False)
