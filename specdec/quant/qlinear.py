"""Quantized linears that drop in for ``Linear``: int8 / int4 weights run by ``specdec.kernels``.

    quantize_model(model, "int4")            # min/max 4-bit per group of 32, from the bf16 weights
    quantize_model(model, "int8")            # the same with 8 bits

A GGUF file's own blocks come in through the same ``install`` (``formats/gguf_blocks.py``: ``quantize_from_file``).

Every ``Linear`` is replaced, the LM head included (a tied head gets its own quantized copy; the
embedding table stays bf16 for the row lookups). The product runs on the native small-batch kernel
(``specdec/kernels/csrc/qmm.c``): one weight read serves up to 8 rows, so verifying a block of
draft tokens costs about what one token does. Results are batch-invariant, so speculative decoding
stays exact relative to the quantized target.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.quant.linear import Linear

KINDS = ("int8", "int4")  # made here from the weights; "gguf" (a file's blocks) in formats/gguf_blocks.py


class QLinear(nn.Module):
    """``y = x W^T (+ b)`` with W a ``qmm.QWeight``; output in the input's dtype (bf16 or fp32)."""

    def __init__(self, weight: qmm.QWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        y = qmm.linear(x.reshape(-1, self.in_features), self.qweight, out_dtype)
        return (y if y.dtype == x.dtype else y.to(x.dtype)).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in={w.in_features}, out={w.out_features}, bits={w.bits}, bias={w.bias is not None}"


class RowLookup(nn.Module):
    """A token embedding whose rows are made when looked up (``rows``: fp32), rounded to bf16 as a GGUF file's
    conversion stores the table, then the model's dtype: the converted model's values bit for bit, without its
    table (0.47 GB for the 1.5B). ``weight`` is an empty ``(0, C)`` stand-in saying the model's dtype and device."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("weight", torch.empty(0, embedding_dim, dtype=dtype), persistent=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows ``(len(ids), C)`` of ``ids`` (1-D, in range)."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings}), got {int(flat.min())}.."
                             f"{int(flat.max())}")
        out = self.rows(flat).to(torch.bfloat16).to(self.weight.dtype)
        return out.view(*ids.shape, self.embedding_dim)


class QEmbedding(RowLookup):
    """Rows looked up in quantized tiles (a tied LM head's, the file's blocks repacked once): each token's row is
    ``qmm.dequantize`` of its tile."""

    def __init__(self, tiles: qmm.QWeight, dtype: torch.dtype) -> None:
        super().__init__(tiles.out_features, tiles.in_features, dtype)
        self.tiles = tiles  # not ``qweight``: nothing streams it (hugepages leaves it where it is)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        tiles, at = torch.unique(ids // qmm.TILE, return_inverse=True)
        w = self.tiles
        part = qmm.QWeight(w.bits, len(tiles) * qmm.TILE, w.in_features, w.data[tiles], w.scales[tiles], None, w.fmt)
        return qmm.dequantize(part)[at * qmm.TILE + ids % qmm.TILE]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.tiles.bits}, fmt={self.tiles.fmt}"


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, qualified name) of every Linear of the model (not the Linear itself: a list
    holding them would keep every replaced weight alive until the end of ``quantize_model``)."""
    out = []
    for pname, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):
                out.append((parent, name, f"{pname}.{name}" if pname else name))
    return out


def quantize_model(model: nn.Module, kind: str) -> int:
    """Replace the model's ``Linear`` layers by ``QLinear`` in place; returns how many were replaced.

    ``int4``/``int8``: min/max codes per group of 32 inputs from the current weights. Layers whose inputs are
    not a multiple of 32 stay as they are. (``gguf``, a file's own blocks: ``formats.gguf_blocks.quantize_from_file``.)
    """
    if kind == "gguf":
        raise SpecdecError("quantization 'gguf' needs the model as a GGUF file or a registry name")
    if kind not in KINDS:
        raise SpecdecError(f"unknown quantization {kind!r}: use one of {', '.join(KINDS)} or gguf")
    check_cpu(model, kind)
    count = 0
    for parent, name, _ in _linears(model):
        lin = getattr(parent, name)
        if lin.in_features % qmm.GROUP:
            continue
        if lin.weight.numel() == 0:
            raise SpecdecError("cannot quantize a model whose linears are already packed: quantize first")
        setattr(parent, name, QLinear(qmm.from_float(lin.weight.detach(), 4 if kind == "int4" else 8, lin.bias)))
        count += 1
    return count


def check_cpu(model: nn.Module, kind: str) -> None:
    """Quantized products run on the CPU only: a one-line error for a model elsewhere."""
    if next(model.parameters()).device.type != "cpu":
        raise SpecdecError(f"quantization {kind!r} runs on the CPU only: use device='cpu' or no quantization")


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the model's ``Linear`` layers that quantized weights can replace (inputs a
    multiple of the group size)."""
    return [q for parent, name, q in _linears(model) if getattr(parent, name).in_features % qmm.GROUP == 0]


def install(model: nn.Module, weights: dict[str, qmm.QWeight]) -> int:
    """Replace the model's ``Linear`` layers named in ``weights`` (qualified names, ``linear_names``) by
    ``QLinear`` over those weights, each taking its layer's bias; returns how many were replaced. Layers not
    named (kept unquantized in a GGUF file: F16/F32) stay as they are, so their weights must be real; the
    replaced ones' may be placeholders on the meta device (a model read in place from its GGUF file)."""
    count = 0
    for parent, name, qual in _linears(model):
        qw = weights.get(qual)
        if qw is None:
            continue
        lin = getattr(parent, name)
        if lin.bias is not None:
            qw.bias = lin.bias.detach().float().contiguous()
        setattr(parent, name, QLinear(qw))
        count += 1
    return count


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of all quantized weights (codes, scales, biases) in the model."""
    return sum(m.qweight.nbytes for m in model.modules() if isinstance(m, QLinear))
