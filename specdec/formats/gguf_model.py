"""A GGUF file read in place: the model runs the file's own quantized blocks; nothing of its weights is written.

    read = read_gguf(path, torch.bfloat16, torch.device("cpu"))  # -> GGUFModel(config, model, tokenizer, types)

The model is the one ``quantization="gguf"`` makes of the file's converted Hugging Face directory, bit for bit,
without the directory: the config is the file's metadata read straight into a ``ModelConfig``
(``gguf_file.config_from_gguf``, which the directory's ``config.json`` reads back as: ``ModelConfig.to_hf``), the
tokenizer the one the conversion writes (``gguf_file.write_model_files``, kept per file in ``gguf-files/``:
``model_files``); the quantized linears become ``QLinear`` straight from their blocks
(``gguf_blocks.gguf_weights``), their places in the model held meanwhile by placeholders on the meta device, so no
bf16 copy of them is ever made; a quantized token embedding is looked up in its blocks (a tied head's tiles:
``quant.qlinear.QEmbedding``, else the file's map: ``BlockEmbedding``); every other tensor (norms, biases, float
linears, a float embedding table) is read from the file in row chunks and rounded as the conversion stores it
(``gguf_file.tensor_chunks``, ``gguf_file.stored``).
"""
from __future__ import annotations

import hashlib
import math
import re
import shutil
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec import config as config_module
from specdec.formats import gguf_file as gguf_file_module
from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.formats.gguf_file import (config_from_gguf, conversion_plan, gguf_path_of, open_gguf, row_order, stored,
                                      tensor_chunks, undo_conversion, write_model_files)
from specdec.formats.hf import extra_layer
from specdec.models.moe import weight_dtype
from specdec.models.llama import Transformer, rope_frequencies
from specdec.quant.qlinear import QEmbedding, RowLookup, install, linear_names, quantize_model
from specdec.formats.tokenizer import Tokenizer

FLOAT_TYPES = ("F32", "F16", "BF16")  # the GGUF types a tensor keeps unquantized


@dataclass
class GGUFModel:
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    types: Counter  # the file's tensors by GGUF type (Q4_K, Q6_K, F32, ...)


def model_files(reader, path: Path, config: ModelConfig) -> Path:
    """The converted directory's files but its weights (the tokenizer, config.json, generation_config.json) for
    GGUF file ``path``, written once (``gguf_file.write_model_files``: building the tokenizer from the metadata
    takes seconds) into ``$SPECDEC_HOME/gguf-files/``, a few MB, keyed by the file (its resolved path, size and
    modification time) and by the code that writes them and transformers' version: any of them changed, they
    are written again, and the entries they supersede (those of the same file, named in their ``source``) are
    removed, so an updated file or specdec does not leave one more copy behind each time. Written aside and
    renamed into place, so a directory found is a whole one."""
    import transformers  # noqa: PLC0415

    from specdec.home import specdec_home  # noqa: PLC0415

    real = path.resolve()
    st = real.stat()
    code = b"".join(Path(m.__file__).read_bytes() for m in (gguf_file_module, config_module))  # what writes the files
    key = hashlib.sha256(b"\0".join([str(real).encode(), str(st.st_size).encode(), str(st.st_mtime_ns).encode(),
                                      hashlib.sha256(code).digest(), transformers.__version__.encode()])).hexdigest()[:16]
    out = specdec_home() / "gguf-files" / f"{path.stem}-{key}"
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.stem}-", dir=out.parent))  # a dead run's: `specdec cache prune`
    try:
        write_model_files(reader, path, config, tmp)
        (tmp / "source").write_text(str(real))
        tmp.rename(out)
    except OSError:
        if not out.is_dir():  # not another process's whole directory renamed there first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in out.parent.iterdir():  # superseded: the same file's, under an older key (no glob: a name may hold [])
        if old != out and old.name.startswith(f"{path.stem}-") and _source_of(old) == str(real):
            shutil.rmtree(old, ignore_errors=True)
    return out


def _source_of(entry: Path) -> str | None:
    """The GGUF file a ``gguf-files`` entry was written for (its ``source``); None for an entry without one."""
    try:
        return (entry / "source").read_text()
    except OSError:
        return None


