"""A drafter's LM head cut down to the N most frequent target tokens (FR-Spec: Zhao et al. 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling").

At every drafted token a drafter reads its whole LM head: for Qwen2.5's 151,936 tokens that is 136M of
the 0.5B draft's ~494M weights. Most of those rows are tokens that almost never occur. A
``ReducedHead`` holds the rows of N chosen token ids as a weight of its own (bf16 rows, or the same
rows of a quantized head's codes and scales: the logits of the kept tokens are the full head's, bit
for bit) and maps its logits back to target ids, FLOOR elsewhere: the draft distribution q is then
zero outside those N tokens, and rejection sampling (or greedy matching) against the target's own
distribution stays exact whatever N is.

The drafter's forward is asked for its final hidden state only (``logits_positions="none"``,
``hidden_layers=(-1,)``) and this head is applied to it, so the model's own forward is untouched.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.kernels import qmm
from specdec.quant.linear import Linear, untile_bf16
from specdec.models.llama import Transformer
from specdec.quant.qlinear import QLinear

FLOOR = -1e30  # the logit of a token outside the head: probability exactly 0, yet finite (no NaN rows
# when a grammar mask leaves none of the N tokens)


def head_rows(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a bf16/fp32 LM head (out, in): from its weight, its native tiles, the tied embedding, or, for a
    head packed for oneDNN (its weight dropped), from products with the identity (exact: one 1 per row)."""
    head = model.lm_head
    if head.weight.numel():
        return head.weight.detach()[ids].clone()
    if head.tiled is not None:  # re-laid for the native kernels
        return untile_bf16(head.tiled, head.out_features)[ids].clone()
    if model.config.tie_word_embeddings:
        return model.embed_tokens.weight.detach()[ids].clone()
    c = head.in_features
    eye = torch.eye(c, dtype=model.embed_tokens.weight.dtype, device=ids.device)
    return torch.cat([head(eye[i:i + 256]) for i in range(0, c, 256)]).t()[ids].contiguous()  # (N, C)


class ReducedHead(nn.Module):
    """The LM head rows of ``ids`` (N,) as their own Linear / QLinear; ``forward(h (B, T, C))`` gives
    logits (B, T, vocab_size) over target ids, FLOOR outside ``ids``."""

    def __init__(self, model: Transformer, ids: torch.Tensor) -> None:
        super().__init__()
        head = model.lm_head
        dev = model.embed_tokens.weight.device
        self.register_buffer("ids", ids.to(dev, torch.long), persistent=False)
        self.vocab_size = model.config.vocab_size
        if isinstance(head, QLinear):
            self.proj: nn.Module = QLinear(qmm.select_rows(head.qweight, self.ids.cpu()))
        else:
            w = head_rows(model, self.ids)
            self.proj = Linear(w.shape[1], w.shape[0], bias=head.bias is not None, dtype=w.dtype, device=dev)
            self.proj.weight.copy_(w)
            if head.bias is not None:
                self.proj.bias.copy_(head.bias.detach()[self.ids])
            self.proj.tile() or self.proj.pack()  # the native tiles, else oneDNN's blocked layout (bf16, CPU)

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        small = self.proj(h)  # (..., N)
        out = small.new_full((*small.shape[:-1], self.vocab_size), FLOOR, dtype=torch.float32)
        out[..., self.ids] = small.float()
        return out


def reduced_logits(model: Transformer, head: ReducedHead | None, tokens: torch.Tensor, positions: torch.Tensor,
                   cache, *, at: str | torch.Tensor = "all", **kw) -> torch.Tensor:
    """The logits a drafter's forward gives at ``at`` ("all", "last" or a (B, T') index), through
    ``head`` when given (the model's full head otherwise): (B, T', V)."""
    if head is None:
        return model(tokens, positions, cache, logits_positions=at, **kw).logits
    h = model(tokens, positions, cache, logits_positions="none", hidden_layers=(-1,), **kw).hidden[-1]  # (B, T, C)
    if isinstance(at, torch.Tensor):
        h = h.gather(1, at.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
    elif at == "last":
        h = h[:, -1:]
    return head(h)
