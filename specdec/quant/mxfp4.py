"""gpt-oss's MXFP4 experts in a Hugging Face checkpoint (``quantization_config.quant_method: mxfp4``, as
gpt-oss-20b and -120b are released), read exactly.

On disk, as transformers' ``integrations/mxfp4.py`` reads them: each layer's stacked experts as
``mlp.experts.{gate_up_proj,down_proj}_blocks`` uint8 ``(E, N, K/32, 16)`` and ``..._scales`` uint8
``(E, N, K/32)``, N a product's outputs (gate_up: 2I, gate and up rows interleaved, gate first; down: the
hidden size) and K its inputs; element 2j of a block of 32 in the low nibble of byte j, 2j+1 in the high,
each an e2m1 value (``FP4_VALUES``) times ``2^(scale - 127)``. (transformers dequantizes that to (E, N, K) and
transposes it to ``GptOssExperts``' (E, K, N).) The biases are plain (bf16) tensors, gate and up
interleaved too.

Each expert's products come out under our names (``experts.{e}.gate_up_proj.weight``, gate rows first;
``experts.{e}.down_proj.weight``), one expert at a time from the file's stacked tensors, in one of two forms:

- floats (``expert_codes`` None): the values in the model's dtype, exactly (bf16 and fp32 hold every e2m1
  value times a power of two; fp16 only within its range);
- codes: the same 8-bit affine codes the GGUF path keeps MXFP4 in (``gguf_blocks.decode_mxfp4``): each value
  a whole number ``v`` of half-steps in -12..12 times ``2^(e-128)``, so ``W = s (q - 12)`` with ``q = v + 12``
  and ``s = 2^(e-128)``, exact wherever ``s`` and ``12 s`` are fp16 values (scales 2^-24 .. 2^12: e in
  104..140; a block of zeros takes any). Such a product becomes a ``QLinear`` (``mxfp4_codes.attach``: one byte a weight
  plus an fp16 scale and offset per 32); the state dict holds a zero-stride placeholder of its shape
  meanwhile, so the model's weights load as usual. An expert product with a block beyond those scales stays
  floats (its weights exact in bf16).

``LoadedModel`` (formats/loader.py) keeps the codes for a bf16 load on the CPU without ``quantization`` (the
default: gpt-oss-20b's experts in ~1.1 bytes a weight rather than bf16's 2); fp32, fp16, a GPU, or int8/int4
(re-quantized from the exact values) take the floats.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
PROJS = ("gate_up_proj", "down_proj")
_FP16_E = (128 - 24, 128 + 12)  # the scale bytes whose 2^(e-128) and 12 times it are fp16 values
# e2m1 code -> its 8-bit code v + 12 (v: the value in half-steps, -12..12)
_CODE = (2 * np.array(FP4_VALUES) + 12).astype(np.uint8)
_BYTES = np.arange(256)
_PAIR = (_CODE[_BYTES & 15] | (_CODE[_BYTES >> 4].astype("<u2") << 8)).astype("<u2")  # a byte -> 2 codes
_WORDS = np.arange(65536)
_QUAD = (_PAIR[_WORDS & 255] | (_PAIR[_WORDS >> 8].astype("<u4") << 16)).astype("<u4")  # 2 bytes -> 4 codes


def blocks_name(key: str) -> str | None:
    """The stacked expert tensor (``...mlp.experts.gate_up_proj``) a file key holds the MXFP4 blocks of, else
    None."""
    for proj in PROJS:
        if key.endswith(f".experts.{proj}_blocks"):
            return key[:-len("_blocks")]
    return None


def expected_shape(proj: str, config: ModelConfig) -> tuple[int, int, int]:
    """(experts, outputs, inputs) of product ``proj`` of a layer's experts."""
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    return (config.num_experts, 2 * inter, hidden) if proj == "gate_up_proj" else (config.num_experts, hidden, inter)


