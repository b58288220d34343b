"""llama.cpp for the tests: its source (the converter, ``convert_hf_to_gguf.py``) and its built tools
(``llama-quantize``), from ``scripts/build_llamacpp.sh``, and the tiny family models converted by it.

A test that needs them skips when they cannot be had (no network for the sdist, no compiler), unless
``SPECDEC_REQUIRE_LLAMACPP=1`` (.ci/run), where it fails instead: a broken download or build must not
pass as skips.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "build_llamacpp.sh"


def unavailable(why: str):
    """Skip (fail under SPECDEC_REQUIRE_LLAMACPP=1): llama.cpp or what its converter needs is missing."""
    if os.environ.get("SPECDEC_REQUIRE_LLAMACPP", "") not in ("", "0"):
        pytest.fail(f"llama.cpp is required (SPECDEC_REQUIRE_LLAMACPP=1) but {why}", pytrace=False)
    pytest.skip(f"llama.cpp unavailable: {why}")


def _run_script(*args: str, timeout: int, **env: str) -> Path:
    try:
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), **env})
    except (OSError, subprocess.TimeoutExpired) as e:
        unavailable(f"scripts/build_llamacpp.sh {' '.join(args)} did not finish: {e}")
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not Path(lines[-1]).is_dir():
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        unavailable(f"scripts/build_llamacpp.sh {' '.join(args)} failed (exit {out.returncode}):\n{tail}")
    return Path(lines[-1])


def llamacpp_source() -> Path:
    """llama.cpp's source directory (download + extract, no build), with what its converter imports."""
    try:
        import sentencepiece  # noqa: F401  (the converter's vocabulary readers import it first)
    except ImportError:
        unavailable("sentencepiece, which llama.cpp's converter imports, is not installed (pip install -e '.[test]')")
    src = _run_script("--source-only", timeout=900)
    if not (src / "convert_hf_to_gguf.py").is_file():
        unavailable(f"{src} has no convert_hf_to_gguf.py")
    return src


def llamacpp_bin() -> Path:
    """The directory of the built quantizer (``llama-quantize`` alone, as .ci/run builds it: ggml and libllama,
    minutes the first time)."""
    return _run_script(timeout=3600, LLAMACPP_TOOLS="llama-quantize")


def convert(src: Path, jobs: list[tuple], log: Path) -> None:
    """Run llama.cpp's converter over ``jobs`` ((model_dir, outtype, outfile[, extra args]), ...) in one
    process (tests/llamacpp_convert.py); a failure shows the converter's own words."""
    spec = log.with_suffix(".json")
    spec.write_text(json.dumps([[str(a) if isinstance(a, Path) else a for a in job] for job in jobs]))
    helper = Path(__file__).resolve().parent / "llamacpp_convert.py"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, str(helper), str(src), str(spec)], stdout=f, stderr=subprocess.STDOUT,
                            timeout=900).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        pytest.fail(f"llama.cpp's converter failed (exit {rc}; log {log}):\n{tail}", pytrace=False)


def quantize(bin_dir: Path, src: Path, out: Path, kind: str, *extra: str) -> Path:
    """``llama-quantize [extra] src out kind``."""
    res = subprocess.run([str(bin_dir / "llama-quantize"), *extra, str(src), str(out), kind],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"llama-quantize {kind} failed:\n{res.stderr[-3000:]}", pytrace=False)
    return out
