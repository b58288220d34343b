"""Building the native kernels (kernels/__init__.py): a failed build is loud and, where the kernels are
required (CI), an error; both instruction-set variants compile on any machine; the cache key names what
the library was built for, so a shared cache never hands a CPU a library it cannot run."""
import fnmatch
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from native_util import require_native
from specdec import kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private SPECDEC_HOME and a forgotten load state; the real state comes back afterwards."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    monkeypatch.delenv("SPECDEC_REQUIRE_KERNELS", raising=False)
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


MACROS_512 = ["__AVX__", "__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__",
              "__AVX512DQ__", "__AVX512VNNI__", "__AVX512BF16__"]
MACROS_2 = ["__AVX__", "__AVX2__", "__FMA__", "__F16C__"]


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
    monkeypatch.setattr(kernels, "_predefined", _machine(MACROS_512, "13.1.0"))
    other_cc = kernels._target()
    assert on_512.name.startswith("qmm-avx512-") and on_2.name.startswith("qmm-avx2-")
    assert len({on_512, on_2, other_cc}) == 3
    assert not on_2.exists()  # the AVX2 machine builds its own


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


def test_check_all_names_the_variant_that_does_not_compile(fresh, monkeypatch, capsys):
    """The AVX-512 half of the sources was compiled nowhere once CI ran on AVX2-only machines; now
    `python -m specdec.kernels --check-all` (.ci/run) compiles both everywhere and fails on either."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    monkeypatch.setenv("CC", str(_fake_cc(fresh, fail_if="-mavx512bf16")))
    with pytest.raises(kernels.BuildError, match="avx512: fake-cc failed: .*simulated error") as e:
        kernels.check_all()
    assert "avx2:" not in str(e.value) and "--- avx512 ---" in e.value.log
    assert not list((fresh / "home" / "kernels").glob("qmm-avx512-*"))  # nothing cached for a failure
    assert kernels.main(["--check-all"]) == 1
    assert "a variant does NOT compile" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "gcc") is None, reason="no C compiler")
def test_both_variants_compile_here_and_this_cpus_runs():
    """Both instruction sets compile with their flags named (no AVX-512 CPU needed), each takes its own
    branch of sd.h, and the one this CPU has loads and runs (an int8 quantization of activations).
    Cached by key (sources, flags, compiler) in $SPECDEC_HOME/kernels, like the build: ~25 s of
    compiling on 2 cores the first time (.ci/run's `--check-all` has done it by then)."""
    built = kernels.check_all()
    assert set(built) == {"avx512", "avx2"}
    for name, path in built.items():
        assert path.exists() and path.name.startswith(f"qmm-{name}-")


def test_the_headers_ship_with_the_package():
    """pyproject's package data listed csrc/*.c only: an installed (not editable) specdec had no sd.h,
    so its build failed and the kernels vanished."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["specdec.kernels"]
    for src in kernels.SOURCES:
        rel = src.relative_to(Path(kernels.__file__).parent).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel
