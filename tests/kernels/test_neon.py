"""The first piece of an Arm rung: the quantized products as NEON with the dot-product extension
(specdec/kernels/csrc/arm/qmm_neon.c; not part of the library yet). Its C harness
(tests/kernels/csrc/test_qmm_neon.c: fixed inputs, every block of 1..8 rows against single-row calls,
every row against a scalar reference of the same codes and float steps) is cross-compiled with
aarch64-linux-gnu-gcc and run under qemu-user on x86 machines, natively on an aarch64 one with dotprod.
Without the cross compiler or qemu the tests skip; under SPECDEC_REQUIRE_NEON=1 (.ci/run, whose setup
installs both where apt-get is there) they fail instead."""
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from native_util import require_native
from specdec import kernels

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "kernels" / "csrc" / "test_qmm_neon.c"
ARM = kernels.CSRC / "arm"
CFLAGS = ["-O2", "-march=armv8.2-a+dotprod", "-Wall", f"-I{ARM}"]
SYSROOT = "/usr/aarch64-linux-gnu"


def required() -> bool:
    """``SPECDEC_REQUIRE_NEON=1``: the NEON bit tests must run (CI)."""
    return os.environ.get("SPECDEC_REQUIRE_NEON", "0") not in ("", "0")


def toolchain() -> tuple[list[str], list[str]] | str:
    """(the compiler, the prefix that runs an aarch64 program) on this machine, or why there are none."""
    qemu = shutil.which("qemu-aarch64")
    if kernels.machine_arch() == "aarch64":
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if not cc:
            return "no C compiler"
        if "asimddp" in kernels._cpu_flags():
            return [cc], []
        if qemu:  # a CPU without dotprod (Cortex-A72, Graviton 1): its emulation
            return [cc], [qemu, "-cpu", "max"]
        return "this CPU has no dotprod (asimddp) and qemu-aarch64 is not installed"
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if not cc or not qemu:
        return ("no aarch64 cross compiler and qemu-user (apt-get install gcc-aarch64-linux-gnu qemu-user): "
                f"aarch64-linux-gnu-gcc {'found' if cc else 'missing'}, qemu-aarch64 {'found' if qemu else 'missing'}")
    return [cc], [qemu, "-L", SYSROOT]


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    """The harness compiled and run once (with --dump: its sd_linear calls, for the x86 comparison)."""
    tools = toolchain()
    if isinstance(tools, str):
        if required():
            pytest.fail(f"{tools} (SPECDEC_REQUIRE_NEON=1: the NEON bit tests must run)", pytrace=False)
        pytest.skip(tools)
    cc, run = tools
    tmp = tmp_path_factory.mktemp("neon")
    exe, dump = tmp / "test_qmm_neon", tmp / "linear.bin"
    build = subprocess.run([*cc, *CFLAGS, str(HARNESS), "-o", str(exe), "-lm"], capture_output=True, text=True,
                           timeout=120)
    assert build.returncode == 0, f"{' '.join(cc)} failed:\n{build.stderr}"
    res = subprocess.run([*run, str(exe), "--dump", str(dump)], capture_output=True, text=True, timeout=120)
    return res, dump


def test_the_neon_products_are_bit_identical_to_the_scalar_reference_and_across_blocks(harness_run):
    res, _ = harness_run
    assert res.returncode == 0, f"the harness failed:\n{res.stdout}{res.stderr}"
    assert "test_qmm_neon: 32 cases, " in res.stdout and "all bit-identical" in res.stdout, res.stdout


def _records(path: Path):
    """The dumped sd_linear calls: (fmt, bits, M, N, K, out_f32, x, w, st, bias, y)."""
    buf, off = path.read_bytes(), 0
    while off < len(buf):
        fmt, bits, m, n, k, f32, has_bias, wb, sb, yb = struct.unpack_from("<10q", buf, off)
        off += 80
        parts = []
        for size in (m * k * 2, wb, sb, n * 4 if has_bias else 0, yb):
            parts.append(torch.frombuffer(bytearray(buf[off:off + size]), dtype=torch.uint8) if size else None)
            off += size
        yield fmt, bits, m, n, k, f32, *parts


def test_the_neon_products_give_the_x86_rungs_bits(harness_run):
    """The same calls (every format, both code widths, fp32 and bf16 outputs, with and without a bias)
    through this machine's x86 library: the same bits, so a model's quantized products will not change
    when it moves between an x86 and an Arm machine (the harness also proves its packing is qmm.c's)."""
    res, dump = harness_run
    assert res.returncode == 0, res.stderr
    lib = require_native()  # skips without the x86 library (on aarch64: no rung yet)
    n = 0
    for fmt, bits, m, nn, k, f32, x, w, st, bias, want in _records(dump):
        y = torch.empty_like(want)
        rc = lib.sd_linear(x.data_ptr(), m, k, w.data_ptr(), st.data_ptr(), nn, bits, fmt,
                           bias.data_ptr() if bias is not None else None, y.data_ptr(), f32)
        assert rc == 0
        assert torch.equal(y, want), f"format {fmt}, {bits}-bit codes, fp32 {f32}, bias {bias is not None}"
        n += 1
    assert n == 32
