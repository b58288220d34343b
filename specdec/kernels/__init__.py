"""Native kernels (``csrc/qmm.c``: quantized products; ``csrc/attention.c``: attention over the KV
cache; ``csrc/products.c``: the products over a range of column tiles and the MLP activations that the
forward and the experts share; ``csrc/forward.c``: every decoder layer of a block in one call, with
``csrc/moe.c``'s experts and ``csrc/recurrent.c``'s recurrent layers of hybrid models), compiled on this
machine with the system C compiler.

``library()`` returns the loaded ``ctypes`` library or None, with ``reason()`` saying why not (no
compiler, no rung this CPU runs, a failed build: ``build_log()`` keeps the compiler's messages), and warns
once when a build failed. The kernels come in rungs (``RUNGS``, top first), one source for all
(``csrc/sd.h``; the AVX2 twins in ``sd_avx2.h``):

- ``avx512-bf16``: AVX-512 F/BW/VL/DQ with VNNI and BF16 (vpdpbusd, vdpbf16ps);
- ``avx512``: AVX-512 F/BW/VL/DQ with VNNI, no BF16 (Cascade Lake, Ice Lake, most cloud Xeons, a Sapphire
  Rapids whose hypervisor hides BF16): the same kernels, the two BF16 instructions emulated (sd.h);
- ``avx2-vnni``: ``avx2`` with AVX-VNNI (Intel client cores since Alder Lake): the quantized products' integer
  dots by vpdpbusd in 256 bits (exact either way: the same bits as ``avx2``);
- ``avx2``: AVX2 with FMA and F16C (AMD Zen 1-3, older Intel client cores, and AVX-512 CPUs without VNNI).

``isa()`` says which one this CPU gets (the top one whose flags it has), ``SPECDEC_ISA`` forces a lower
one it runs (``forced_isa``), and ``python -m specdec.kernels`` prints the ladder. The build (about 10 s
for the AVX2 variant, 15 s for an AVX-512 one, on a 2-core AMD Zen 1 with gcc 12) runs into
``$SPECDEC_HOME/kernels/`` (atomic rename), from ``scripts/setup.sh`` or on first use, once per key: the
sources, the flags, the compiler's version and the instruction-set extensions ``-march=native`` enables on
this machine (its predefined macros), so a cache shared by machines with other CPUs or compilers rebuilds
instead of loading a library the CPU cannot run (SIGILL). The file's name says the rung:
``qmm-<rung>-<key>.so``. ``SPECDEC_KERNELS=0``
turns the native path off; ``SPECDEC_REQUIRE_KERNELS=1`` (.ci/run) makes a missing library an error for
``python -m specdec.kernels`` (exit 1) and fails the native tests instead of skipping them.

What does and does not depend on the build: every product, attention and forward has a PyTorch twin
with the same law (the same int8 quantization of activations, the same integer group dots, the same
roundings to bf16), and each path on its own is batch-invariant, which is what exact speculation needs:
speculative output equals plain decoding's on whichever path a model takes. The bits are not the same
across paths, so the build can change which token wins a near-tie: the int8 activation quantization
(``sd_quantize_rows`` = ``qmm.quantize_rows``) and so the integer dots are bit-identical everywhere, but
the float sums (a quantized product's group sums, bf16 products, softmax and norm reductions) run in
another order in the native kernels than in PyTorch, and the outputs differ in the last bits
(tests/kernels/test_qmm.py and test_attention.py compare them with ``allclose``). Bit-identical: a row
alone and inside any block on the same path and rung (native or PyTorch); the native forward's rows for
any row count, thread count or riding prompt chunks; the quantized products of every rung. Each rung is
exact against itself, not against the others in bf16: the AVX2 rung's bf16 products and reductions differ
from the AVX-512 rungs' in the last bits (``sd_avx2.h``), and the avx512 rung's two FMAs per bf16 pair
differ from vdpbf16ps where it flushes denormals (``sd.h``). A model takes one path and rung for a given
machine and dtype, so plain and speculative decoding always compare like with like.

Architectures: the rungs are x86-64's (``arch_rungs``). On aarch64 (Linux's aarch64, macOS's arm64) there is
no rung yet: ``isa()`` is None, ``build()`` raises a BuildError saying so, the PyTorch path runs, and
``SPECDEC_REQUIRE_KERNELS=1`` requires nothing there (``python -m specdec.kernels`` says so loudly). The first
piece of an Arm rung, the quantized products as NEON with dotprod (``csrc/arm/qmm_neon.c``: bit for bit the
x86 rungs'), is compiled by ``--check-all`` and tested by its own C harness (tests/kernels/test_neon.py,
under qemu-user on x86 machines), never loaded. ``--check-all`` compiles this architecture's rungs and,
compile only, another architecture's where its cross compiler (``CROSS_CC``) is on PATH, else says it
skipped them: never an error.

    python -m specdec.kernels              # the ladder, build now and say what is in use (loudly when nothing is)
    python -m specdec.kernels --check-all  # also compile EVERY rung (no AVX-512 CPU needed), run each this CPU runs
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch  # noqa: F401  (loads the OpenMP runtime the library then shares)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / n for n in ("sd.h", "sd_avx2.h", "qmm_amx.h", "qmm.c", "attention.c", "products.c", "forward.c", "moe.c",
                              "recurrent.c", "repack.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", f"-I{CSRC}"]
# the rungs, top first: the CPU flags (/proc/cpuinfo) each needs; a CPU gets the first it has all of
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")  # the same kernels on 8-lane vectors
AVX512_CPU_FLAGS = (*AVX2_CPU_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
NEEDED_CPU_FLAGS = (*AVX512_CPU_FLAGS, "avx512_bf16")  # the avx512-bf16 rung's
AMX_CPU_FLAGS = (*NEEDED_CPU_FLAGS, "amx_tile", "amx_int8")  # the top rung's: avx512-bf16 with AMX tiles
AVX2_VNNI_CPU_FLAGS = (*AVX2_CPU_FLAGS, "avx_vnni")  # AVX-VNNI: vpdpbusd in 256 bits (Intel since Alder Lake)
RUNG_CPU_FLAGS = {"avx512-amx": AMX_CPU_FLAGS, "avx512-bf16": NEEDED_CPU_FLAGS, "avx512": AVX512_CPU_FLAGS,
                  "avx2-vnni": AVX2_VNNI_CPU_FLAGS, "avx2": AVX2_CPU_FLAGS}
RUNGS = tuple(RUNG_CPU_FLAGS)
# each rung's instruction sets named explicitly (no -march=native): compiles on any x86-64 machine
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")
ISA_FLAGS = {"avx512-amx": (*_AVX512_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-int8"),
             "avx512-bf16": (*_AVX512_FLAGS, "-mavx512bf16"), "avx512": _AVX512_FLAGS,
             "avx2-vnni": (*_AVX2_FLAGS, "-mavxvnni"), "avx2": _AVX2_FLAGS}
# the predefined macros sd.h picks its branch by (the first rung whose macros are all defined)
_AVX512_MACROS = ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__", "__AVX512VNNI__")
_ISA_MACROS = {"avx512-amx": (*_AVX512_MACROS, "__AVX512BF16__", "__AMX_TILE__", "__AMX_INT8__"),
               "avx512-bf16": (*_AVX512_MACROS, "__AVX512BF16__"), "avx512": _AVX512_MACROS,
               "avx2-vnni": ("__AVX2__", "__FMA__", "__F16C__", "__AVXVNNI__"),
               "avx2": ("__AVX2__", "__FMA__", "__F16C__")}
# what each rung is, for the ladder `python -m specdec.kernels` prints
RUNG_NOTES = {"avx512-amx": "avx512-bf16 + AMX-INT8 tiles for the quantized products of 16+ rows (the same bits)",
              "avx512-bf16": "AVX-512 F/BW/VL/DQ + VNNI + BF16 (vpdpbusd, vdpbf16ps)",
              "avx512": "AVX-512 F/BW/VL/DQ + VNNI, bf16 dot products and rounding emulated with AVX-512F",
              "avx2-vnni": "avx2 + AVX-VNNI (vpdpbusd in 256 bits for the quantized products; the same bits)",
              "avx2": "AVX2 + FMA + F16C (8-lane twins, sd_avx2.h)"}
ABI_VERSION = 10

# architectures (``machine_arch``): every rung above is x86-64's; aarch64 has none yet, only the first piece
# of one, compiled (never loaded) by --check-all: {name: (flags, sources)}
RUNG_ARCH = "x86_64"
ARM_PIECES = {"neon-dotprod": (("-O2", "-march=armv8.2-a+dotprod", "-fPIC", "-std=gnu11", "-Wall"),
                               (CSRC / "arm" / "qmm_neon.c",))}
CROSS_CC = {"x86_64": "x86_64-linux-gnu-gcc", "aarch64": "aarch64-linux-gnu-gcc"}  # Debian's cross compilers
PIECES = {"aarch64": ARM_PIECES}  # the pieces of rungs to come, by architecture

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_log: str | None = None
_tried = False


class BuildError(RuntimeError):
    """A failed build; ``log`` holds the compiler's messages."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def required() -> bool:
    """``SPECDEC_REQUIRE_KERNELS=1``: the native kernels must be in use (CI), where this machine's
    architecture has rungs (``arch_rungs``): on aarch64, which has none yet, the PyTorch path runs and
    ``python -m specdec.kernels`` says loudly that the requirement is waived."""
    return _require_asked() and bool(arch_rungs())


