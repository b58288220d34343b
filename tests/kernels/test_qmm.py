"""The quantized product: packing round-trips, native kernel = PyTorch reference = dequantized
arithmetic, and every row's bits independent of the batch (what exact speculation needs)."""
import pytest
import torch

from native_util import require_native
from specdec import kernels
from specdec.kernels import qmm

needs_native = pytest.mark.usefixtures("native_kernels")  # skips without them; fails under SPECDEC_REQUIRE_KERNELS=1


def weights(n, k, bits, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return w, qmm.from_float(w, bits, b)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 64), (16, 32), (257, 96)])
def test_pack_unpack_round_trip_and_quantization_error(bits, shape):
    w, qw = weights(*shape, bits)
    codes, scale, offset = qmm.unpack(qw)
    c2, s2, o2 = qmm.quantize(w, bits)
    assert torch.equal(codes, c2) and torch.equal(scale, s2) and torch.equal(offset, o2)
    assert int(codes.max()) < 2 ** bits
    step = scale.float().repeat_interleave(32, dim=1)
    err = (qmm.dequantize(qw) - w).abs()
    assert (err <= 0.5 * step * 1.01 + 1e-3).all()  # half a step (offset rounded to fp16)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_rows_in_chunks_gives_the_whole_matrix_packing(bits):
    w = torch.randn(257, 96, generator=torch.Generator().manual_seed(3))
    whole, chunked = qmm.from_float(w, bits), qmm.from_float(w, bits, rows=32)
    assert torch.equal(whole.data, chunked.data) and torch.equal(whole.scales, chunked.scales)
    assert (chunked.out_features, chunked.in_features) == (257, 96)
    with pytest.raises(ValueError, match="multiple of 16"):
        qmm.from_float(w, bits, rows=20)


def test_constant_groups_and_bad_shapes():
    w = torch.zeros(16, 32)
    w[3] = 0.5
    qw = qmm.from_float(w, 4)
    assert torch.equal(qmm.dequantize(qw), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        qmm.from_float(torch.randn(8, 40), 4)
    with pytest.raises(ValueError, match="bits"):
        qmm.from_float(torch.randn(8, 32), 3)
    with pytest.raises(ValueError, match="fit"):
        qmm.pack(torch.full((8, 32), 16, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), 4)


def test_activation_quantization_is_symmetric_int8_per_group():
    x = torch.randn(3, 64).bfloat16()
    x[1, :32] = 0  # an all-zero group
    q, a, am = qmm.quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[1, :32], torch.zeros(32, dtype=torch.int8)) and a[1, 0] == 0
    back = q.float().reshape(3, 2, 32) * a[..., None]
    assert ((back.reshape(3, 64) - x.float()).abs() <= a.repeat_interleave(32, 1) * 0.5 + 1e-6).all()
    assert torch.allclose(am, a * q.float().reshape(3, 2, 32).sum(-1))


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_equals_dequantized_arithmetic(bits):
    w, qw = weights(70, 96, bits)
    x = torch.randn(5, 96).bfloat16()
    q, a, _ = qmm.quantize_rows(x)
    xd = (q.float().reshape(5, 3, 32) * a[..., None]).reshape(5, 96)
    want = xd @ qmm.dequantize(qw).T + qw.bias
    got = qmm.linear_reference(x, qw, torch.float32)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    true = x.float() @ w.T + qw.bias  # the unquantized product: close, not equal
    assert ((got - true).norm() / true.norm()) < (0.12 if bits == 4 else 0.02)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 64), (256, 1536), (1000, 96), (7, 32), (24, 4160)])