def read_gguf(path: Path, dtype: torch.dtype, device: torch.device, recode: str | None = None) -> GGUFModel:
    """The model of GGUF file ``path`` running the file's own quantized blocks (``QLinear``); its other weights
    in ``dtype``. CPU only (the quantized kernels' device). ``recode`` "int4" / "int8": every linear re-quantized
    with our min/max codes instead, from the file's weights rounded to bf16 as the conversion stores them (so
    the codes are those of ``quantization="int4"`` on the converted model), in memory: nothing in the cache."""
    if device.type != "cpu":
        raise SpecdecError("quantization 'gguf' runs on the CPU only: use device='cpu' or a dtype (e.g. "
                           "dtype='bfloat16': the file's blocks dequantized)")
    from specdec.formats.gguf_blocks import gguf_weights  # noqa: PLC0415 (imports the quantized kernels)

    reader = open_gguf(path)
    config = config_from_gguf(reader, path)  # the metadata read straight into the model's config
    # the tokenizer (transformers' import and its vocabulary: 1-2 s) beside the weights, whose native repacking
    # and tensor copies leave the interpreter free
    with ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenizer") as pool:
        tokenizer = pool.submit(lambda: Tokenizer(model_files(reader, path, config), source=path))
        with torch.device("meta"):
            model = Transformer(config)
        weights = gguf_weights(path, config, linear_names(model), reader=reader)
        sd, embedding = _state_dict(reader, config, dtype, weights, tables=recode is None)
        model.load_hf_state_dict(sd)
        tokenizer = tokenizer.result()
    model.inv_freq = rope_frequencies(config)
    if config.rope_local_theta:
        model.inv_freq_local = rope_frequencies(config, local=True)
    if recode is not None:  # one layer at a time: the file's weights, bf16 as converted, then our codes
        bits = 4 if recode == "int4" else 8
        for qual in list(weights):
            weights[qual] = qmm.from_float(qmm.dequantize(weights[qual]).to(torch.bfloat16), bits)
    install(model, weights)
    if embedding is not None:  # rows looked up in the file's blocks: no bf16 table
        lookup = QEmbedding if isinstance(embedding, qmm.QWeight) else BlockEmbedding
        model.embed_tokens = lookup(embedding, model.embed_tokens.weight.dtype)
    if recode is not None:
        quantize_model(model, recode)  # the file's float linears too, as on the converted model
    unread = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unread:
        raise SpecdecError(f"reading '{path}' in place left {unread[0]} unread: report this as a bug; "
                           "dtype='bfloat16' runs the file's blocks dequantized meanwhile")
    return GGUFModel(config, model.eval(), tokenizer, Counter(t.tensor_type.name for t in reader.tensors))


def _state_dict(reader, config: ModelConfig, dtype: torch.dtype, weights: dict[str, qmm.QWeight],
                tables: bool = True) -> tuple[dict[str, torch.Tensor], object | None]:
    """Every weight of the file by Hugging Face name (``model.`` removed), as ``hf.load_state_dict`` reads the
    converted directory's; the rows of the linears in ``weights`` are placeholders on the meta device (their
    shape alone), the multi-token-prediction layers left out (``hf.extra_layer``: method mtp reads them). With
    ``tables``, a quantized token embedding is a placeholder too and where its rows are looked up comes back
    beside (``_embedding_source``; else None)."""
    sd: dict[str, torch.Tensor] = {}
    plan = list(conversion_plan(reader, config))
    # a tied head's tiles are the embedding's blocks already repacked (gguf_weights: the file's own head, else
    # the embedding): the embedding looks its rows up there
    tied = None if any(name == "lm_head.weight" for name, *_ in plan) else weights.get("lm_head")
    embedding = None
    with open(gguf_path_of(reader), "rb") as src:
        for name, parts, shape, kind, _ in plan:
            key = name.removeprefix("model.")
            if extra_layer(key, config.num_hidden_layers):
                continue
            want = weight_dtype(key, dtype)
            if linear_of(name) in weights:
                sd[key] = torch.empty(shape, dtype=want, device="meta")
                continue
            if name == "model.embed_tokens.weight" and tables:
                embedding = _embedding_source(name, parts, shape, kind, config, tied)
                if embedding is not None:
                    sd[key] = torch.empty(shape, dtype=want, device="meta")  # a RowLookup takes its place
                    continue
            out, at = torch.empty(math.prod(shape), dtype=want), 0
            for chunk in tensor_chunks(src, name, parts, shape, config):
                x = stored(chunk, kind).reshape(-1)  # as the converted file holds it, then cast as loading it does
                out[at:at + x.numel()] = x
                at += x.numel()
            sd[key] = out.view(shape)
    return sd, embedding