def _require_asked() -> bool:
    return os.environ.get("SPECDEC_REQUIRE_KERNELS", "0") not in ("", "0")


def machine_arch() -> str:
    """This machine's architecture: "x86_64" (also for AMD64), "aarch64" (also macOS's arm64), else what
    ``platform.machine()`` says, in lower case."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def arch_rungs(arch: str | None = None) -> dict[str, tuple[str, ...]]:
    """The library's rungs for ``arch`` (default: this machine's), {rung: its instruction-set flags}:
    x86_64's are ``ISA_FLAGS``; aarch64 (and anything else) has none yet."""
    return dict(ISA_FLAGS) if (arch or machine_arch()) == RUNG_ARCH else {}


def no_rung_reason(arch: str | None = None) -> str:
    """Why ``build()`` fails on an architecture without rungs."""
    arch = arch or machine_arch()
    return (f"the native kernels have no rung for {arch} yet (their rungs, {', '.join(ISA_FLAGS)}, are "
            f"{RUNG_ARCH}'s): the PyTorch path runs")


def _waived() -> str:
    """The note of ``python -m specdec.kernels`` where SPECDEC_REQUIRE_KERNELS=1 asks for kernels that this
    architecture has no rung of (else "")."""
    if not _require_asked() or arch_rungs():
        return ""
    return f" (SPECDEC_REQUIRE_KERNELS=1 waived: no rung for {machine_arch()} yet, the PyTorch path runs)"


