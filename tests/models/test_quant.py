"""Quantized linears: they compute with exactly the weights they claim, and drop in for Linear."""
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.models.linear import Linear
from specdec.models.quant import Int4Linear, Int8Linear, dequantize_int4, quantize_int4, quantize_model


def make_linear(n=96, k=128, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias, dtype=torch.bfloat16)
    lin.weight.data = torch.randn(n, k, generator=g).bfloat16()
    if bias:
        lin.bias.data = torch.randn(n, generator=g).bfloat16()
    return lin


def test_int4_codes_round_trip_and_error_bound():
    w = make_linear().weight.data
    codes, sz = quantize_int4(w, 32)
    assert codes.min() >= 0 and codes.max() <= 15 and sz.shape == (4, 96, 2)
    deq = dequantize_int4(codes, sz, 32)
    step = (w.float().reshape(96, 4, 32).amax(-1) - w.float().reshape(96, 4, 32).amin(-1)) / 15
    err = (deq - w.float()).abs().reshape(96, 4, 32).amax(-1)
    assert (err <= 0.5 * step + 0.02 * step.clamp(min=1e-3) + 0.05).all()


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int4_linear_matches_its_dequantized_weights(rows):
    lin = make_linear()
    q = Int4Linear(lin, 32)
    x = torch.randn(rows, 128).bfloat16()
    ref = x.float() @ dequantize_int4(*quantize_int4(lin.weight.data, 32), 32).T + lin.bias.float()
    got = q(x).float()
    assert torch.allclose(got, ref, rtol=2e-2, atol=0.15), (got - ref).abs().max()


def test_int8_linear_matches_its_dequantized_weights():
    lin = make_linear(bias=False)
    q = Int8Linear(lin)
    x = torch.randn(3, 128).bfloat16()
    ref = x.float() @ (q.codes.float() * q.scales.float()[:, None]).T
    assert torch.allclose(q(x).float(), ref, rtol=2e-2, atol=0.15)
    full = x.float() @ lin.weight.float().T
    assert ((q(x).float() - full).norm() / full.norm()) < 0.02


def test_quantize_model_replaces_linears_and_keeps_shapes():
    from specdec.config import ModelConfig
    from specdec.models.llama import build_model
    cfg = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                      architecture="qwen2")
    m = build_model(cfg, dtype=torch.bfloat16)
    x, pos = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    ref = m(x, pos, m.new_cache(1, 8)).logits.float()
    n = quantize_model(m, "int4")
    assert n == 2 * 3 + 1  # qkv, o, gate_up of each layer + lm_head; down (80 inputs) stays bf16
    assert sum(isinstance(mod, Linear) for mod in m.modules()) == 2
    got = m(x, pos, m.new_cache(1, 8)).logits.float()
    assert got.shape == ref.shape and ((got - ref).norm() / ref.norm()) < 0.25
    with pytest.raises(SpecdecError, match="unknown quantization"):
        quantize_model(m, "int3")


def test_int4_dense_prefill_path_is_used_for_many_rows():
    lin = make_linear()
    ref_w = lin.weight.data.float().clone()
    q = Int4Linear(lin, 32, dense_rows=4)
    few, many = torch.randn(3, 128).bfloat16(), torch.randn(9, 128).bfloat16()
    dense = many.float() @ ref_w.T + lin.bias.float()
    assert torch.allclose(q(many).float(), dense, rtol=2e-2, atol=0.1)  # the exact bf16 weights
    deq = few.float() @ dequantize_int4(*quantize_int4(ref_w.bfloat16(), 32), 32).T + lin.bias.float()
    assert torch.allclose(q(few).float(), deq, rtol=2e-2, atol=0.15)  # the int4 weights
