"""Weight-only quantized linears that drop in for ``Linear``: int8 per channel, int4 per group.

Made from bf16 weights at load time and run by PyTorch's CPU kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``). On this machine int4 reads a weight
about 2.5x faster than the packed bf16 kernel for one row, but its cost grows quickly with rows
(1.7x at 4 rows, 3.5x at 8): good for a draft model, which runs one token at a time, not for the
target, which verifies blocks. Speculation stays exact relative to whatever target is loaded.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.linear import Linear

KINDS = ("int8", "int4")


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group`` inputs: ``w (N, K)`` -> (codes (N, K) int32 in
    [0, 15], scales_and_zeros (K/group, N, 2) bf16) with w ~ (code - 8) * scale + zero."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)  # (N, K/g, g)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15
    codes = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (K/g, N, 2)
    return codes, sz


def dequantize_int4(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The bf16-rounded weights the int4 kernel computes with (for tests and error reports)."""
    n, k = codes.shape
    scale, zero = sz.float().transpose(0, 1).unbind(-1)  # (N, K/g) each
    g = codes.float().reshape(n, k // group, group)
    return ((g - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


class Int4Linear(nn.Module):
    """int4 weights; with ``dense_rows`` set, products of more rows than that (prefill) run on a
    kept bf16 copy instead, since the int4 kernel's cost grows with rows (a draft's prompt prefill
    in int4 took 2.5x the bf16 time). Costs the bf16 memory again: for drafts, not targets."""

    def __init__(self, lin: Linear, group: int = 32, dense_rows: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = lin.in_features, lin.out_features, group
        codes, self.scales_zeros = quantize_int4(lin.weight.detach(), group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        self.bias = lin.bias
        self.dense = None
        if dense_rows is not None:
            self.dense_rows = dense_rows
            self.dense = lin
            lin.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.dense is not None and x2.shape[0] > self.dense_rows:
            return self.dense(x2).to(x.dtype).view(*lead, self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)


class Int8Linear(nn.Module):
    def __init__(self, lin: Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w = lin.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127  # (N,)
        self.codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
        self.scales = scale.to(torch.bfloat16)
        self.bias = lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.codes, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)


def quantize_model(model: nn.Module, kind: str, group: int = 32, dense_prefill: bool = False) -> int:
    """Replace every ``Linear`` of ``model`` by its ``kind`` version in place; returns the count.

    ``dense_prefill`` (int4 only) keeps bf16 copies for many-row products (see Int4Linear).
    """
    if kind not in KINDS:
        raise SpecdecError(f"unknown quantization {kind!r}: use one of {', '.join(KINDS)}")
    if next(model.parameters()).device.type != "cpu":
        raise SpecdecError(f"quantization {kind!r} runs on the CPU only: use device='cpu' or no quantization")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                if kind == "int4" and child.in_features % group:
                    continue  # keep bf16 where the group does not divide the inputs
                new = (Int4Linear(child, group, dense_rows=16 if dense_prefill else None) if kind == "int4"
                       else Int8Linear(child))
                setattr(parent, name, new)
                count += 1
    return count
