"""Quantized linears drop in for Linear, keep the model's shapes and stay close to its logits."""
import pytest
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.quant.linear import Linear
from specdec.models.llama import build_model
from specdec.quant.qlinear import QLinear, quantize_model, quantized_bytes


def tiny(hidden=64, inter=80, tied=False):
    cfg = ModelConfig(vocab_size=80, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, attention_bias=True,
                      architecture="qwen2", tie_word_embeddings=tied)
    return build_model(cfg, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qlinear_matches_the_product_on_its_weights(dtype):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    lin = QLinear(qmm.from_float(w, 4, b))
    x = torch.randn(2, 3, 64, generator=g).to(dtype)
    y = lin(x)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    want = qmm.linear_reference(x.reshape(6, 64), lin.qweight, torch.float32).reshape(2, 3, 48)
    assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind,tol", [("int4", 0.25), ("int8", 0.03)])
@pytest.mark.parametrize("tied", [False, True])
def test_quantize_model_replaces_linears_and_keeps_shapes(kind, tol, tied):
    m = tiny(tied=tied)
    x, pos = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    ref = m(x, pos, m.new_cache(1, 8)).logits.float()
    n = quantize_model(m, kind)
    assert n == 2 * 3 + 1  # qkv, o, gate_up of each layer + lm_head; down (80 inputs) stays bf16
    assert sum(isinstance(mod, Linear) for mod in m.modules()) == 2
    assert quantized_bytes(m) > 0
    assert m.embed_tokens.weight.dtype == torch.bfloat16  # the lookup table is left alone
    got = m(x, pos, m.new_cache(1, 8)).logits.float()
    assert got.shape == ref.shape and ((got - ref).norm() / ref.norm()) < tol


def test_quantized_model_is_batch_invariant():
    """A block of tokens scores each position as single steps do: the exactness of verification."""
    m = tiny(inter=128)
    quantize_model(m, "int4")
    toks = torch.tensor([[5, 9, 2, 7, 1, 3]])
    block = m(toks, torch.arange(6)[None], m.new_cache(1, 16)).logits
    cache = m.new_cache(1, 16)
    steps = torch.cat([m(toks[:, i:i + 1], torch.tensor([[i]]), cache).logits for i in range(6)], dim=1)
    assert torch.equal(block, steps)


def test_bad_requests_are_one_line_errors():
    m = tiny()
    with pytest.raises(SpecdecError, match="unknown quantization"):
        quantize_model(m, "int3")
    with pytest.raises(SpecdecError, match="GGUF"):
        quantize_model(m, "gguf")
