"""gpt-oss's MXFP4 experts kept as exact 8-bit codes for the native products (``quant/mxfp4.py`` decodes
them; this part packs the codes in ``qmm``'s tile layout and puts them in the built model, apart so that the
loader of state dicts, ``formats/hf.py``, does not import the kernels)."""
from __future__ import annotations

import numpy as np
import torch

from specdec.kernels import qmm
from specdec.quant.mxfp4 import _QUAD, BLOCK, _affine, _codes
from specdec.quant.qlinear import QLinear


def packed(blocks: torch.Tensor, scales: torch.Tensor) -> qmm.QWeight | None:
    """``codes`` packed as ``qmm.pack`` lays 8-bit codes out, written in that layout straight from the blocks
    (16-column tiles; each 4 inputs of a column are 2 bytes of its block); None as ``codes``."""
    affine = _affine(blocks, scales)
    n, g = scales.shape
    if affine is None or n % qmm.TILE:
        return None if affine is None else qmm.pack(_codes(blocks), *affine, 8)
    t = n // qmm.TILE
    words = blocks.numpy().view("<u2").reshape(t, qmm.TILE, g, BLOCK // 4)  # 2 bytes: 4 inputs of a column
    data = np.ascontiguousarray(_QUAD[words.transpose(0, 2, 3, 1)]).view(np.uint8).reshape(t, g, BLOCK * qmm.TILE)
    st = np.stack([x.numpy().reshape(t, qmm.TILE, g).transpose(0, 2, 1) for x in affine], axis=2)  # (t, g, 2, 16)
    return qmm.QWeight(8, n, g * BLOCK, torch.from_numpy(data), torch.from_numpy(np.ascontiguousarray(st)))


def attach(model: torch.nn.Module, expert_codes: dict[str, qmm.QWeight]) -> int:
    """Replace each expert product of ``expert_codes`` (loaded with its placeholder) by a ``QLinear`` of its
    exact codes, the loaded bias kept (fp32); returns how many."""
    for qual, qw in expert_codes.items():
        parent, attr = qual.rsplit(".", 1)
        module = model.get_submodule(parent)
        linear = getattr(module, attr)
        if linear.bias is not None:
            qw.bias = linear.bias.detach().float().contiguous()
        setattr(module, attr, QLinear(qw))
    return len(expert_codes)