def _no_rung_tail() -> str:
    """The end of the loud message on an architecture without rungs (else "")."""
    if arch_rungs():
        return ""
    return (f"specdec runs on its PyTorch path on {machine_arch()}: the same arithmetic as the native kernels "
            "(equal up to the last bits).\n"
            "The native kernels are x86-64 only today; the first piece of an Arm rung, the quantized products as\n"
            "NEON with dotprod (csrc/arm/qmm_neon.c), is compiled by --check-all and tested under qemu-user.")


def _flags_of(cpuinfo: str) -> set[str]:
    """The CPU's feature flags in ``/proc/cpuinfo``'s text: x86's "flags" line, aarch64's "Features"
    (e.g. asimddp: the dot-product extension)."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def _cpu_flags() -> set[str]:
    try:
        return _flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def missing(rung: str, flags: set[str] | None = None) -> list[str]:
    """The CPU flags ``rung`` needs that this CPU (or ``flags``) lacks: empty when it runs the rung."""
    flags = _cpu_flags() if flags is None else flags
    return [f for f in RUNG_CPU_FLAGS[rung] if f not in flags]


def isa(flags: set[str] | None = None) -> str | None:
    """The rung the kernels are built for on this CPU: the first of ``RUNGS`` whose flags it has all of,
    "avx512-bf16" (AVX-512 with VNNI and BF16), "avx512" (AVX-512 with VNNI, no BF16: bf16 emulated),
    "avx2", or None (none of them). An AVX-512 CPU without VNNI (Skylake-SP, Skylake-X) gets the avx2
    rung: its int8 dots would need vpmaddubsw in 512 bits, which no rung has yet."""
    if flags is None and not arch_rungs():
        return None  # no rung for this architecture (aarch64 today)
    flags = _cpu_flags() if flags is None else flags
    return next((r for r in RUNGS if not missing(r, flags)), None)


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler (gcc/cc) on PATH")
    return cc


@functools.lru_cache(maxsize=16)
def _predefined(cc: str, flags: tuple[str, ...]) -> str:
    """The macros ``cc`` predefines with ``flags``: its version (``__VERSION__``) and every instruction-set
    extension the flags enable (``-march=native``: this machine's), sorted; raises BuildError."""
    try:
        res = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    except OSError as e:
        raise BuildError(f"could not run the C compiler {cc}: {e.strerror or e}") from e
    if res.returncode != 0:
        raise BuildError(f"{Path(cc).name} {' '.join(flags)} failed: {_first(res.stderr)}", res.stderr)
    return "\n".join(sorted(res.stdout.splitlines()))


def _first(stderr: str) -> str:
    """The compiler's first error line (else its first line)."""
    lines = stderr.strip().splitlines() or ["?"]
    return next((ln for ln in lines if "error" in ln), lines[0])[:300]


def _defined(predefined: str) -> set[str]:
    return set(re.findall(r"^#define (\w+)", predefined, re.M))


def built_isa(predefined: str) -> str | None:
    """The rung (branch of ``sd.h``) a compile with these predefined macros takes, or None."""
    names = _defined(predefined)
    return next((k for k, macros in _ISA_MACROS.items() if all(m in names for m in macros)), None)


def _extensions(predefined: str) -> list[str]:
    """The vector extensions among the predefined macros, e.g. ["AVX", "AVX2", "F16C", "FMA"]."""
    return sorted(n.strip("_") for n in _defined(predefined)
                  if re.fullmatch(r"__(AVX\w*|FMA|F16C|AMX\w*)__", n))


def _target(flags: list[str] | None = None) -> Path:
    """Where the library built with ``flags`` (default ``FLAGS``) lives: keyed by the sources, the flags,
    the compiler and what the flags enable on this machine; named by the variant."""
    flags = FLAGS if flags is None else flags
    from specdec.home import specdec_home  # noqa: PLC0415
    predefined = _predefined(_compiler(), tuple(flags))
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), predefined.encode(),
                                     _cpu_model().encode()])).hexdigest()[:16]
    return specdec_home() / "kernels" / f"qmm-{built_isa(predefined) or 'none'}-{key}.so"


