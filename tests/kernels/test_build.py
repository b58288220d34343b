"""Building the native kernels (kernels/__init__.py): a failed build is loud and, where the kernels are
required (CI), an error; every rung (avx512-amx, avx512-bf16, avx512, avx2) compiles on any machine; the cache key names
what the library was built for, so a shared cache never hands a CPU a library it cannot run; `python -m
specdec.kernels` prints the ladder of rungs. Running every rung this CPU runs: test_rungs.py."""
import fnmatch
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from native_util import require_native
from specdec import kernels

ROOT = Path(__file__).resolve().parents[2]
# the x86 rungs' build, simulated with x86 CPU flags and compilers: an aarch64 machine (no rung yet) skips
# it, and tests/kernels/test_arch.py tests the build by architecture on either kind of machine
pytestmark = pytest.mark.skipif(kernels.machine_arch() != "x86_64",
                                reason="the x86 rungs' build (this architecture's: test_arch.py)")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private SPECDEC_HOME and a forgotten load state; the real state comes back afterwards."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    monkeypatch.delenv("SPECDEC_REQUIRE_KERNELS", raising=False)
    monkeypatch.delenv("SPECDEC_ISA", raising=False)  # these tests simulate CPUs: no rung forced
    kernels.reset()
    yield tmp_path
    monkeypatch.undo()
    kernels.reset()


def test_a_failed_build_is_loud_and_an_error_when_required(fresh, monkeypatch, capsys):
    """Before, `python -m specdec.kernels` printed one line and exited 0 when the build failed, and
    scripts/setup.sh went on: a broken build passed CI on the PyTorch fallback. Now it says so in a
    framed block on stderr (why, the compiler's messages) and exits 1 under SPECDEC_REQUIRE_KERNELS=1."""
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set(kernels.AVX2_CPU_FLAGS))
    assert kernels.main([]) == 0  # a user without a compiler: told, not stopped
    err = capsys.readouterr().err
    assert "NOT BUILT, NOT IN USE" in err and "could not run the C compiler" in err and "no-such-cc" in err
    kernels.reset()
    monkeypatch.setenv("SPECDEC_REQUIRE_KERNELS", "1")
    assert kernels.main([]) == 1
    assert "SPECDEC_REQUIRE_KERNELS=1" in capsys.readouterr().err
    kernels.reset()
    monkeypatch.setenv("SPECDEC_KERNELS", "0")  # turned off is not in use either
    assert kernels.main([]) == 1


def test_a_compiler_error_is_shown_with_its_messages(fresh, monkeypatch, capsys):
    """The compiler's own messages reach the reader (before: the first line of stderr, in reason())."""
    cc = _fake_cc(fresh, fail_if="-march=native")
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set(kernels.AVX2_CPU_FLAGS))
    with pytest.warns(RuntimeWarning, match="not in use"):
        assert kernels.library() is None
    assert "simulated error" in kernels.reason() and "second line" in kernels.build_log()
    kernels.reset()
    assert kernels.main([]) == 0
    assert "the compiler said:" in capsys.readouterr().err


def test_native_tests_fail_instead_of_skipping_when_the_kernels_are_required(monkeypatch):
    """tests/native_util.py: without the library a native test skips, and under
    SPECDEC_REQUIRE_KERNELS=1 (.ci/run) it fails (before: every native module skipped, CI green)."""
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.delenv("SPECDEC_REQUIRE_KERNELS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_native()
    monkeypatch.setenv("SPECDEC_REQUIRE_KERNELS", "1")
    with pytest.raises(pytest.fail.Exception, match="must be built"):
        require_native()


MACROS_2 = ["__AVX__", "__AVX2__", "__FMA__", "__F16C__"]
MACROS_512_NO_BF16 = [*MACROS_2, "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__", "__AVX512VNNI__"]
MACROS_512 = [*MACROS_512_NO_BF16, "__AVX512BF16__"]
MACROS_SKYLAKE_SP = [*MACROS_2, "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__"]  # no VNNI


def _machine(macros: list[str], version: str):
    """What ``cc -march=native -dM -E`` would print on a machine with these extensions and gcc ``version``."""
    return lambda cc, flags: "\n".join(sorted([f"#define {m} 1" for m in macros] + [f'#define __VERSION__ "{version}"']))


def test_the_cache_key_names_the_instruction_sets_and_the_compiler(fresh, monkeypatch):
    """Before, the key was the sources, the flags and the CPU's model name: a VM that reports the same
    model with AVX-512 hidden (or a home directory shared by two machines) loaded the AVX-512 library
    and died of SIGILL at the first product. Now the key holds what -march=native enables and the
    compiler's version, and the file's name says the variant."""
    monkeypatch.setattr(kernels, "_cpu_model", lambda: "Some Virtual CPU")
    monkeypatch.setattr(kernels, "_compiler", lambda: "gcc")
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_512, "12.2.0"))
    on_512 = kernels._target()
    on_512.parent.mkdir(parents=True)
    on_512.write_bytes(b"built on the AVX-512 machine")  # the shared cache
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_2, "12.2.0"))
    on_2 = kernels._target()
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_512_NO_BF16, "12.2.0"))
    on_512_no_bf16 = kernels._target()  # BF16 hidden by the hypervisor
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_SKYLAKE_SP, "12.2.0"))
    on_skx = kernels._target()
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_512, "13.1.0"))
    other_cc = kernels._target()
    assert on_512.name.startswith("qmm-avx512-bf16-") and on_2.name.startswith("qmm-avx2-")
    assert on_512_no_bf16.name.startswith("qmm-avx512-") and not on_512_no_bf16.name.startswith("qmm-avx512-bf16-")
    assert on_skx.name.startswith("qmm-avx2-")  # AVX-512 without VNNI: the avx2 branch of sd.h
    assert len({on_512, on_2, on_512_no_bf16, on_skx, other_cc}) == 5
    assert not on_2.exists() and not on_512_no_bf16.exists()  # each machine builds its own


