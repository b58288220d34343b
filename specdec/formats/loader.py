"""Model names -> runnable models: the target, draft models and quantized self-drafts, each loaded once.

``LoadedModel`` turns a name, Hugging Face directory or GGUF file into a model plus its tokenizer.
``ModelStore`` holds the target and every other model an LLM's proposers use, so that switching
speculative methods never loads a model twice, and hands them to the proposers' builders.

A GGUF file (or a registry name: a GGUF file underneath) runs in its own quantization unless a dtype or
another quantization is asked for (``model_quantization``): read in place, nothing written to the cache
(``gguf_model.py``). With a dtype it is converted once into a Hugging Face directory in the cache and loaded
from there, dequantized.
"""
from __future__ import annotations

import ctypes
import sys
import time
import warnings
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.quant import mxfp4_codes
from specdec.formats.gguf_model import describe, dtype_name, read_gguf
from specdec.formats.hf import load_model_config, load_state_dict, read_weight
from specdec.formats.hub import gguf_source, is_gguf, resolve_model
from specdec.models.llama import Transformer, build_model
from specdec.models.native import unsupported
from specdec.formats.gguf_blocks import quantize_from_file
from specdec.quant.qlinear import quantize_model
from specdec.formats.tokenizer import Tokenizer
from specdec.formats.vocab_map import VocabPair
from specdec.models.runner import ModelRunner

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}: use one of bfloat16, float16, float32")
    return DTYPES[dtype]


def parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise SpecdecError(f"invalid device {device!r}: use 'cpu' or 'cuda'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' requested but no CUDA GPU is available: use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise SpecdecError(f"unsupported device {device!r}: use 'cpu' or 'cuda'")
    return dev


IN_PLACE = ("gguf", "int4", "int8")  # what a GGUF file loads as without a converted copy in the cache


def model_quantization(name: str, quantization: str | None, dtype_given: bool, device: torch.device) -> str | None:
    """The quantization model ``name`` loads with: the one asked for; else on a CPU, with no dtype asked for, a
    GGUF file's (a registry name's) own blocks, ``"gguf"``; else None (unquantized, in the dtype)."""
    if quantization is not None or dtype_given or device.type != "cpu":
        return quantization
    return "gguf" if is_gguf(name) else None


def return_freed_memory() -> None:
    """Hand the C heap's freed pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). Re-laying
    the weights out for the native kernels (tiles, huge pages) frees the tensors they were copied from, which
    glibc would otherwise keep: 0.9 GB of resident memory after loading the 1.5B in its own blocks."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LoadedModel:
    """A model name, Hugging Face directory or GGUF file turned into a runnable model plus its tokenizer.

    ``quantization`` "gguf" with a GGUF file or a registry name reads the file in place (``gguf_model.read_gguf``):
    ``path`` and ``gguf`` are the file. Otherwise ``path`` is a Hugging Face directory (a GGUF file's conversion
    in the cache, made once) and ``gguf`` None. ``runs_as`` says what the weights run as, and with ``progress``
    a line says it once a GGUF file's model is loaded."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
                 quantization: str | None = None) -> None:
        t0 = time.perf_counter()
        self.name, self.dtype, self.device, self.quantization = name, dtype, device, quantization
        self.progress = progress
        self.gguf: Path | None = None
        if quantization in IN_PLACE and is_gguf(name) and (quantization == "gguf" or device.type == "cpu"):
            self.gguf = self.path = gguf_source(name, progress=progress)
            read = read_gguf(self.path, dtype, device, None if quantization == "gguf" else quantization)
            self.config, self.model, self.tokenizer = read.config, read.model, read.tokenizer
            self.runs_as = (describe(read.types, dtype) if quantization == "gguf" else
                            f"{quantization}, quantized from the file's weights in memory")
        else:
            self._load_directory(name, dtype, device, progress, quantization)
        self.model.make_native()  # bf16 on CPU: native tiles (or oneDNN-blocked weights) and forward
        return_freed_memory()
        self.model.use_cuda_graphs()  # on a GPU: decode and verification forwards as CUDA graphs
        self.native = self.model.native is not None
        why = unsupported(self.model) if not self.native and device.type == "cpu" and dtype == torch.bfloat16 else None
        if why and "lacks yet" in why:  # a family the native forward does not run: say so, never silently slower
            warnings.warn(f"specdec: {name}: {why}; the PyTorch path runs it (slower)", stacklevel=2)
        self.load_seconds = time.perf_counter() - t0
        if progress and is_gguf(name):  # (a Hugging Face directory runs as it is stored: nothing to say)
            print(f"{name}: {self.runs_as} (loaded in {self.load_seconds:.1f} s)", file=sys.stderr, flush=True)

    def _load_directory(self, name: str, dtype: torch.dtype, device: torch.device, progress: bool,
                        quantization: str | None) -> None:
        """The model of a Hugging Face directory (a GGUF file's conversion in the cache), then quantized."""
        self.path = resolve_model(name, progress=progress)
        self.config = load_model_config(self.path)
        # MXFP4 experts (gpt-oss's checkpoints): kept as their exact 8-bit codes unless the weights are
        # re-quantized (int8/int4 start from the exact floats) or wanted wider or on a GPU (exact floats)
        codes = {} if not quantization and dtype == torch.bfloat16 and device.type == "cpu" else None
        self.model = build_model(self.config, load_state_dict(self.path, dtype, expert_codes=codes, pack=mxfp4_codes.packed),
                                 dtype=dtype, device=device)
        if codes:
            mxfp4_codes.attach(self.model, codes)
        if quantization:
            # linears the group size cannot split stay bf16
            if quantization == "gguf":
                quantize_from_file(self.model, gguf_source(name, progress=progress))
            else:
                quantize_model(self.model, quantization)
        self.tokenizer = Tokenizer(self.path)
        weights = f"{dtype_name(dtype)}, dequantized" if is_gguf(name) else dtype_name(dtype)
        self.runs_as = f"{quantization}, quantized from {weights}" if quantization else weights

    def weight(self, names: tuple[str, ...]) -> torch.Tensor:
        """One of the model's weights as its file stores it, by Hugging Face name (the first of ``names`` held):
        from the safetensors of its directory, or from a GGUF file read in place (dequantized blocks as bf16)."""
        if self.gguf is not None:
            from specdec.formats.gguf_model import read_weight as read_gguf_weight  # noqa: PLC0415
            return read_gguf_weight(self.gguf, names)
        return read_weight(self.path, names)

    def hf_dir(self) -> Path:
        """The model as a Hugging Face directory: ``path``, or for a GGUF file read in place its conversion in the
        cache, made now if missing (what reads a checkpoint's extra tensors needs it: method mtp's layers)."""
        return self.path if self.gguf is None else resolve_model(self.name, progress=self.progress)