def _compile(cc: str, flags: list[str], out: Path) -> subprocess.Popen:
    """Start compiling the sources with ``flags`` into ``out``."""
    cmd = [cc, *flags, *(str(p) for p in SOURCES if p.suffix == ".c"), "-o", str(out), "-lm"]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise BuildError(f"could not run the C compiler {cc}: {e.strerror or e}") from e


def _build(flags: list[str], force: bool, jobs: dict | None = None) -> Path | None:
    """Build into ``_target(flags)`` unless there; with ``jobs``, start the compile, record it and return None."""
    cc = _compiler()
    out = _target(flags)
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=out.parent)
    proc = _compile(cc, flags, Path(tmp) / out.name)
    if jobs is not None:
        jobs[out] = (proc, tmp, cc)
        return None
    return _finish(out, proc, tmp, cc)


def _finish(out: Path, proc: subprocess.Popen, tmp: str, cc: str) -> Path:
    try:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise BuildError(f"{Path(cc).name} failed: {_first(err)}", err)
        os.replace(Path(tmp) / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def forced_isa() -> str | None:
    """``SPECDEC_ISA`` (a lower rung than this CPU's, e.g. ``avx512`` or ``avx2`` on an AVX-512 BF16
    machine; ``_`` reads as ``-``), checked against the rungs this CPU runs; None when unset. Raises
    BuildError for a rung it cannot run."""
    want = os.environ.get("SPECDEC_ISA", "").strip().lower().replace("_", "-")
    if not want:
        return None
    if want not in ISA_FLAGS:
        raise BuildError(f"SPECDEC_ISA={want!r} is not a rung: use one of {', '.join(ISA_FLAGS)}")
    if missing(want):
        raise BuildError(f"SPECDEC_ISA={want}: this CPU does not run that rung (it lacks {', '.join(missing(want))})")
    return want


def rung_flags(rung: str) -> list[str]:
    """The compiler flags of ``rung`` with its instruction sets named (no -march=native)."""
    return [*[f for f in FLAGS if f != "-march=native"], *ISA_FLAGS[rung]]


def build_flags() -> list[str]:
    """The flags ``build`` compiles with: the forced rung's (``SPECDEC_ISA``), else ``FLAGS``
    (-march=native); raises BuildError for a rung this CPU cannot run."""
    forced = forced_isa()
    return rung_flags(forced) if forced is not None else FLAGS


def build(force: bool = False) -> Path:
    """Compile the kernels for this CPU (skipped when already built), or for the rung ``SPECDEC_ISA``
    forces; raises RuntimeError (BuildError), also on an architecture without rungs (aarch64)."""
    if not arch_rungs():
        raise BuildError(no_rung_reason())
    if forced_isa() is not None:
        return _build(build_flags(), force)
    flags = _cpu_flags()
    if isa(flags) is None:
        lacks = "; ".join(f"{', '.join(missing(r, flags))} ({r})" for r in RUNGS)
        raise BuildError(f"this CPU lacks {lacks}")
    if built_isa(_predefined(_compiler(), tuple(FLAGS))) is None:
        raise BuildError(f"{Path(_compiler()).name} -march=native enables neither AVX-512 VNNI nor AVX2 with FMA "
                         f"and F16C on this {isa(flags)} CPU (a compiler too old for it?)")
    return _build(FLAGS, force)


def check_all(force: bool = False) -> dict[str, Path]:
    """Compile EVERY rung with its instruction sets named (``ISA_FLAGS``; no AVX-512 CPU needed:
    compiling only), each checked to take its own branch of ``sd.h``, and load and run a little
    (``_smoke``) each rung this CPU runs (``missing``); the test run then runs this CPU's build in full
    and tests/kernels/test_rungs.py every rung it runs. Cached like ``build`` (the key names the compiler
    and sources). Returns {rung: library}; raises BuildError naming every rung that failed."""
    cc = _compiler()
    errors, logs, jobs, done = [], [], {}, {}
    for name, extra in arch_rungs().items():  # this architecture's; the others': cross_checks
        flags = rung_flags(name)
        try:
            got = _sd_branch(cc, flags)
            if got != name:
                raise BuildError(f"{Path(cc).name} {' '.join(extra)} selects the {got} branch of sd.h")
            out = _build(flags, force, jobs)  # started: every rung compiles at once
            done[name] = out if out is not None else _target(flags)
        except BuildError as e:
            errors.append(f"{name}: {e}")
            logs.append(f"--- {name} ---\n{e.log}")
    for name, out in list(done.items()):
        if out in jobs:
            try:
                _finish(out, *jobs[out])
            except BuildError as e:
                del done[name]
                errors.append(f"{name}: {e}")
                logs.append(f"--- {name} ---\n{e.log}")
    if errors:
        raise BuildError("; ".join(errors), "\n".join(logs))
    for name, path in done.items():
        if not missing(name):
            _smoke(path, name)
    return done


def cross_checks() -> list[str]:
    """``--check-all``'s other half, never an error: what this machine compiles but cannot load, compiled
    only (objects in a temporary directory, nothing cached): another architecture's rungs with its cross
    compiler (``CROSS_CC``) where that is on PATH, else skipped, and the pieces of rungs to come
    (``ARM_PIECES``) with this machine's compiler on aarch64, the cross compiler elsewhere. A compile that
    fails is said, loudly, not raised: that architecture's own CI fails on it. Returns the lines to print."""
    host, units = machine_arch(), []  # (what, cc or why there is none, flags, sources)
    for arch in CROSS_CC:  # every architecture known: x86_64's rungs, aarch64's pieces
        if arch == host:
            try:
                cc = _compiler()
            except BuildError as e:
                cc = None, str(e)
        else:
            cc = shutil.which(CROSS_CC[arch]) or (None, f"skipped: no cross compiler ({CROSS_CC[arch]} not on PATH)")
        if arch != host:
            lib_src = tuple(p for p in SOURCES if p.suffix == ".c")
            units += [(f"the {name} rung ({arch})", cc, [f for f in rung_flags(name) if f != "-shared"], lib_src,
                       name) for name in arch_rungs(arch)]
        for name, (flags, srcs) in PIECES.get(arch, {}).items():
            files = ", ".join(p.relative_to(CSRC).as_posix() for p in srcs)
            units.append((f"the {name} piece of an {arch} rung ({files}; not in the library yet)", cc,
                          list(flags), srcs, None))
    lines, jobs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (what, cc, flags, srcs, branch) in enumerate(units):
            if isinstance(cc, tuple):
                lines.append(f"specdec kernels: {what}: {cc[1]}")
                continue
            try:
                if branch is not None and (got := _sd_branch(cc, flags)) != branch:
                    raise BuildError(f"it selects the {got} branch of sd.h")
                out = Path(tmp) / str(i)  # one compiler per unit, all at once (as check_all's rungs)
                out.mkdir()
                proc = subprocess.Popen([cc, *flags, "-c", *(str(s) for s in srcs)], cwd=out,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            except (BuildError, OSError) as e:
                lines.append(f"specdec kernels: WARNING: {what} did NOT compile ({Path(cc).name}): {e}")
                continue
            jobs.append((len(lines), what, cc, proc))
            lines.append("")
        for at, what, cc, proc in jobs:
            err = proc.communicate()[1]
            lines[at] = (f"specdec kernels: {what}: compiled only ({Path(cc).name})" if proc.returncode == 0 else
                         f"specdec kernels: WARNING: {what} did NOT compile ({Path(cc).name}): {_first(err)}")
    return lines


def _sd_branch(cc: str, flags: list[str]) -> str | None:
    """The branch of ``sd.h`` that ``flags`` select, read from the preprocessed header itself."""
    try:
        res = subprocess.run([cc, *flags, "-dM", "-E", str(CSRC / "sd.h")], capture_output=True, text=True)
    except OSError as e:
        raise BuildError(f"could not run the C compiler {cc}: {e.strerror or e}") from e
    if res.returncode != 0:
        raise BuildError(f"{Path(cc).name} failed on sd.h: {_first(res.stderr)}", res.stderr)
    names = _defined(res.stdout)
    if "SD_AVX512" in names:
        return "avx512-amx" if "SD_AMX" in names else "avx512-bf16" if "SD_BF16" in names else "avx512"
    if "SD_AVX2" in names:
        return "avx2-vnni" if "SD_AVX2_VNNI" in names else "avx2"
    return None


def _smoke(path: Path, name: str) -> None:
    """Run the library at ``path`` a little: its ABI version, an int8 quantization of activations
    (each group of 32 scaled so its largest magnitude is 127, every code within half a step). The bf16
    products of every rung this CPU runs (emulated on the avx512 rung) are tests/kernels/test_rungs.py's."""
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    if lib.sd_abi_version() != ABI_VERSION:
        raise BuildError(f"{name}: the library's ABI version is {lib.sd_abi_version()}, not {ABI_VERSION}")
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    xq, a = torch.empty(5, 96, dtype=torch.int8), torch.empty(5, 3)
    am = torch.empty_like(a)
    lib.sd_quantize_rows(x.data_ptr(), 5, 96, xq.data_ptr(), a.data_ptr(), am.data_ptr())
    q, xf = xq.float().view(5, 3, 32), x.float().view(5, 3, 32)
    ok = (torch.equal(q.abs().amax(-1), torch.full((5, 3), 127.0))
          and bool(((q * a[..., None] - xf).abs() <= a[..., None] * 0.501).all()))
    if not ok:
        raise BuildError(f"{name}: the library's int8 quantization of activations is wrong")


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.sd_abi_version.restype = i32
    lib.sd_amx_available.restype = i32
    lib.sd_amx_use.argtypes = [i32]
    lib.sd_amx_use.restype = None
    lib.sd_linear.argtypes = [p, i64, i64, p, p, i64, i32, i32, p, p, i32]
    lib.sd_linear.restype = i32
    lib.sd_quantize_rows.argtypes = [p, i64, i64, p, p, p]
    lib.sd_repack.argtypes = [p, p, i64, i64, i32, i32, p, p]
    lib.sd_repack.restype = i32
    lib.sd_quantize_rows.restype = None
    lib.sd_attention.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.sd_attention.restype = i32
    lib.sd_forward.argtypes = [p, p]
    lib.sd_forward.restype = i32
    lib.sd_forward_work_bytes.argtypes = [p, i64, i64, i64]
    lib.sd_forward_work_bytes.restype = i64
    lib.sd_num_threads.restype = i64
    lib.sd_forward_struct_sizes.argtypes = [p]
    lib.sd_forward_struct_sizes.restype = None
    lib.sd_matmul.argtypes = [p, p, i64, p, i32, p, i64]
    lib.sd_matmul.restype = i32
    lib.sd_matmul_work_bytes.argtypes = [p, i64]
    lib.sd_matmul_work_bytes.restype = i64


def library() -> ctypes.CDLL | None:
    """The native library, built and loaded on first call; None (see ``reason()``) if unavailable. A
    build that failed (not one turned off) warns once: the PyTorch fallback is several times slower."""
    global _lib, _reason, _log, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("SPECDEC_KERNELS", "1") == "0":
        _reason = "turned off by SPECDEC_KERNELS=0"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
        _declare(lib)
        if lib.sd_abi_version() != ABI_VERSION:
            raise RuntimeError("stale build (ABI version differs)")
        _lib = lib
    except (RuntimeError, OSError) as e:
        _reason, _log = str(e), getattr(e, "log", None)
        warnings.warn(f"specdec: the native kernels are not in use ({_reason}); the PyTorch fallback runs, "
                      "several times slower (`python -m specdec.kernels` says why)", RuntimeWarning, stacklevel=2)
    return _lib


def reason() -> str | None:
    """Why ``library()`` is None (None when it loaded or was not tried yet)."""
    return _reason


def build_log() -> str | None:
    """The compiler's messages of the failed build behind ``reason()`` (None if there were none)."""
    return _log


def reset() -> None:
    """Forget the loaded state (tests switch the native path off and on)."""
    global _lib, _reason, _log, _tried
    _lib, _reason, _log, _tried = None, None, None, False


def _loud(title: str, why: str, log: str | None, tail: str) -> None:
    """A message setup's reader cannot miss: a framed block on stderr with the compiler's messages."""
    import sys  # noqa: PLC0415
    bar = "=" * 100
    lines = [bar, f"specdec kernels: {title}", f"  why: {why}"]
    if log and log.strip():
        msgs = log.strip().splitlines()
        lines += ["  the compiler said:"] + [f"    {ln}" for ln in msgs[:40]]
        if len(msgs) > 40:
            lines.append(f"    ... ({len(msgs) - 40} more lines)")
    lines += [f"  {ln}" for ln in tail.splitlines()] + [bar]
    print("\n".join(lines), file=sys.stderr)


def ladder() -> list[str]:
    """The rungs (top first), whether this CPU runs each and why not, which one it gets and why, and
    whether ``SPECDEC_ISA`` forced it: the lines ``python -m specdec.kernels`` prints first."""
    flags = _cpu_flags()
    lines = [f"specdec kernels: the rungs, top first (this CPU: {_cpu_model() or '?'}):"]
    for r in RUNGS:
        lacks = missing(r, flags)
        lines.append(f"  {r:<12} {'runs here' if not lacks else 'not here':<10} {RUNG_NOTES[r]}"
                     + (f"; this CPU lacks {', '.join(lacks)}" if lacks else ""))
    mine = isa(flags)
    if mine is None:
        own = "this CPU runs no rung: the PyTorch fallback"
    else:
        own = f"this CPU gets {mine}: the top rung whose flags it has"
        if mine == "avx2" and "avx512f" in flags:
            own += " (AVX-512 without VNNI takes the avx2 rung)"
    want = os.environ.get("SPECDEC_ISA", "").strip()
    if not want:
        lines.append(f"specdec kernels: {own} (SPECDEC_ISA unset)")
    else:
        try:
            forced = forced_isa()
            lines.append(f"specdec kernels: SPECDEC_ISA={want} forces {forced} (unforced, {own})")
        except BuildError as e:
            lines.append(f"specdec kernels: {e}; unforced, {own}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.kernels [--check-all] [--force]``: print the ladder of rungs, build (``--force``:
    again), load and say what is in use; exit 1 when the kernels are not in use and
    ``SPECDEC_REQUIRE_KERNELS=1``, or when ``--check-all`` finds a rung that does not compile (or, for a
    rung this CPU runs, does not run)."""
    import argparse  # noqa: PLC0415
    ap = argparse.ArgumentParser(prog="python -m specdec.kernels", description=main.__doc__)
    ap.add_argument("--check-all", action="store_true",
                    help="also compile every rung of this architecture (no AVX-512 CPU needed) and run each one "
                         "this CPU runs; other architectures' with a cross compiler, where one is installed")
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached library has the same key")
    args = ap.parse_args(argv)
    print("\n".join(ladder()))
    if not arch_rungs():
        print(f"specdec kernels: these rungs are {RUNG_ARCH}'s; this {machine_arch()} machine has none yet")
    if args.force and os.environ.get("SPECDEC_KERNELS", "1") != "0":
        try:
            build(force=True)
        except (RuntimeError, OSError):
            pass  # library() below says why
        reset()
    rc = 0
    with warnings.catch_warnings():  # said below, loudly
        warnings.simplefilter("ignore", RuntimeWarning)
        lib = library()
    if lib is None:
        need = required()
        _loud("NOT BUILT, NOT IN USE" + (" (SPECDEC_REQUIRE_KERNELS=1: an error)" if need else _waived()),
              reason() or "?", build_log(), _no_rung_tail() or
              "specdec runs on its PyTorch fallback: the same arithmetic (equal up to the last bits), several times slower.\n"
              "The kernels need gcc (or $CC) and a CPU with AVX-512 VNNI or AVX2 with FMA and F16C;\n"
              "fix the cause above, then rerun `python -m specdec.kernels` (or scripts/setup.sh).")
        rc = 1 if need else 0
    else:
        flags = build_flags()
        predefined = _predefined(_compiler(), tuple(flags))
        version = re.search(r'__VERSION__ "([^"]*)"', predefined)
        how = "-march=native" if "-march=native" in flags else f"SPECDEC_ISA={forced_isa()}"
        print(f"specdec kernels: built for {built_isa(predefined)} and loaded ({_target(flags)}; "
              f"{Path(_compiler()).name} {version.group(1) if version else '?'}, {how}: "
              f"{' '.join(_extensions(predefined))})")
        if how == "-march=native" and built_isa(predefined) != isa():
            print(f"specdec kernels: note: this CPU has {isa()}, the compiler built {built_isa(predefined)}")
    if args.check_all:
        try:
            built = check_all(force=args.force)
        except (RuntimeError, OSError) as e:
            _loud("a rung does NOT compile (--check-all)", str(e), getattr(e, "log", None),
                  f"Every rung ({', '.join(RUNGS)}) must compile on every machine (CI checks it).")
            return 1
        for name, path in built.items():
            lacks = missing(name)
            ran = "compiled and ran" if not lacks else f"compiled only (this CPU lacks {', '.join(lacks)})"
            print(f"specdec kernels: the {name} rung {ran} ({path})")
        if not built:
            print(f"specdec kernels: {machine_arch()} has no rung of the library yet: none to compile and run here")
        print("\n".join(cross_checks()))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
