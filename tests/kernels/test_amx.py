"""The quantized products on AMX tiles (the avx512-amx rung, csrc/qmm_amx.h): the same integer dots as the
vpdpbusd path and the same float steps after them, so the same bits, in every format and code width, for
blocks of 16 to 40 rows (full tile blocks of 16 and shorter last ones; 4-15 rows take the vpdpbusd path),
fp32 and bf16 out. Runs where this CPU has AMX and Linux grants the tiles; the avx512-amx rung's full bit
tests are test_rungs.py's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specdec import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_qmm_formats import CASES, two_level  # noqa: E402

from specdec.kernels import qmm  # noqa: E402


@pytest.fixture
def amx():
    lib = kernels.library()
    if lib is None or not lib.sd_amx_available():
        pytest.skip("no AMX here (this CPU, its rung or Linux: `python -m specdec.kernels` says which)")
    yield lib
    lib.sd_amx_use(1)


def test_the_tiles_give_the_bits_of_the_vpdpbusd_path(amx):
    g = torch.Generator().manual_seed(11)
    mats = {f"affine-int{b}": qmm.from_float(torch.randn(53, 768, generator=g), b, torch.randn(53, generator=g))
            for b in (4, 8)}
    for fmt, bits in CASES:
        mats[f"fmt{fmt}-int{bits}"] = qmm.from_fields(two_level(53, 768, fmt, bits, seed=11), bits, None)
    x = (torch.randn(40, 768, generator=g) * 3).bfloat16()
    for name, w in mats.items():
        for dt in (torch.float32, torch.bfloat16):
            amx.sd_amx_use(0)
            plain = qmm.linear(x, w, dt)
            amx.sd_amx_use(1)
            for m in (4, 5, 15, 16, 17, 33, 40):
                assert torch.equal(qmm.linear(x[:m], w, dt), plain[:m]), (name, dt, m)


def test_the_switch_says_what_runs(amx):
    amx.sd_amx_use(0)
    assert amx.sd_amx_available() == 0
    amx.sd_amx_use(1)
    assert amx.sd_amx_available() == 1
