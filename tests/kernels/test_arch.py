"""The native kernels by architecture (kernels/__init__.py, issue 57): the rungs are x86-64's; on aarch64
there is none yet, so the build says so, the PyTorch path runs, SPECDEC_REQUIRE_KERNELS=1 (CI) requires
nothing there and `python -m specdec.kernels` says loudly that it is waived; --check-all compiles another
architecture's rungs only with its cross compiler and never fails for them. The architecture and the CPU
flags are simulated, so every test runs on either kind of machine."""
import os
import platform
import shutil
from pathlib import Path

import pytest

from native_util import require_native
from specdec import kernels

# /proc/cpuinfo of an aarch64 Linux machine (a Neoverse N1: dotprod is "asimddp"): no "flags", no "model name"
AARCH64_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
X86_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c\n"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private SPECDEC_HOME and a forgotten load state; the real state comes back afterwards."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    for var in ("SPECDEC_KERNELS", "SPECDEC_REQUIRE_KERNELS", "SPECDEC_ISA"):
        monkeypatch.delenv(var, raising=False)
    kernels.reset()
    yield tmp_path
    monkeypatch.undo()
    kernels.reset()


@pytest.fixture
def aarch64(fresh, monkeypatch):
    """This machine as an aarch64 Linux one (its CPU's Features as the flags)."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: kernels._flags_of(AARCH64_CPUINFO))
    return fresh


def test_the_architecture_is_named_alike_on_linux_and_macos(monkeypatch):
    for machine, arch in (("x86_64", "x86_64"), ("AMD64", "x86_64"), ("aarch64", "aarch64"), ("arm64", "aarch64"),
                          ("riscv64", "riscv64")):
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        assert kernels.machine_arch() == arch
        assert set(kernels.arch_rungs()) == (set(kernels.RUNGS) if arch == "x86_64" else set())


def test_the_cpu_flags_are_x86s_flags_or_aarch64s_features():
    """/proc/cpuinfo's "flags" line is x86's; aarch64's is "Features" (before, its flags read as none)."""
    assert {"asimd", "asimddp", "fphp"} <= kernels._flags_of(AARCH64_CPUINFO)
    assert kernels._flags_of(X86_CPUINFO) == {"fpu", "sse2", "avx2", "fma", "f16c"}
    assert kernels._flags_of("processor\t: 0\n") == set()


def test_on_aarch64_there_is_no_rung_and_the_pytorch_path_runs(aarch64, monkeypatch):
    """isa() is None even where the flags would say otherwise, build() says why without running a
    compiler, and library() is None with that reason (the product's PyTorch twin answers)."""
    import torch

    from specdec.kernels import qmm
    assert kernels.isa() is None
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set(kernels.NEEDED_CPU_FLAGS))  # flags of another machine
    assert kernels.isa() is None
    monkeypatch.setenv("CC", str(aarch64 / "no-such-cc"))  # never run
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    with pytest.raises(kernels.BuildError, match="no rung for aarch64 yet .*: the PyTorch path runs"):
        kernels.build()
    with pytest.warns(RuntimeWarning, match="no rung for aarch64"):
        assert kernels.library() is None
    assert "no rung for aarch64" in kernels.reason() and not kernels.build_log()
    w = qmm.from_float(torch.randn(20, 64), 4)
    assert qmm.linear(torch.randn(3, 64).bfloat16(), w).shape == (3, 20)


def test_on_aarch64_ci_passes_on_the_pytorch_path_and_says_so_loudly(aarch64, monkeypatch, capsys):
    """SPECDEC_REQUIRE_KERNELS=1 (.ci/run) requires the kernels only where the architecture has a rung:
    on aarch64 setup's `python -m specdec.kernels` exits 0 with the requirement waived in a framed block,
    and the native tests skip instead of failing."""
    monkeypatch.setenv("SPECDEC_REQUIRE_KERNELS", "1")
    assert not kernels.required()
    assert kernels.main([]) == 0
    out, err = capsys.readouterr()
    assert "these rungs are x86_64's; this aarch64 machine has none yet" in out
    assert "NOT BUILT, NOT IN USE (SPECDEC_REQUIRE_KERNELS=1 waived: no rung for aarch64 yet" in err
    assert "PyTorch path on aarch64" in err and "=" * 100 in err
    with pytest.raises(pytest.skip.Exception, match="no rung for aarch64"):
        require_native()


def test_on_x86_the_kernels_stay_required(fresh, monkeypatch, capsys):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setenv("SPECDEC_REQUIRE_KERNELS", "1")
    assert kernels.required() and kernels._waived() == "" and kernels._no_rung_tail() == ""
    with pytest.raises(pytest.fail.Exception, match="must be built"):
        require_native()