def test_native_matches_reference(bits, shape):
    _, qw = weights(*shape, bits)
    x = torch.randn(19, shape[1]).bfloat16()
    lib = kernels.library()
    xq = torch.empty(19, shape[1], dtype=torch.int8)
    a = torch.empty(19, shape[1] // 32)
    am = torch.empty_like(a)
    lib.sd_quantize_rows(x.data_ptr(), 19, shape[1], xq.data_ptr(), a.data_ptr(), am.data_ptr())
    rq, ra, ram = qmm.quantize_rows(x)
    assert torch.equal(xq, rq) and torch.equal(a, ra) and torch.equal(am, ram)  # bit for bit
    got, ref = qmm.linear(x, qw, torch.float32), qmm.linear_reference(x, qw, torch.float32)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(qmm.linear(x, qw), got.bfloat16())  # bf16 output = rounded fp32 output


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_batch_invariant(bits, native, monkeypatch):
    if native:
        require_native()  # skips without the kernels; fails under SPECDEC_REQUIRE_KERNELS=1
    else:
        monkeypatch.setattr(kernels, "library", lambda: None)
    _, qw = weights(300, 128, bits)
    x = torch.randn(17, 128).bfloat16()
    _, long = weights(20, 4160, bits, seed=1)  # long inputs run in chunks of groups
    xl = torch.randn(17, 4160).bfloat16()
    full_long = qmm.linear(xl, long, torch.float32)
    for m in (1, 3, 9, 17):
        assert torch.equal(qmm.linear(xl[:m], long, torch.float32), full_long[:m]), m
    # inputs past 256 KB of the rows' codes run in chunks of groups (1024 groups at eight rows and
    # more, 8192 at one): 1100 groups run whole at one to five rows and in 2 chunks at eight and
    # seventeen; the bits must not move
    _, longer = weights(20, 32 * 1100, bits, seed=2)
    xll = torch.randn(17, 32 * 1100).bfloat16()
    full_longer = qmm.linear(xll, longer, torch.float32)
    for m in (1, 2, 3, 5, 8, 17):
        assert torch.equal(qmm.linear(xll[:m], longer, torch.float32), full_longer[:m]), m
    full = qmm.linear(x, qw, torch.float32)
    for m in range(1, 18):
        assert torch.equal(qmm.linear(x[:m], qw, torch.float32), full[:m]), m
    for i in (0, 5, 16):
        assert torch.equal(qmm.linear(x[i:i + 1], qw, torch.float32), full[i:i + 1]), i


def test_switching_off_the_native_path(monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS", "0")
    kernels.reset()
    try:
        assert kernels.library() is None and "SPECDEC_KERNELS" in kernels.reason()
        _, qw = weights(20, 32, 4)
        y = qmm.linear(torch.randn(2, 32).bfloat16(), qw)  # the reference still answers
        assert y.shape == (2, 20)
    finally:
        monkeypatch.delenv("SPECDEC_KERNELS")
        kernels.reset()


def test_build_reports_a_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv("SPECDEC_ISA", raising=False)  # CPUs simulated below: no rung forced
    monkeypatch.setattr(kernels, "machine_arch", lambda: "x86_64")  # the x86 build's messages on any machine
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set(kernels.NEEDED_CPU_FLAGS))
    with pytest.raises(RuntimeError, match="could not run"):
        kernels.build(force=True)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set())
    with pytest.raises(RuntimeError, match="lacks"):
        kernels.build(force=True)


def test_the_build_targets_avx512_or_avx2():
    """The kernels build for AVX-512 (VNNI, with or without BF16) or, on CPUs without it (AMD Zen 1-3,
    Intel client cores), for AVX2 with FMA and F16C; before, such CPUs got only the PyTorch fallback
    (every rung: test_build.py, test_rungs.py)."""
    assert kernels.isa(set(kernels.NEEDED_CPU_FLAGS)) == "avx512-bf16"
    assert kernels.isa(set(kernels.AVX512_CPU_FLAGS)) == "avx512"
    assert kernels.isa(set(kernels.AVX2_CPU_FLAGS)) == "avx2"
    assert kernels.isa({"avx2", "fma"}) is None  # no F16C: no fp16 scales
    assert kernels.isa(set()) is None
    if kernels.isa() is not None and kernels.library() is not None:
        assert kernels._target().exists()