def check(name: str, blocks: torch.Tensor, scales: torch.Tensor, config: ModelConfig) -> None:
    """A clear error unless ``blocks``/``scales`` are MXFP4 blocks of stacked tensor ``name``'s shape."""
    where = f"MXFP4 experts {name}_blocks / _scales"
    if config.activation != "swiglu_oai":
        raise SpecdecError(f"{where}: MXFP4 experts are read in gpt-oss's layout (gate and up interleaved), "
                           f"not {config.architecture}'s: load a bf16 checkpoint or the model's GGUF file")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise SpecdecError(f"{where}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}: "
                           "the file is damaged or not an MXFP4 checkpoint")
    e, n, k = expected_shape(name.rsplit(".", 1)[1], config)
    want_b, want_s = (e, n, k // BLOCK, BLOCK // 2), (e, n, k // BLOCK)
    if k % BLOCK or tuple(blocks.shape) != want_b or tuple(scales.shape) != want_s:
        raise SpecdecError(f"{where}: shapes {tuple(blocks.shape)} and {tuple(scales.shape)}, where config.json "
                           f"({e} experts, {n} outputs, {k} inputs) needs {want_b} and {want_s}: the file is "
                           "damaged or does not belong to this config.json")


def _rows(name: str, n: int) -> np.ndarray | slice:
    """Our row order of a product: gate_up's gate rows (even in the file), then its up rows (odd)."""
    if name.endswith("gate_up_proj"):
        return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
    return slice(None)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``(N, G, 16)`` -> their 8-bit codes ``(N, 32 G)`` (element 2j of a block from byte j's low nibble)."""
    n, g = blocks.shape[:2]
    return torch.from_numpy(_PAIR[blocks.numpy()].view(np.uint8).reshape(n, g * BLOCK))


def _fits(blocks: torch.Tensor, e: np.ndarray) -> bool:
    """Whether fp16 holds each block's scale ``2^(e-128)`` and 12 times it (a block of +-0s: any scale)."""
    inside = (e >= _FP16_E[0]) & (e <= _FP16_E[1])
    return bool(inside.all()) or bool((inside | ~(blocks.numpy() & 0x77).any(-1)).all())


def _power_of_two(k: np.ndarray) -> np.ndarray:
    """``2^k`` in fp32 for integers ``k`` (exact: -149..127; beyond, 0 or inf)."""
    return np.ldexp(np.float32(1), k.astype(np.int32)).astype(np.float32)


def floats(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's blocks ``(N, G, 16)`` and scales ``(N, G)`` -> its fp32 weights ``(N, 32 G)``: each e2m1
    value (``FP4_VALUES``) times ``2^(scale - 127)``, as transformers' ``convert_moe_packed_tensors``, here as
    its whole number of half-steps times ``2^(scale - 128)`` (the same values: both factors and their product
    exact in fp32, a zero's sign aside)."""
    n, g = scales.shape
    step = torch.from_numpy(_power_of_two(scales.numpy().astype(np.int32) - SCALE_BIAS - 1))
    return ((_codes(blocks).view(n, g, BLOCK).float() - 12) * step[..., None]).view(n, g * BLOCK)


def _affine(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes' fp16 scale ``2^(e-128)`` and offset ``-12`` scales per block; None as ``codes``."""
    e = scales.numpy().astype(np.int32)
    if not _fits(blocks, e):
        return None
    scale = _power_of_two(np.clip(e, *_FP16_E) - SCALE_BIAS - 1)
    return torch.from_numpy(scale.astype(np.float16)), torch.from_numpy((-12 * scale).astype(np.float16))


def codes(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One expert's blocks ``(N, G, 16)`` and scales ``(N, G)`` -> 8-bit codes ``(N, 32 G)``, fp16 scale and
    offset ``(N, G)``, exactly its values; None when a block's scale is beyond fp16's (see the module)."""
    affine = _affine(blocks, scales)
    return None if affine is None else (_codes(blocks), *affine)


def expert_weights(name: str, blocks: torch.Tensor, scales: torch.Tensor, config: ModelConfig, dtype: torch.dtype,
                   expert_codes: dict | None, pack: Callable | None = None) -> dict[str, torch.Tensor]:
    """Stacked tensor ``name`` (``layers.L.mlp.experts.gate_up_proj``)'s MXFP4 blocks as each expert's weight
    (``layers.L.mlp.experts.{e}.gate_up_proj.weight``), gate rows first: ``dtype`` floats, or with
    ``expert_codes`` a placeholder beside the expert's exact codes there (keyed
    ``layers.L.mlp.experts.{e}.gate_up_proj``, made by ``pack``: ``mxfp4_codes.packed``) where fp16 holds its
    scales (see the module)."""
    check(name, blocks, scales, config)
    base, proj = name.rsplit(".", 1)
    out, rows = {}, _rows(name, blocks.shape[1])
    for e in range(blocks.shape[0]):
        qual = f"{base}.{e}.{proj}"
        b, s = (torch.from_numpy(np.ascontiguousarray(x[e].numpy()[rows])) for x in (blocks, scales))
        qw = None if expert_codes is None else pack(b, s)
        if qw is None:
            out[qual + ".weight"] = floats(b, s).to(dtype)
            continue
        expert_codes[qual] = qw
        out[qual + ".weight"] = torch.zeros((), dtype=dtype).expand(qw.out_features, qw.in_features)  # attach's
    return out
