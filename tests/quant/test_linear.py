"""Batch invariance: a row's product is bit-identical whatever else shares the call."""
import pytest
import torch

from specdec.quant.linear import Linear, matmul, pad_rows, padded_rows, whole_products

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # a GPU's products are checked too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 256), (256, 896)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, shape, device):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(0)
    lin = Linear(in_f, out_f, bias=True, dtype=dtype)
    lin.weight.data = torch.randn(out_f, in_f, generator=g).to(dtype)
    lin.bias.data = torch.randn(out_f, generator=g).to(dtype)
    lin.to(device)
    x = torch.randn(40, in_f, generator=g).to(dtype).to(device)
    alone = torch.stack([lin(x[i:i + 1])[0] for i in range(6)])
    for m in (2, 3, 5, 8, 17, 40):
        assert torch.equal(lin(x[:m])[:6], alone[:min(m, 6)].expand(min(m, 6), -1)[:6]) if m >= 6 else \
            torch.equal(lin(x[:m]), alone[:m])
    # a row placed elsewhere in the batch
    assert torch.equal(lin(torch.cat([x[10:17], x[3:4]]))[-1], alone[3])
    assert torch.allclose(lin(x[:3]).float(), (x[:3].float() @ lin.weight.float().T + lin.bias.float()),
                          rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_matmul_rows_do_not_depend_on_the_batch(dtype, device):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 12, 64, generator=g).to(dtype).to(device)
    b = torch.randn(3, 64, 96, generator=g).to(dtype).to(device)
    full = matmul(a, b)
    for lo, hi in ((0, 1), (2, 4), (5, 12), (11, 12)):
        assert torch.equal(matmul(a[:, lo:hi], b), full[:, lo:hi])


def test_on_a_gpu_every_product_of_a_block_has_the_blocks_row_count():
    """cuBLAS chooses its kernel by the row count: a block's products all take the same count there."""
    for m in (1, 2, 5, 31, 32):
        assert padded_rows(m, torch.bfloat16, "cuda") == 32 and padded_rows(m, torch.float16, "cuda") == 32
    assert [padded_rows(m, torch.float32, "cuda") for m in (1, 3, 4)] == [4, 4, 4]
    assert [padded_rows(m, torch.bfloat16) for m in (1, 2, 5)] == [2, 2, 5]  # the CPU keeps its own rule
    with whole_products():  # prompt prefill: one product of any rows, no padding
        assert padded_rows(7, torch.bfloat16, "cuda") == 7


def test_pad_rows():
    x = torch.arange(6.0).view(1, 2, 3)
    y = pad_rows(x, 4)
    assert y.shape == (1, 4, 3) and torch.equal(y[0, 2], x[0, 0]) and torch.equal(pad_rows(x, 2), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_stay_invariant_past_the_libraries_kernel_switch(dtype):
    """Up to 80 rows (a batch of 8 verifying K=9): on an Intel Xeon oneDNN's bf16 rows change past 32
    and MKL's fp32 rows past 12 unless the product runs in row blocks; prefill (``whole_products``)
    opts out and still computes the same product to rounding."""
    g = torch.Generator().manual_seed(2)
    lin = Linear(1536, 1536, bias=True, dtype=dtype)
    lin.weight.data = torch.randn(1536, 1536, generator=g).to(dtype)
    lin.bias.data = torch.randn(1536, generator=g).to(dtype)
    lin.pack()
    x = torch.randn(80, 1536, generator=g).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(80)])
    for m in (13, 31, 32, 33, 36, 37, 64, 80):
        assert torch.equal(lin(x[:m]), alone[:m]), m
        a = torch.randn(2, m, 64, generator=g).to(dtype)
        b = torch.randn(2, 64, 48, generator=g).to(dtype)
        assert torch.equal(matmul(a, b), torch.cat([matmul(a[:, i:i + 1], b) for i in range(m)], dim=1)), m
    with whole_products():
        torch.testing.assert_close(lin(x).float(), alone.float(), rtol=2e-2, atol=0.5)


def test_a_cpu_onednn_refuses_leaves_weights_unpacked(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises ("bf16 path needs the cpu support avx_ne_convert
    or avx512bw ..."); can_pack() used to assume it worked whenever mkldnn was built, so every bf16 model
    failed to load there. Now it tries once, and a refused weight stays plain and still multiplies."""
    from specdec.quant import linear as lin

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    lin.can_pack.cache_clear()
    try:
        assert lin.can_pack() is False
        layer = Linear(32, 16, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(16, 32))
        assert layer.pack() is False and layer.packed is None
        x = torch.randn(3, 32).bfloat16()
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    finally:
        monkeypatch.undo()
        lin.can_pack.cache_clear()


@pytest.mark.parametrize("amx,calls", [(True, [16, 16, 2]), (False, [32, 2])])
def test_packed_products_run_in_blocks_of_16_rows_on_an_amx_cpu(monkeypatch, amx, calls):
    """On an Intel Xeon with AMX (the lent GPU machine's host, PyTorch 2.11) a row of a oneDNN-packed bf16
    product of 18, 20, ..., 30 or 32+ rows differed from the same row alone, which broke
    test_rows_stay_invariant_past_the_libraries_kernel_switch there: the packed products now run in blocks
    of at most 16 rows on such a CPU (32 elsewhere). The oneDNN call is stood in for (this CPU may not pack)."""
    from specdec import kernels
    from specdec.quant import linear as lin_mod
    seen = []

    def fake_pointwise(x, packed, bias, *args):
        seen.append(x.shape[0])
        return torch.nn.functional.linear(x, packed, bias)

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512f", "amx_bf16"} if amx else {"avx512f"})
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake_pointwise)
    lin_mod.packed_row_block.cache_clear()
    try:
        lin = Linear(64, 48, dtype=torch.bfloat16)
        lin.weight.data = torch.randn(48, 64).bfloat16()
        lin.packed = lin.weight.data
        x = torch.randn(33, 64).bfloat16()
        y = lin(x)
    finally:
        lin_mod.packed_row_block.cache_clear()
    assert seen == calls  # the last row alone is padded to 2
    torch.testing.assert_close(y.float(), x.float() @ lin.weight.float().t(), rtol=2e-2, atol=0.1)
