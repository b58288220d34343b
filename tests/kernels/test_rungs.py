"""Every rung of the native kernels (kernels/__init__.py ``RUNGS``: avx512-bf16, avx512, avx2) that this CPU
runs passes the kernels' own bit tests, each forced with ``SPECDEC_ISA`` in a subprocess (its library built
into $SPECDEC_HOME/kernels keyed by its flags, so the rungs do not clash): the quantized products (formats
1, 2 and 3) and the bf16 product close to PyTorch with every row's bits its own, attention close to the
PyTorch path with a query's bits the same in any call, and a whole native forward of a tiny model (bf16 and
int4) giving a block of 1..8 tokens the logits of one-token steps, bit for bit: each rung is exact against
itself. Across rungs the quantized products are the same bits (integer dots, the same FMAs); the bf16 ones
are not (the avx512 rung emulates vdpbf16ps with two FMAs, which do not flush denormals; AVX2 sums in
another order). The avx512 rung's rounding to bf16 is vcvtneps2bf16's on every float but NaNs.

Run directly (``python tests/kernels/test_rungs.py OUT`` with SPECDEC_ISA set) it runs the checks of one
rung and saves its results to OUT."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import kernels

HERE = Path(__file__).resolve().parent


def _cc() -> str | None:
    return shutil.which(os.environ.get("CC") or "gcc")


# ---- the checks of one rung (run in a subprocess with SPECDEC_ISA set) ------------------------------

def checks(out: str) -> None:
    """This process's rung (``SPECDEC_ISA``): its bit tests; the products' results saved to ``out``."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import math  # noqa: PLC0415

    from native_util import reference_and_native  # noqa: PLC0415
    from test_attention import attend, mask_for, setup  # noqa: PLC0415
    from test_qmm_formats import CASES, two_level  # noqa: PLC0415

    from specdec.config import ModelConfig  # noqa: PLC0415
    from specdec.kernels import qmm  # noqa: PLC0415
    from specdec.quant.linear import Linear  # noqa: PLC0415

    rung = kernels.forced_isa()
    assert rung is not None, "SPECDEC_ISA is not set"
    assert kernels.library() is not None, kernels.reason()
    built = kernels.built_isa(kernels._predefined(kernels._compiler(), tuple(kernels.build_flags())))
    assert built == rung, f"SPECDEC_ISA={rung} built {built}"
    res = {"rung": rung}

    # quantized products, formats 1 (ours, int4 and int8), 2 (KQUANT) and 3 (HALVES): close to the
    # reference; every block of 1..9 rows gives each row the bits it gets alone
    g = torch.Generator().manual_seed(5)
    mats = {f"affine-int{b}": qmm.from_float(torch.randn(37, 512, generator=g), b, torch.randn(37, generator=g))
            for b in (4, 8)}
    for fmt, bits in CASES:
        mats[f"fmt{fmt}-int{bits}"] = qmm.from_fields(two_level(37, 512, fmt, bits, seed=5), bits,
                                                      torch.randn(37, generator=g))
    x = (torch.randn(9, 512, generator=g) * 2).bfloat16()
    res["quant"] = {}
    for name, w in mats.items():
        assert w.fmt == (1 if name.startswith("affine") else int(name[3])), name
        for dt in (torch.float32, torch.bfloat16):
            got = qmm.linear(x, w, dt)
            ref = qmm.linear_reference(x, w, dt).float()
            tol = 1e-5 if dt == torch.float32 else 1e-2
            assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (name, dt)
            alone = torch.cat([qmm.linear(x[r:r + 1], w, dt) for r in range(9)])
            assert torch.equal(alone, got), (name, dt)
            for m in range(2, 9):
                assert torch.equal(qmm.linear(x[:m], w, dt), got[:m]), (name, dt, m)
            res["quant"][(name, str(dt))] = got

    # inputs past XCHUNK's reach at 8 rows (1,032 groups: chunks of 1,024 and 8, partial sums kept between them;
    # one row runs them in one chunk): each row of the block its bits alone, on every format
    xl = (torch.randn(8, 33024, generator=g) * 2).bfloat16()
    for fmt, bits in [(1, 4), (1, 8), *CASES]:
        w = (qmm.from_float(torch.randn(19, 33024, generator=g), bits) if fmt == 1 else
             qmm.from_fields(two_level(19, 33024, fmt, bits, seed=7), bits))
        got = qmm.linear(xl, w, torch.float32)
        assert torch.equal(got, torch.cat([qmm.linear(xl[r:r + 1], w, torch.float32) for r in range(8)])), (fmt, bits)
        res["quant"][(f"chunked-fmt{fmt}-int{bits}", "fp32")] = got

    # the bf16 product on the native tiles: blocks of 1-17 rows (register blocks, their remainders, column
    # tiles grouped at a thread's end): every row its bits alone, close to F.linear
    lin = Linear(160, 171, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(171, 160, generator=g))
        lin.bias.copy_(torch.randn(171, generator=g))
    xb = torch.randn(17, 160, generator=g).bfloat16()
    ref = torch.nn.functional.linear(xb.float(), lin.weight.float(), lin.bias.float())
    assert lin.tile()
    alone = torch.cat([lin(xb[i:i + 1]) for i in range(17)])
    assert (alone.float() - ref).abs().max() < 0.05 * ref.abs().max()
    for m in range(2, 18):
        assert torch.equal(lin(xb[:m]), alone[:m]), m
    res["bf16"] = alone

    # attention over the paged cache: close to the PyTorch path, a query's bits the same in any call
    from specdec.models.llama import attention  # noqa: PLC0415
    res["attention"] = {}
    for hd in (16, 48, 128):
        q, kc, vc, rows, pos = setup(hd=hd)
        m = mask_for(pos, 64)
        got = attend(q, kc, vc, rows, m, 1 / math.sqrt(hd))
        want = attention(q, kc[rows, :, :64], vc[rows, :, :64], m).transpose(1, 2).reshape(got.shape)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), hd
        for b in range(2):
            for t in range(5):
                one = attend(q[b:b + 1, :, t:t + 1], kc, vc, rows[b:b + 1], mask_for(pos[b:b + 1, t:t + 1], 96),
                             1 / math.sqrt(hd))
                assert torch.equal(one[0, 0], got[b, t]), (hd, b, t)
        res["attention"][hd] = got

    # a whole native forward of a tiny model: close to the reference; blocks of 1..8 tokens of 3 rows
    # give the logits of one-token steps, bit for bit (batch invariance: what exact speculation needs)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2",
                      attention_bias=True)
    res["logits"] = {}
    for quant in (None, "int4"):
        ref_m, nat = reference_and_native(cfg, quant)
        seqs = torch.randint(0, 97, (3, 60), generator=torch.Generator().manual_seed(6))
        with torch.inference_mode():
            outs = []
            for model in (ref_m, nat):
                cache = model.new_cache(3, 64)
                model(seqs[:, :24], torch.arange(24).expand(3, 24), cache, fused_attention=True)
                outs.append(model(seqs[:, 24:30], torch.arange(24, 30).expand(3, 6), cache).logits.float())
            scale = outs[0].abs().max()
            assert (outs[0] - outs[1]).abs().max() < 0.03 * scale, quant
            step_cache = nat.new_cache(3, 64)
            nat(seqs[:, :20], torch.arange(20).expand(3, 20), step_cache, fused_attention=True)
            steps = torch.stack([nat(seqs[r:r + 1, t:t + 1], torch.tensor([[t]]), step_cache,
                                     rows=torch.tensor([r])).logits[0, 0]
                                 for r in range(3) for t in range(20, 56)]).view(3, 36, -1)
            block_cache = nat.new_cache(3, 64)
            nat(seqs[:, :20], torch.arange(20).expand(3, 20), block_cache, fused_attention=True)
            t = 20
            for k in range(1, 9):  # 1 + 2 + ... + 8 = 36 tokens
                got = nat(seqs[:, t:t + k], torch.arange(t, t + k).expand(3, k), block_cache).logits
                assert torch.equal(got, steps[:, t - 20:t - 20 + k]), (quant, k)
                t += k
        res["logits"][quant or "bf16"] = steps
    torch.save(res, out)


