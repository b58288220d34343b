"""Hugging Face model directories: ``config.json`` (+ ``generation_config.json``) and safetensors weights."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.models.moe import weight_dtype


def load_model_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of a model directory (eos ids from generation_config.json merged in)."""
    model_dir = Path(model_dir)
    d = read_json(model_dir / "config.json")
    try:
        config = ModelConfig.from_hf(d)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(f"{model_dir / 'config.json'} lacks or mangles field {e}: point to a "
                           "complete Hugging Face model directory") from e
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
        if merged != config.eos_token_ids:
            config = dataclasses.replace(config, eos_token_ids=merged)
    return config




def extra_layer(name: str, num_hidden_layers: int | None) -> bool:
    """Whether weight ``name`` (``model.`` removed) belongs to the multi-token-prediction layers, not the decoder:
    GLM-4.5's sit past the decoder's layers, at ``model.layers.{num_hidden_layers + i}``; Qwen3.5's (and
    Qwen3-Next's) under ``mtp.``, beside the language model (also in a multimodal checkpoint)."""
    if name.startswith("mtp."):
        return True
    if num_hidden_layers is None or not name.startswith("layers."):
        return False
    index = name.split(".", 2)[1]
    return index.isdigit() and int(index) >= num_hidden_layers


def load_state_dict(model_dir: Path, dtype: torch.dtype, extra_layers: bool = False,
                    expert_codes: dict | None = None, pack=None) -> dict[str, torch.Tensor]:
    """All weights in ``model_dir/*.safetensors`` as ``dtype`` (``weight_dtype``), with the leading ``model.``
    removed. The multi-token-prediction layers (``extra_layer``: GLM-4.5's past ``config.json``'s
    ``num_hidden_layers``, Qwen3.5's ``mtp.*``; transformers' models leave them out too) are not the decoder's:
    they are left unread, or with ``extra_layers`` they alone are read (``heads/mtp.py`` loads them).

    MXFP4 experts (gpt-oss's ``*_blocks`` / ``*_scales``, ``quant/mxfp4.py``) come out per expert, one stacked
    tensor at a time: exactly as ``dtype``, or with ``expert_codes`` (a dict it fills) kept as their exact 8-bit
    codes there (packed by ``pack``: ``mxfp4_codes.packed``), a placeholder in the state dict (``mxfp4_codes.attach``
    puts the codes in the built model)."""
    import safetensors

    from specdec.quant import mxfp4  # noqa: PLC0415

    bad_file = getattr(safetensors, "SafetensorError", OSError)  # top-level since 0.4

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"no *.safetensors files in {model_dir}: point to a Hugging Face model "
                           "directory with safetensors weights or a .gguf file")
    config = Path(model_dir) / "config.json"
    layers = read_json(config).get("num_hidden_layers") if config.is_file() else None

    def wanted(name: str) -> bool:
        return extra_layer(name, layers) == extra_layers

    def damaged(path: Path, e: BaseException) -> SpecdecError:
        return SpecdecError(f"could not read weights from {path} ({one_line(e)}): the file is "
                            "damaged; delete the model directory and convert or download it again")

    def read(path: Path, key: str) -> torch.Tensor:
        # one short-lived memory map per tensor: the file's pages leave the process's resident
        # memory as soon as the tensor is copied out, instead of adding the whole file to it
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except (bad_file, OSError) as e:
            raise damaged(path, e) from e

    where: dict[str, Path] = {}  # every tensor's file (an MXFP4 tensor's blocks and scales may be in two shards)
    for path in files:
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                where.update((k, path) for k in f.keys() if not k.endswith("rotary_emb.inv_freq"))
        except (bad_file, OSError) as e:
            raise damaged(path, e) from e
    out: dict[str, torch.Tensor] = {}
    model_config = None
    for key, path in where.items():
        name = key[len("model."):] if key.startswith("model.") else key
        if not wanted(name):
            continue
        stacked = mxfp4.blocks_name(key)
        scales_of = mxfp4.blocks_name(key.removesuffix("_scales") + "_blocks") if key.endswith("_scales") else None
        if scales_of is not None:  # an MXFP4 tensor's scales: read with its blocks
            if scales_of + "_blocks" not in where:
                raise SpecdecError(f"{model_dir} has MXFP4 scales {key} but no {scales_of}_blocks: the checkpoint "
                                   "is incomplete; download it again")
            continue
        if stacked is None:
            out[name] = read(path, key).to(weight_dtype(name, dtype))
            continue
        if stacked + "_scales" not in where:
            raise SpecdecError(f"{model_dir} has MXFP4 blocks {key} but no {stacked}_scales: the checkpoint "
                               "is incomplete; download it again")
        model_config = model_config or load_model_config(model_dir)
        out.update(mxfp4.expert_weights(name.removesuffix("_blocks"), read(path, key),
                                        read(where[stacked + "_scales"], stacked + "_scales"),
                                        model_config, dtype, expert_codes, pack))
    return out


def read_weight(model_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """One weight of a model directory's safetensors (the first of ``names`` present), as stored."""
    from safetensors import safe_open  # noqa: PLC0415
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for n in names:
                if n in st.keys():
                    return st.get_tensor(n)
    raise SpecdecError(f"{model_dir} has none of {', '.join(names)}")


def check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise SpecdecError(f"directory '{path}' has no config.json: point to a Hugging Face model "
                           "directory (config.json + *.safetensors) or a .gguf file")
    read_json(path / "config.json")
    if not any(path.glob("*.safetensors")):
        raise SpecdecError(f"directory '{path}' has no *.safetensors weights: save the model with "
                           "safetensors (save_pretrained does by default) or use a .gguf file")
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise SpecdecError(f"'{path}' does not exist: point to a Hugging Face model directory") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecdecError(f"could not parse '{path}' ({one_line(e)}): fix or replace the file") from e
    if not isinstance(d, dict):
        raise SpecdecError(f"'{path}' is not a JSON object: fix or replace the file")
    return d


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
