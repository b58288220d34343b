"""The two-level scale formats (GGUF's K-quants held exactly): packing round-trips, dequantized weights equal
the two levels' arithmetic, the native kernel agrees with the PyTorch reference, every row's bits are
independent of the block (exact speculation); every rung gives the same bits (test_rungs.py)."""
import pytest
import torch

from specdec.kernels import qmm

needs_native = pytest.mark.usefixtures("native_kernels")


def two_level(n, k, fmt, bits=4, seed=0):
    """Random fields of a format: KQUANT (Q4_K-like: u8 sc, mn below 64, dm = -dmin) or HALVES (Q6_K-like:
    s8 sc per 16, mn = sc, dm = -32 d, codes below 64)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half()
    codes = torch.randint(0, 1 << bits if fmt == qmm.KQUANT else 64, (n, k), generator=g, dtype=torch.uint8)
    if fmt == qmm.KQUANT:
        dm = (-torch.rand(n, k // 256, generator=g) * 0.01).half()
        sc = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)
        mn = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)
    else:
        dm = (-32 * d.float()).half()
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        mn = sc.clone()
    return {"codes": codes, "d": d, "dm": dm, "sc": sc, "mn": mn}


CASES = [(qmm.KQUANT, 4), (qmm.KQUANT, 6), (qmm.KQUANT, 8), (qmm.HALVES, 6), (qmm.HALVES, 8)]


@pytest.mark.parametrize("fmt,bits", CASES)
@pytest.mark.parametrize("n", [16, 37])
def test_round_trip_and_exact_weights(fmt, bits, n):
    f = two_level(n, 512, fmt, bits)
    w = qmm.from_fields(f, bits, torch.randn(n))
    assert w.fmt == fmt and w.bits == bits
    back = qmm.fields(w)
    for key in f:
        assert torch.equal(back[key], f[key]), key
    # the weights: d sc q + dm mn per group (32) or half (16), every product exact in fp32
    per = 8 if fmt == qmm.KQUANT else 16
    gs = 256 // per
    s = f["d"].float().repeat_interleave(per, 1) * f["sc"].float()
    m = f["dm"].float().repeat_interleave(per, 1) * f["mn"].float()
    want = (f["codes"].float().reshape(n, -1, gs) * s[..., None] + m[..., None]).reshape(n, 512)
    assert torch.equal(qmm.dequantize(w), want)
    sel = torch.tensor([3, 0, n - 1])
    cut = qmm.select_rows(w, sel)
    assert torch.equal(qmm.dequantize(cut), want[sel]) and torch.equal(cut.bias, w.bias[sel])


def test_bad_two_level_inputs():
    f = two_level(16, 512, qmm.HALVES)
    with pytest.raises(ValueError, match="below 64"):
        qmm.pack_two_level(f["codes"] + 64, f["d"], f["dm"], f["sc"], f["mn"], 8)
    with pytest.raises(ValueError, match="below 64"):
        qmm.pack_two_level(f["codes"], f["d"], f["dm"], f["sc"], f["mn"], 4)
    k = two_level(16, 512, qmm.KQUANT, 8)
    with pytest.raises(ValueError, match="fit in 6 bits"):
        qmm.pack_two_level(k["codes"], k["d"], k["dm"], k["sc"], k["mn"], 6)
    with pytest.raises(ValueError, match="multiple of 256"):
        qmm.pack_two_level(torch.zeros(16, 96, dtype=torch.uint8), torch.ones(16, 1).half(), torch.ones(16, 1).half(),
                           torch.ones(16, 3, dtype=torch.uint8), torch.ones(16, 3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="fields"):
        qmm.unpack(qmm.from_fields(f, 8))


@pytest.mark.parametrize("fmt,bits", CASES)
def test_reference_equals_dequantized_arithmetic(fmt, bits):
    """The reference's integer route (codes times int8 activations, scales after) is the float product
    of the dequantized weights with the dequantized activations."""
    w = qmm.from_fields(two_level(40, 768, fmt, bits, seed=1), bits)
    x = torch.randn(5, 768).bfloat16()
    xq, a, _ = qmm.quantize_rows(x)
    xd = (xq.float().reshape(5, -1, 32) * a[..., None]).reshape(5, 768)
    want = xd.double() @ qmm.dequantize(w).double().t()
    got = qmm.linear_reference(x, w, torch.float32).double()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_native
@pytest.mark.parametrize("fmt,bits", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_native_matches_reference_and_rows_are_batch_invariant(fmt, bits, m):
    n, k = 53, 1024
    w = qmm.from_fields(two_level(n, k, fmt, bits, seed=2), bits, torch.randn(n))
    x = (torch.randn(m, k) * 3).bfloat16()
    got = qmm.linear(x, w, torch.float32)
    ref = qmm.linear_reference(x, w, torch.float32)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for r in range(m):  # each row alone: the same bits
        assert torch.equal(qmm.linear(x[r:r + 1], w, torch.float32), got[r:r + 1])


@needs_native
@pytest.mark.parametrize("fmt", [qmm.AFFINE, qmm.KQUANT, qmm.HALVES])
def test_codes_below_64_packed_in_6_bits_give_the_8_bit_packings_bits(fmt):
    """The 6-bit layout (a file's 5- and 6-bit types at about their size) only packs the codes: every
    product is the 8-bit packing's of the same codes, bit for bit, at every block size."""
    n, k = 45, 768
    g = torch.Generator().manual_seed(9)
    if fmt == qmm.AFFINE:
        f = {"codes": torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8),
             "scale": (torch.rand(n, k // 32, generator=g) * 0.01).half(),
             "offset": (-torch.rand(n, k // 32, generator=g) * 0.1).half()}
    else:
        f = two_level(n, k, fmt, 6, seed=9)
    six, eight = qmm.from_fields(f, 6), qmm.from_fields(f, 8)
    assert six.data.shape[-1] == 384 and torch.equal(qmm.fields(six)["codes"], f["codes"])
    for m in (1, 3, 8, 10):
        x = (torch.randn(m, k, generator=g) * 2).bfloat16()
        assert torch.equal(qmm.linear(x, six, torch.float32), qmm.linear(x, eight, torch.float32))