if __name__ == "__main__":
    checks(sys.argv[1])


# ---- the tests ----------------------------------------------------------------------------------------

_results: dict[str, dict] = {}


def _run(rung: str, tmp: Path) -> dict:
    """The checks of ``rung`` in a subprocess (once per test session), its saved results."""
    if rung not in _results:
        out = tmp / f"{rung}.pt"
        env = {**os.environ, "SPECDEC_ISA": rung}
        env.pop("SPECDEC_KERNELS", None)
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"the {rung} rung's checks failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        _results[rung] = torch.load(out)
    return _results[rung]


@pytest.fixture(scope="module")
def rung_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rungs")


def _needs(rung: str) -> None:
    """Skip a rung this CPU does not run (compiled only: tests/kernels/test_build.py), or where the kernels
    are not built at all (failing under SPECDEC_REQUIRE_KERNELS=1, tests/native_util.py)."""
    lacks = kernels.missing(rung)
    if lacks:
        pytest.skip(f"this CPU does not run the {rung} rung (it lacks {', '.join(lacks)}): compiled only")
    from native_util import require_native  # noqa: PLC0415
    require_native()


@pytest.mark.parametrize("rung", kernels.RUNGS)
def test_each_rung_this_cpu_runs_passes_the_kernels_bit_tests(rung, rung_dir):
    """Before, a CPU ran one rung (two existed) and the other was only compiled there; an AVX-512 CPU
    without BF16 got the AVX2 build. Now every rung this CPU runs is run in full: quantized and bf16
    products, attention, a whole forward, each row's bits independent of its block."""
    _needs(rung)
    res = _run(rung, rung_dir)
    assert res["rung"] == rung and set(res["logits"]) == {"bf16", "int4"}