def _embedding_source(name: str, parts: list, shape: list[int], kind: str, config: ModelConfig,
                      tied: qmm.QWeight | None):
    """Where the quantized token embedding's rows are looked up: a tied LM head's tiles (the same blocks,
    repacked already: ``QEmbedding``), else the file's own tensor (``BlockEmbedding``); None where the table is
    read as the conversion stores it instead (a float type, several parts, a tensor the converter changed)."""
    if kind != "BF16" or len(parts) != 1 or len(shape) != 2:  # (kind: as the conversion stores it; F32/F16 kept)
        return None
    if undo_conversion(name, shape, config) is not None or row_order(name, shape[0], config) is not None:
        return None
    if tied is not None and [tied.out_features, tied.in_features] == list(shape):
        return tied
    return parts[0]


class BlockEmbedding(RowLookup):
    """Rows dequantized straight from the file's map when looked up (the gguf package's ``dequantize``, as the
    conversion reads the table: ``gguf_file.tensor_chunks``): only the rows of the tokens seen are ever read,
    so an untied table costs nothing resident (its tiles took 128 MB for the 1.5B); 1 ms for a decode step's
    rows, 30 ms for 2,048."""

    def __init__(self, tensor, dtype: torch.dtype) -> None:
        k, n = (int(x) for x in tensor.shape)
        super().__init__(n, k, dtype)
        self.blocks = np.asarray(tensor.data).view(np.uint8).reshape(n, -1)  # a view of the map: it stays open
        self.kind = tensor.tensor_type

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        import gguf  # noqa: PLC0415 (imported by the reading already)
        return torch.from_numpy(np.asarray(gguf.dequantize(self.blocks[ids.cpu().numpy()], self.kind),
                                           dtype=np.float32).reshape(len(ids), self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks in the file's map"


def linear_of(name: str) -> str | None:
    """The qualified name of our (possibly fused) linear that holds the rows of Hugging Face weight ``name``, as
    ``gguf_weights`` gathers a linear's parts: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, a Qwen3.5
    delta-net's four input products into ``in_proj``, a tied head's rows from the embedding (which the embedding
    keeps: None for it); None for what is no linear's weight."""
    if name == "lm_head.weight":
        return "lm_head"
    if not name.startswith("model.") or not name.endswith(".weight") or name == "model.embed_tokens.weight":
        return None
    base = name[len("model."):-len(".weight")]
    for pattern, fused in ((r"(.+\.linear_attn\.in_proj)_(?:qkv|z|b|a)", "{}"), (r"(.+)\.[qkv]_proj", "{}.qkv_proj"),
                           (r"(.+)\.(?:gate|up)_proj", "{}.gate_up_proj")):
        m = re.fullmatch(pattern, base)
        if m:
            return fused.format(m.group(1))
    return base


def read_weight(path: Path, names: tuple[str, ...]) -> torch.Tensor:
    """One weight of a GGUF file by its Hugging Face name (the first of ``names`` it holds), as the converted
    directory stores it (``hf.read_weight``: float tensors in their type, quantized blocks as bf16)."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    plan = {name: (parts, shape, kind) for name, parts, shape, kind, _ in conversion_plan(reader, config)}
    name = next((n for n in names if n in plan), None)
    if name is None:
        raise SpecdecError(f"'{path}' has none of {', '.join(names)}")
    parts, shape, kind = plan[name]
    with open(path, "rb") as src:
        return torch.cat([stored(c, kind).reshape(-1) for c in tensor_chunks(src, name, parts, shape, config)]
                         ).view(shape)


def describe(types: Counter, dtype: torch.dtype) -> str:
    """What a model read in place runs as: ``the file's own blocks (Q4_K x 168, Q6_K x 29; F32 x 141 as bf16)``."""
    blocks = [f"{k} x {n}" for k, n in types.most_common() if k not in FLOAT_TYPES]
    floats = [f"{k} x {n}" for k, n in types.most_common() if k in FLOAT_TYPES]
    held = f"{', '.join(floats)} as {dtype_name(dtype)}" if floats else ""
    return f"the file's own blocks ({'; '.join(p for p in (', '.join(blocks), held) if p)})"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