class ModelStore:
    """The target (and its runner) plus the draft models and self-drafts loaded for it."""

    def __init__(self, target: LoadedModel, runner: ModelRunner, progress: bool = True,
                 dtype_given: bool = False) -> None:
        self.target, self.runner, self.progress = target, runner, progress
        self.dtype, self.device = target.dtype, target.device
        self.dtype_given = dtype_given  # a dtype was asked for: draft models by name load unquantized in it too
        self._drafts: dict[tuple[str, str | None], LoadedModel] = {}
        self._self_drafts: dict[str, Transformer] = {}
        self._pairs: dict[int, VocabPair] = {}

    def draft(self, name: str, quantization: str | None) -> Transformer:
        """A draft model, checked to speak the target's token ids; loaded once per (name, quantization)."""
        draft = self.draft_model(name, quantization)
        if not self.shares_tokenizer(draft):
            t, d = self.target.tokenizer.hf, draft.tokenizer.hf
            raise SpecdecError(f"draft model '{name}' does not share the target's tokenizer "
                               f"({len(d)} vs {len(t)} tokens, embedding rows {draft.config.vocab_size} vs "
                               f"{self.target.config.vocab_size}): only the draft_model method drafts across "
                               "tokenizers; here use a draft of the same model family")
        return draft.model

    def draft_model(self, name: str, quantization: str | None) -> LoadedModel:
        """A draft model and its tokenizer, whatever its vocabulary; loaded once per (name, quantization). No
        quantization: the default (``model_quantization``: a GGUF file's own blocks unless a dtype was asked for)."""
        quantization = model_quantization(name, quantization, self.dtype_given, self.device)
        key = (name, quantization)
        if key not in self._drafts:
            self._drafts[key] = LoadedModel(name, self.dtype, self.device, progress=self.progress,
                                            quantization=quantization)
        return self._drafts[key]

    def shares_tokenizer(self, draft: LoadedModel) -> bool:
        """Whether ``draft`` speaks the target's token ids (same vocabulary and embedding rows)."""
        t, d = self.target.tokenizer.hf, draft.tokenizer.hf
        return (self.target.config.vocab_size == draft.config.vocab_size and len(t) == len(d)
                and t.get_vocab() == d.get_vocab())

    def vocab_pair(self, draft: LoadedModel) -> VocabPair:
        """The draft's and the target's vocabularies side by side (a drafter of another tokenizer)."""
        key = id(draft)
        if key not in self._pairs:
            self._pairs[key] = VocabPair.build(draft.tokenizer.hf, draft.config.vocab_size,
                                               self.target.tokenizer.hf, self.target.config.vocab_size)
        return self._pairs[key]

    def self_draft(self, quantization: str) -> Transformer:
        """The target's own weights loaded again at ``quantization`` bits, sharing its embedding table
        (a self-draft: no second model, no training); layer_skip and cascade-self share one copy."""
        if quantization not in self._self_drafts:
            copy = LoadedModel(self.target.name, self.dtype, self.device, progress=self.progress,
                               quantization=quantization)
            copy.model.embed_tokens = self.target.model.embed_tokens
            self._self_drafts[quantization] = copy.model
        return self._self_drafts[quantization]
