"""Native kernels (``csrc/qmm.c``: quantized products; ``csrc/attention.c``: attention over the KV
cache), compiled on this machine with the system C compiler.

``library()`` returns the loaded ``ctypes`` library or None, with ``reason()`` saying why not (no
compiler, neither AVX-512 VNNI/BF16 nor AVX2 with FMA and F16C, a failed build). ``isa()`` says which
of the two instruction sets the build uses (``csrc/sd.h``: one source, the AVX2 twins in ``sd_avx2.h``). The build (a second or two) runs once per source
and CPU into ``$SPECDEC_HOME/kernels/`` (atomic rename), from ``scripts/setup.sh`` or on first use;
``SPECDEC_KERNELS=0`` turns the native path off. Everything has a PyTorch fallback with the same
arithmetic, so results never depend on whether the build worked, only the speed does.

    python -m specdec.kernels      # build now and say what is in use
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads the OpenMP runtime the library then shares)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / n for n in ("sd.h", "sd_avx2.h", "qmm.c", "attention.c", "forward.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", f"-I{CSRC}"]
NEEDED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")  # the other build: the same kernels on 8-lane vectors
ABI_VERSION = 4

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def isa(flags: set[str] | None = None) -> str | None:
    """The instruction set the kernels are built for on this CPU: "avx512", "avx2" or None (neither)."""
    flags = _cpu_flags() if flags is None else flags
    if all(f in flags for f in NEEDED_CPU_FLAGS):
        return "avx512"
    if all(f in flags for f in AVX2_CPU_FLAGS):
        return "avx2"
    return None


def _target() -> Path:
    from specdec.models.hub import specdec_home  # noqa: PLC0415
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_model().encode()).hexdigest()[:16]
    return specdec_home() / "kernels" / f"qmm-{key}.so"


def build(force: bool = False) -> Path:
    """Compile ``csrc/qmm.c`` for this CPU (skipped when already built); raises RuntimeError."""
    flags = _cpu_flags()
    if isa(flags) is None:
        missing = [f for f in NEEDED_CPU_FLAGS if f not in flags]
        missing2 = [f for f in AVX2_CPU_FLAGS if f not in flags]
        raise RuntimeError(f"this CPU lacks {', '.join(missing)} (AVX-512) and {', '.join(missing2)} (AVX2)")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out = _target()
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        try:
            res = subprocess.run([cc, *FLAGS, *(str(p) for p in SOURCES if p.suffix == ".c"), "-o", str(so), "-lm"], capture_output=True,
                                 text=True)
        except OSError as e:
            raise RuntimeError(f"could not run the C compiler {cc}: {e.strerror or e}") from e
        if res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["?"])[0]
            raise RuntimeError(f"{Path(cc).name} failed: {first[:200]}")
        os.replace(so, out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.sd_abi_version.restype = i32
    lib.sd_linear.argtypes = [p, i64, i64, p, p, i64, i32, p, p, i32]
    lib.sd_linear.restype = i32
    lib.sd_quantize_rows.argtypes = [p, i64, i64, p, p, p]
    lib.sd_quantize_rows.restype = None
    lib.sd_attention.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.sd_attention.restype = i32
    lib.sd_forward.argtypes = [p, p]
    lib.sd_forward.restype = i32
    lib.sd_forward_work_bytes.argtypes = [p, i64, i64, i64]
    lib.sd_forward_work_bytes.restype = i64
    lib.sd_num_threads.restype = i64
    lib.sd_matmul.argtypes = [p, p, i64, p, i32, p, i64]
    lib.sd_matmul.restype = i32
    lib.sd_matmul_work_bytes.argtypes = [p, i64]
    lib.sd_matmul_work_bytes.restype = i64


def library() -> ctypes.CDLL | None:
    """The native library, built and loaded on first call; None (see ``reason()``) if unavailable."""
    global _lib, _reason, _tried
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
        _reason = str(e)
    return _lib


def reason() -> str | None:
    """Why ``library()`` is None (None when it loaded or was not tried yet)."""
    return _reason


def reset() -> None:
    """Forget the loaded state (tests switch the native path off and on)."""
    global _lib, _reason, _tried
    _lib, _reason, _tried = None, None, False


def main() -> int:
    lib = library()
    if lib is None:
        print(f"specdec kernels: not in use ({reason()}); the PyTorch fallback computes the same results, slower")
        return 0
    print(f"specdec kernels: built for {isa()} and loaded ({_target()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