def test_the_quantized_products_are_the_same_bits_on_every_rung(rung_dir):
    """Integer group dots are exact and the float steps are the same fused multiply-adds in the same order,
    and the avx512 rung rounds to bf16 exactly as vcvtneps2bf16: every rung's quantized products (formats
    1, 2, 3; fp32 and bf16 out) are the same bits."""
    runs = [r for r in kernels.RUNGS if not kernels.missing(r)]
    if len(runs) < 2:
        pytest.skip(f"this CPU runs {len(runs)} rung(s)")
    for r in runs:
        _needs(r)
    first = _run(runs[0], rung_dir)["quant"]
    for r in runs[1:]:
        other = _run(r, rung_dir)["quant"]
        assert other.keys() == first.keys()
        for key, got in first.items():
            assert torch.equal(got, other[key]), (runs[0], r, key)


_ROUNDING = r"""
#include "sd.h"
#include <stdio.h>
#ifdef SD_BF16
#error "the emulation is not under test"
#endif
/* every float: the emulation (sd.h compiled for the avx512 rung) against the instruction (vcvtneps2bf16,
 * allowed in this one function) */
__attribute__((target("avx512bf16"))) static int check(void) {
    unsigned long long bad = 0, nan_bad = 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (unsigned long long b = 0; b < (1ull << 32); b += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)b), lane));
        const __m512i hw = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
        const __m512i em = _mm512_cvtepu16_epi32(sd_cvt_bf16(v));
        const __m512i rd = _mm512_srli_epi32(_mm512_castps_si512(sd_round_bf16(v)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        bad += __builtin_popcount(~nan & (_mm512_cmpneq_epi32_mask(hw, em) | _mm512_cmpneq_epi32_mask(hw, rd)));
        /* a NaN: the quiet NaN 0x7fc0 from both helpers (sd8_rne's), a NaN from the instruction */
        const __mmask16 hw_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(hw, _mm512_set1_epi32(0x7fff)),
                                                         _mm512_set1_epi32(0x7f80));
        nan_bad += __builtin_popcount(nan & (_mm512_cmpneq_epi32_mask(em, _mm512_set1_epi32(0x7fc0)) |
                                             _mm512_cmpneq_epi32_mask(rd, _mm512_set1_epi32(0x7fc0)) | ~hw_nan));
    }
    printf("%llu %llu\n", bad, nan_bad);
    return bad || nan_bad;
}

int main(void) { return check(); }
"""


@pytest.mark.skipif(_cc() is None, reason="no C compiler")
def test_the_avx512_rungs_rounding_to_bf16_is_the_instructions_on_every_float(tmp_path):
    """sd.h's emulation of vcvtneps2bf16 for the avx512 rung (nearest even; denormals to a signed zero as
    the instruction does) gives the instruction's bf16 on all 2^32 floats but NaNs, which become 0x7fc0
    (as the AVX2 rung's sd8_rne): sd_cvt_bf16 and sd_round_bf16 both. Runs where the CPU has BF16."""
    if kernels.missing("avx512-bf16"):
        pytest.skip("this CPU has no vcvtneps2bf16 to compare with")
    src, exe = tmp_path / "rounding.c", tmp_path / "rounding"
    src.write_text(_ROUNDING)
    cmd = [_cc(), "-O2", "-std=gnu11", f"-I{kernels.CSRC}", *kernels.ISA_FLAGS["avx512"], str(src), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split() == ["0", "0"], res.stdout + res.stderr