def _fake_cc(tmp: Path, name: str, fail: bool = False) -> Path:
    """A cross compiler that pretends: `-c` succeeds (or fails with a compiler's error), and its macro
    queries say the branch of sd.h the flags name (as gcc would for x86)."""
    cc = tmp / name
    cc.write_text(f"""#!/bin/sh
case " $* " in *" -dM "*)
  case " $* " in *" -mamx-int8 "*) echo "#define SD_AVX512 1"; echo "#define SD_BF16 1"; echo "#define SD_AMX 1";;
                 *" -mavx512bf16 "*) echo "#define SD_AVX512 1"; echo "#define SD_BF16 1";;
                 *" -mavx512f "*) echo "#define SD_AVX512 1";;
                 *" -mavxvnni "*) echo "#define SD_AVX2 1"; echo "#define SD_AVX2_VNNI 1";;
                 *) echo "#define SD_AVX2 1";; esac; exit 0;; esac
{'echo "forward.c:1:1: error: simulated cross error" >&2; exit 1' if fail else 'exit 0'}
""")
    cc.chmod(0o755)
    return cc


def test_check_all_on_aarch64_cross_compiles_the_x86_rungs_where_it_can(aarch64, monkeypatch, capsys):
    """--check-all on aarch64: no rung of its own to compile and run, the x86 rungs compiled only with
    x86_64-linux-gnu-gcc where that is installed, else skipped, and a cross compile that fails a warning:
    exit 0 every time. The NEON piece compiles with this machine's compiler."""
    monkeypatch.setenv("CC", str(_fake_cc(aarch64, "gcc")))
    monkeypatch.setitem(kernels.CROSS_CC, "x86_64", str(_fake_cc(aarch64, "x86_64-linux-gnu-gcc")))
    assert kernels.check_all() == {}
    assert kernels.main(["--check-all"]) == 0
    out = capsys.readouterr().out
    assert "aarch64 has no rung of the library yet: none to compile and run here" in out
    for rung in kernels.RUNGS:
        assert f"the {rung} rung (x86_64): compiled only (x86_64-linux-gnu-gcc)" in out
    assert ("the neon-dotprod piece of an aarch64 rung (arm/qmm_neon.c; not in the library yet): compiled only (gcc)"
            in out)
    monkeypatch.setitem(kernels.CROSS_CC, "x86_64", "no-such-x86_64-linux-gnu-gcc")
    lines = kernels.cross_checks()
    assert f"specdec kernels: the {kernels.RUNGS[0]} rung (x86_64): skipped: no cross compiler " \
           "(no-such-x86_64-linux-gnu-gcc not on PATH)" in lines
    (aarch64 / "failing").mkdir()
    failing = _fake_cc(aarch64 / "failing", "x86_64-linux-gnu-gcc", fail=True)
    monkeypatch.setitem(kernels.CROSS_CC, "x86_64", str(failing))
    kernels.reset()
    assert kernels.main(["--check-all"]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: the {kernels.RUNGS[-1]} rung (x86_64) did NOT compile (x86_64-linux-gnu-gcc): " \
           "forward.c:1:1: error: simulated cross error" in out


def test_check_all_on_x86_cross_compiles_the_neon_piece_where_it_can(monkeypatch):
    """On x86 the aarch64 side is the NEON piece (csrc/arm/qmm_neon.c): compiled only with
    aarch64-linux-gnu-gcc (the real one where installed), else skipped."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setitem(kernels.CROSS_CC, "aarch64", "no-such-aarch64-linux-gnu-gcc")
    assert kernels.cross_checks() == [
        "specdec kernels: the neon-dotprod piece of an aarch64 rung (arm/qmm_neon.c; not in the library yet): "
        "skipped: no cross compiler (no-such-aarch64-linux-gnu-gcc not on PATH)"]
    monkeypatch.undo()
    if kernels.machine_arch() != "x86_64" or not shutil.which("aarch64-linux-gnu-gcc"):
        if os.environ.get("SPECDEC_REQUIRE_NEON", "0") not in ("", "0"):
            pytest.fail("aarch64-linux-gnu-gcc is missing (SPECDEC_REQUIRE_NEON=1)", pytrace=False)
        pytest.skip("no aarch64 cross compiler on this x86 machine")
    assert kernels.cross_checks() == [
        "specdec kernels: the neon-dotprod piece of an aarch64 rung (arm/qmm_neon.c; not in the library yet): "
        "compiled only (aarch64-linux-gnu-gcc)"]


def test_the_arm_sources_ship_with_the_package():
    import fnmatch
    import tomllib
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["specdec.kernels"]
    for _, srcs in kernels.ARM_PIECES.values():
        for src in srcs:
            assert src.exists()
            assert any(fnmatch.fnmatch(src.relative_to(kernels.CSRC.parent).as_posix(), g) for g in globs), src