def test_this_machines_key_comes_from_its_compiler():
    if shutil.which(os.environ.get("CC") or "gcc") is None:
        pytest.skip("no C compiler")
    predefined = kernels._predefined(kernels._compiler(), tuple(kernels.FLAGS))
    assert "__VERSION__" in predefined
    if kernels.isa() is not None:
        assert kernels.built_isa(predefined) == kernels.isa()
        assert kernels._target().name.startswith(f"qmm-{kernels.isa()}-")


def _fake_cc(tmp: Path, fail_if: str) -> Path:
    """A compiler that fails a compile whose flags include ``fail_if`` and pretends to compile the rest
    (an empty output file); its macro queries are gcc's."""
    cc = tmp / "fake-cc"
    cc.write_text(f"""#!/bin/sh
case " $* " in *" -dM "*) exec gcc "$@";; esac
case " $* " in *" {fail_if} "*) echo "csrc/sd.h:1:1: error: simulated error" >&2; echo "second line" >&2; exit 1;; esac
out=""; prev=""
for a; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
: > "$out"
""")
    cc.chmod(0o755)
    return cc


def test_check_all_names_the_rung_that_does_not_compile(fresh, monkeypatch, capsys):
    """The AVX-512 half of the sources was compiled nowhere once CI ran on AVX2-only machines; now
    `python -m specdec.kernels --check-all` (.ci/run) compiles every rung everywhere and fails on any."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    monkeypatch.setenv("CC", str(_fake_cc(fresh, fail_if="-mavx512bf16")))
    with pytest.raises(kernels.BuildError, match="avx512-bf16: fake-cc failed: .*simulated error") as e:
        kernels.check_all()
    assert "avx2:" not in str(e.value) and "avx512:" not in str(e.value) and "--- avx512-bf16 ---" in e.value.log
    assert not list((fresh / "home" / "kernels").glob("qmm-avx512-bf16-*"))  # nothing cached for a failure
    assert kernels.main(["--check-all"]) == 1
    assert "a rung does NOT compile" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_HOME", str(fresh / "home2"))  # the fake compiler's empty outputs cached above
    monkeypatch.setenv("CC", str(_fake_cc(fresh, fail_if="-mavx512vnni")))  # both AVX-512 rungs named
    with pytest.raises(kernels.BuildError, match="avx512-bf16: fake-cc failed.*; avx512: fake-cc failed") as e:
        kernels.check_all()
    assert "avx2:" not in str(e.value)


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "gcc") is None, reason="no C compiler")
def test_every_rung_compiles_here_and_each_this_cpu_runs_runs():
    """Every rung compiles with its flags named (no AVX-512 CPU needed), each takes its own branch of sd.h,
    and each one this CPU runs loads and runs (an int8 quantization of activations, a bf16 product).
    Cached by key (sources, flags, compiler) in $SPECDEC_HOME/kernels, like the build: ~40 s of
    compiling on 2 cores the first time (.ci/run's `--check-all` has done it by then)."""
    built = kernels.check_all()
    assert set(built) == set(kernels.RUNGS) == {"avx512-amx", "avx512-bf16", "avx512", "avx2-vnni", "avx2"}
    for name, path in built.items():
        assert path.exists() and path.name.startswith(f"qmm-{name}-")
        assert name != "avx512" or not path.name.startswith(("qmm-avx512-bf16-", "qmm-avx512-amx-"))
        assert name != "avx2" or not path.name.startswith("qmm-avx2-vnni-")


# /proc/cpuinfo's flags of a few CPUs
ZEN4 = {*kernels.NEEDED_CPU_FLAGS, "avx512_vbmi"}
ICE_LAKE = {*kernels.AVX512_CPU_FLAGS, "avx512_vbmi"}  # or a Sapphire Rapids with BF16 hidden
SKYLAKE_SP = {*kernels.AVX2_CPU_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN1 = set(kernels.AVX2_CPU_FLAGS)
SAPPHIRE_RAPIDS = {*kernels.NEEDED_CPU_FLAGS, "amx_tile", "amx_int8", "amx_bf16", "avx_vnni"}
ALDER_LAKE = {*kernels.AVX2_CPU_FLAGS, "avx_vnni"}  # Intel client cores: AVX-VNNI, no AVX-512


def test_a_cpu_gets_the_top_rung_whose_flags_it_has():
    """Before, an Intel Xeon with AVX-512 and VNNI but no BF16 got the AVX2 build (its 8-lane twins)."""
    assert kernels.isa(SAPPHIRE_RAPIDS) == "avx512-amx"
    assert kernels.isa(ZEN4) == "avx512-bf16"
    assert kernels.missing("avx512-amx", ZEN4) == ["amx_tile", "amx_int8"]
    assert kernels.isa(ICE_LAKE) == "avx512"
    assert kernels.isa(SKYLAKE_SP) == "avx2"  # no VNNI: the avx2 rung
    assert kernels.isa(ZEN1) == "avx2"
    assert kernels.isa(ALDER_LAKE) == "avx2-vnni"
    assert kernels.missing("avx2-vnni", ZEN1) == ["avx_vnni"]
    assert kernels.isa({"avx2", "fma"}) is None
    assert kernels.missing("avx512-bf16", ICE_LAKE) == ["avx512_bf16"]
    assert kernels.missing("avx512", SKYLAKE_SP) == ["avx512_vnni"]


def test_the_ladder_says_what_this_cpu_runs_and_gets(monkeypatch, capsys):
    """`python -m specdec.kernels` prints each rung, whether this CPU runs it (and what it lacks), which
    one it gets and why, and whether SPECDEC_ISA forced it."""
    monkeypatch.delenv("SPECDEC_ISA", raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: ICE_LAKE)
    text = "\n".join(kernels.ladder())
    assert "avx512-bf16  not here" in text and "lacks avx512_bf16" in text
    assert "avx512       runs here" in text and "avx2         runs here" in text
    assert "this CPU gets avx512: the top rung whose flags it has (SPECDEC_ISA unset)" in text
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    assert "SPECDEC_ISA=avx2 forces avx2 (unforced, this CPU gets avx512" in "\n".join(kernels.ladder())
    monkeypatch.setenv("SPECDEC_ISA", "avx512_bf16")  # "_" reads as "-"
    assert "this CPU does not run that rung (it lacks avx512_bf16)" in "\n".join(kernels.ladder())
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: SKYLAKE_SP)
    monkeypatch.delenv("SPECDEC_ISA")
    assert "this CPU gets avx2: the top rung whose flags it has (AVX-512 without VNNI" in "\n".join(kernels.ladder())
    monkeypatch.setenv("SPECDEC_KERNELS", "0")
    monkeypatch.delenv("SPECDEC_REQUIRE_KERNELS", raising=False)  # (CI's: the kernels turned off here on purpose)
    kernels.reset()
    try:
        assert kernels.main([]) == 0
    finally:
        kernels.reset()
    assert "the rungs, top first" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "gcc") is None, reason="no C compiler")
def test_check_all_says_which_rungs_were_compiled_only(monkeypatch, capsys):
    """On a CPU that runs only the avx2 rung, --check-all compiles the AVX-512 rungs and says they were
    compiled only (the cached builds of the test above; the key does not hold the CPU's flags)."""
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: ZEN1)
    monkeypatch.setenv("SPECDEC_KERNELS", "0")
    monkeypatch.delenv("SPECDEC_REQUIRE_KERNELS", raising=False)
    monkeypatch.delenv("SPECDEC_ISA", raising=False)
    kernels.reset()
    try:
        assert kernels.main(["--check-all"]) == 0
    finally:
        kernels.reset()
    out = capsys.readouterr().out
    assert "the avx512-bf16 rung compiled only (this CPU lacks avx512f" in out
    assert "the avx512 rung compiled only (this CPU lacks avx512f" in out
    assert "the avx2 rung compiled and ran" in out


def test_the_headers_ship_with_the_package():
    """pyproject's package data listed csrc/*.c only: an installed (not editable) specdec had no sd.h,
    so its build failed and the kernels vanished."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["specdec.kernels"]
    for src in kernels.SOURCES:
        rel = src.relative_to(Path(kernels.__file__).parent).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel
