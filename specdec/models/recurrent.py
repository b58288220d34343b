"""The token mixers of hybrid models that carry a state instead of keys and values.

- ``ShortConv`` (LFM2, Liquid AI 2025): ``B, C, x = in_proj(h)``; ``y = out_proj(C * conv(B * x))``, the
  convolution depthwise and causal over the last ``conv_kernel`` positions.
- ``GatedDeltaNet`` (Qwen3.5 / Qwen3-Next; Yang et al. 2024, "Gated Delta Networks"): q, k, v from a
  causal depthwise convolution with SiLU, q and k L2-normalised, then per value head a state
  ``S (dk, dv)`` updated token by token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q
  / sqrt(dk)``, with the decay ``g = -exp(A_log) softplus(a + dt_bias)`` and the step ``beta =
  sigmoid(b)``; the output RMS-normalised per head, times SiLU of a gate ``z``, through ``out_proj``.

Both read and write their state in the ``HybridCache`` by position (``runtime/state_cache.py``), so a
verification block leaves the state after each of its tokens and rejected drafts need no rollback.
Each token's result is computed by the same operations whatever the block's length or the other rows
(the convolution as a fixed-order sum over its taps in fp32, the recurrence one token at a time):
speculative decoding gives plain decoding's bits. transformers runs a prompt through the chunked form
of the delta rule (the same function of the inputs, summed in another order): fp32 logits agree to
about 1e-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig
from specdec.quant.linear import Linear


def causal_conv(cache, s: int, rows: torch.Tensor, pos: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """The depthwise causal convolution of ``x (B, T, D)`` at positions ``pos (B, T)`` (consecutive per
    row), ``weight (D, width)``, reading the inputs before the block from the cache (the caller stores
    the block's own); fp32 sum over the taps in a fixed order, ``(B, T, D)`` fp32."""
    T = x.shape[1]
    width = weight.shape[-1]
    before = cache.read_inputs(s, rows, pos[:, 0], width - 1)  # (B, width-1, D)
    seq = torch.cat([before, x], dim=1).float()  # (B, width-1+T, D)
    w = weight.float()
    y = seq[:, 0:T] * w[:, 0]
    for j in range(1, width):
        y = y + seq[:, j:j + T] * w[:, j]
    return y if bias is None else y + bias.float()


class ShortConv(nn.Module):
    """LFM2's gated short convolution (the module names are transformers' ``Lfm2ShortConv``'s)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        C = self.conv_dim = cfg.hidden_size  # the convolution runs over B * x, C channels
        self.in_proj = Linear(C, 3 * C, bias=cfg.conv_bias)
        self.out_proj = Linear(C, C, bias=cfg.conv_bias)
        self.conv_weight = nn.Parameter(torch.zeros(C, cfg.conv_kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(C), requires_grad=False) if cfg.conv_bias else None
        self.state = cfg.state_layers.index(layer)

    def forward(self, x: torch.Tensor, fwd) -> torch.Tensor:
        return self.out_proj(self.mix(self.in_proj(x), fwd))

    def mix(self, bcx: torch.Tensor, fwd) -> torch.Tensor:
        """``in_proj``'s output ``(B, T, 3C)`` -> the input of ``out_proj`` ``(B, T, C)``."""
        b, c, x = bcx.chunk(3, dim=-1)
        bx = b * x
        cache, rows, pos = fwd.cache, fwd.row_ids, fwd.pos
        y = causal_conv(cache, self.state, rows, pos, bx, self.conv_weight, self.conv_bias)
        keep = min(bx.shape[1], cache.slots)  # what later blocks can read
        cache.write_state(self.state, rows, pos[:, -keep:], bx[:, -keep:])
        return c * y.to(bcx.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of its gate (transformers' ``Qwen3_5RMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time, fp32: ``q, k (B, T, H, dk)`` (normalised, q scaled),
    ``v (B, T, H, dv)``, ``g, beta (B, T, H)``, ``state (B, H, dk, dv)`` before the block -> the
    outputs ``(B, T, H, dv)`` and the states after each of the last ``keep`` tokens ``(B, keep, H, dk, dv)``."""
    T = q.shape[1]
    outs, kept = [], []
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t].unsqueeze(-1)  # (B, H, dk, 1)
        mem = (state * kt).sum(-2)  # (B, H, dv)
        delta = (v[:, t] - mem) * beta[:, t].unsqueeze(-1)
        state = state + kt * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
        if t >= T - keep:
            kept.append(state)
    return torch.stack(outs, 1), torch.stack(kept, 1)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer. ``in_proj`` is transformers' ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a`` as one product (the same bytes read, one call)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = cfg.delta_k_heads, cfg.delta_v_heads, cfg.delta_k_dim, cfg.delta_v_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, cfg.conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.state = cfg.state_layers.index(layer)

    def forward(self, x: torch.Tensor, fwd) -> torch.Tensor:
        return self.out_proj(self.mix(self.in_proj(x), fwd))

    def mix(self, proj: torch.Tensor, fwd) -> torch.Tensor:
        """``in_proj``'s output ``(B, T, conv_dim + value_dim + 2 heads)`` -> the input of ``out_proj``."""
        B, T, _ = proj.shape
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        cache, rows, pos = fwd.cache, fwd.row_ids, fwd.pos
        keep = min(T, cache.slots)  # what later blocks can read
        before = cache.read_state(self.state, rows, pos[:, 0])
        mixed = F.silu(causal_conv(cache, self.state, rows, pos, qkv, self.conv_weight, None)).to(proj.dtype)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, T, self.hk, self.dk), k.reshape(B, T, self.hk, self.dk)
        if self.hv != self.hk:  # each query/key head serves hv / hk consecutive value heads
            q, k = q.repeat_interleave(self.hv // self.hk, 2), k.repeat_interleave(self.hv // self.hk, 2)
        q, k = l2norm(q.float()), l2norm(k.float())
        q = q / (self.dk ** 0.5)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, states = delta_rule(q, k, v.reshape(B, T, self.hv, self.dv).float(), g, beta, before, keep)
        cache.write_state(self.state, rows, pos[:, T - keep:], qkv[:, T - keep:], states)
        y = self.norm(out.to(proj.dtype), z.reshape(B, T, self.hv, self.dv))
        return y.reshape(B, T, self.value_dim)
