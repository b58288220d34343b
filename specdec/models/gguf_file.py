"""GGUF files -> a Hugging Face-style model directory (config, bf16 safetensors, tokenizer).

Conversion writes into a temp directory beside the target and renames it at the end, so the
cache holds a complete model directory or none.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.models import registry
from specdec.models.hf import one_line
from specdec.models.progress import ModelProgress


def convert_gguf(gguf_path: Path, target: Path, *, progress: ModelProgress | None = None) -> Path:
    """Convert a GGUF file into the model directory ``target``, atomically (temp dir + rename)."""
    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader, gguf_path)  # a file that fails these checks shows no progress
    if progress is not None:  # building the tokenizer is conversion too (it was counted as the check)
        progress.phase("convert", 1, "converting")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        registry.remove_stale_temp(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-{target.name}-", dir=target.parent))
    except OSError as e:
        raise SpecdecError(f"could not write to {target.parent} ({e.strerror or e}): free disk space "
                           "or fix permissions (or set SPECDEC_HOME), then try again") from e
    try:
        write_tokenizer_from_gguf(gguf_path, tmp, _field(reader, "tokenizer.ggml.pre"),  # fails fast
                                  model_type=config.to_hf().get("model_type"))
        write_safetensors_from_gguf(reader, config, tmp / "model.safetensors", progress)
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


_READER = None


def _reader_class():
    """gguf's GGUFReader over a plain ndarray view of its memory map (subclass made on first use).

    The reader parses metadata with one tiny slice per value, and slicing an ``np.memmap`` costs
    ~10x a plain array's (its ``__array_finalize__``): a 49k-token vocabulary took 2.3 s to parse,
    0.7 s this way. The view shares the map's pages (nothing is copied or read ahead); ``path``
    keeps the file name the memmap carried.
    """
    global _READER
    if _READER is None:
        import gguf

        class PlainViewReader(gguf.GGUFReader):
            @property
            def data(self):
                return self._plain

            @data.setter
            def data(self, mapped) -> None:
                self.path = getattr(mapped, "filename", None)
                self._plain = mapped.view(np.ndarray)

        _READER = PlainViewReader
    return _READER


def open_gguf(path: Path):  # -> gguf.GGUFReader
    """A GGUFReader over ``path``, or a one-line SpecdecError if the file is not a whole GGUF."""
    try:
        reader = _reader_class()(str(path))
        size = os.path.getsize(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} runs past the end of the file")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, OSError) as e:
        raise SpecdecError(f"'{path}' is not a valid GGUF file (truncated or corrupt): {one_line(e)}; "
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


def write_safetensors_from_gguf(reader, config: ModelConfig, out: Path, progress: ModelProgress | None = None,
                                chunk_elements: int = 1 << 22) -> None:
    """Dequantize tensor by tensor (big ones row-chunk by row-chunk) straight into bf16 safetensors.

    The header is known from the shapes alone, so no more than one tensor is ever in memory. The
    blocks are read with plain file reads, not through the reader's memory map, whose touched
    pages would count in the process's resident memory until the reader is gone.
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
    progress = progress or ModelProgress(out.name, enabled=False)
    progress.phase("convert", offset, "converting")
    with open(out, "wb") as f, open(getattr(reader, "path", None) or reader.data.filename, "rb") as src:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, t, shape in plan:
            n_rows, _ = _row_layout(t)  # shapes only: no page of the memory map is read
            is_q, is_k = ".q_proj." in name, ".k_proj." in name
            if config.architecture == "llama" and (is_q or is_k):
                data = _read_rows(src, t, 0, n_rows)
                w = np.asarray(gguf.dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
                n_head = config.num_attention_heads if is_q else config.num_key_value_heads
                _write_bf16(f, unpermute_qk(w, n_head))
            else:
                rows = max(1, chunk_elements // max(1, math.prod(shape) // n_rows))
                for r in range(0, n_rows, rows):
                    data = _read_rows(src, t, r, min(n_rows, r + rows))
                    _write_bf16(f, gguf.dequantize(data, t.tensor_type))
            progress.advance(2 * math.prod(shape))
        if f.tell() != 8 + len(head) + offset:
            raise SpecdecError(f"converting to {out} wrote {f.tell()} bytes instead of "
                               f"{8 + len(head) + offset}: report this as a bug")


def _row_layout(t) -> tuple[int, int]:
    """(rows, items per row) of GGUF tensor ``t``'s raw blocks as ``t.data`` lays them out."""
    shape = [int(n) for n in t.data.shape]
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (1, shape[0])


def _read_rows(src, t, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of GGUF tensor ``t``'s raw blocks, read from the open file ``src``."""
    _, row_items = _row_layout(t)
    item = t.data.dtype.itemsize
    src.seek(int(t.data_offset) + start * row_items * item)
    raw = np.frombuffer(src.read((stop - start) * row_items * item), dtype=t.data.dtype)
    return raw.reshape(stop - start, row_items)  # (rows, items): what gguf.dequantize takes


def _write_bf16(f, w: np.ndarray) -> None:
    w = np.ascontiguousarray(w, dtype=np.float32)
    x = torch.from_numpy(w if w.flags.writeable else w.copy()).to(torch.bfloat16)
    f.write(x.view(torch.int16).numpy().tobytes())


def write_tokenizer_from_gguf(gguf_path: Path, out_dir: Path, pre: str | None, model_type: str | None = None) -> None:
    """Build the fast tokenizer the GGUF metadata describes and save it (chat template included).

    ``model_type`` (the config's, known from our own read of the metadata) picks the tokenizer class
    as AutoTokenizer would from it: told nothing, AutoTokenizer parses the whole GGUF once more with
    gguf's generic reader just to learn the model type (5 s for SmolLM2, 15 s for Qwen2.5's vocabulary:
    most of a first run's wait). The files saved are the same either way
    (tests/models/test_gguf_reading.py).
    """
    import transformers
    from tokenizers import normalizers, pre_tokenizers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        backend_cls = getattr(transformers, "TokenizersBackend", None)  # transformers 5
        if model_type in TOKENIZER_MAPPING_NAMES:
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name, tokenizer_type=model_type)
        elif model_type is not None and backend_cls is not None:  # AutoTokenizer's choice: no class for the type
            tok = backend_cls.from_pretrained(where, gguf_file=name)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise SpecdecError(f"could not build a tokenizer from '{gguf_path}' ({one_line(e)}): the "
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
