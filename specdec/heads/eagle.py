"""The EAGLE-3-style drafter layer (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test").

The head reads the target's hidden states of a low, a middle and a top layer, fuses them through one
linear layer (``fc``) into one vector per position, and runs ONE decoder layer whose attention sees
the token's embedding (the target's own table, shared, never stored here) beside that fused vector:

    g_p = fc([h_low, h_mid, h_top]_p)                          target features at position p
    a_p = layer(norm(embed(x_{p+1})), norm(g_p))               -> logits over the draft vocabulary
    a_{p+j} = layer(norm(embed(x̂_{p+j+1})), norm(a_{p+j-1}))   drafting on its own outputs

predicting token x_{p+2} (then x_{p+j+2}). Its LM head covers a reduced draft vocabulary (the most
frequent target tokens); ``d2t[i]`` is the offset from draft id ``i`` to its target id and ``t2d``
marks the target ids that have a draft id (the layout of vLLM's ``speculators``, whose state-dict
names this module keeps so that heads load both ways: see ``heads/speculators.py``).

The same module runs training (PyTorch autograd, full sequences, training-time test) and drafting
(a position-addressed KV cache of its own, one decoder layer per token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig
from specdec.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE-3 head for one target model."""

    hidden_size: int  # the head's width: the target's (it reads the target's embedding)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # speculators' eagle_aux_hidden_state_layer_ids (see target_layers)
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Our runtime's hidden-state indices: speculators' layer id L is the *input* of block L
        (vLLM captures it before the block runs), i.e. the output of block L - 1."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    @classmethod
    def for_target(cls, cfg: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None) -> "EagleConfig":
        """A head for target ``cfg``: by default vLLM's layers (2, L/2, L-3) and the target's MLP width."""
        n = cfg.num_hidden_layers
        aux = aux_layer_ids or (min(2, n - 1), max(1, n // 2), max(1, n - 3))
        return cls(hidden_size=cfg.hidden_size, intermediate_size=intermediate_size or cfg.intermediate_size,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                   vocab_size=cfg.vocab_size, draft_vocab_size=min(draft_vocab_size, cfg.vocab_size),
                   aux_layer_ids=tuple(aux), target_hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps,
                   rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings)


class Norm(nn.Module):
    """RMSNorm (trainable, unlike the frozen target's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class HeadAttention(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, c.hidden_size, bias=False)


class HeadMLP(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    """The decoder layer: attention over [embedding; hidden] (2C wide), then a SwiGLU MLP."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.c = c
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = HeadAttention(c)
        self.mlp = HeadMLP(c)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``embeds, hidden (B, T, C)`` -> q ``(B, nh, T, hd)``, k, v ``(B, nkv, T, hd)``, residual ``(B, T, C)``."""
        c, a = self.c, self.self_attn
        B, T, _ = hidden.shape
        normed = self.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2C)
        q = a.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v, residual

    def finish(self, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output ``y (B, nh, T, hd)`` -> the layer's output ``(B, T, C)``."""
        B, _, T, _ = y.shape
        h = residual + self.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q (B, nh, T, hd)``, ``k, v (B, nkv, L, hd)``, ``mask (B, 1, T, L)`` bool -> ``(B, nh, T, hd)``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class EagleHead(nn.Module):
    """fc + one decoder layer + norm + a draft-vocabulary LM head (state-dict names as speculators')."""

    def __init__(self, c: EagleConfig, fc_bias: bool = False) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(c)])
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    @property
    def layer(self) -> HeadLayer:
        return self.layers[0]

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Draft id i stands for target id ``draft_to_target[i]`` (sorted or not; unique)."""
        ids = draft_to_target.to(torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """``(Vd,)`` the target id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``(B, 1, T, hd)`` for ``positions (B, T)``."""
        c = self.config
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        ang = positions.to(torch.float32).unsqueeze(-1) * inv.float().to(positions.device)  # (B, T, hd/2)
        ang = torch.cat((ang, ang), dim=-1).unsqueeze(1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Layer output ``(..., C)`` -> draft-vocabulary logits ``(..., Vd)``."""
        return self.lm_head(self.norm(h))

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``(B, Vd)`` -> ``(B, V)``: -inf where the target token has no draft id."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.target_ids()] = draft_logits
        return out

    # ---- drafting: a position-addressed KV cache ------------------------------------------------
    def new_cache(self, rows: int, max_len: int, num_blocks: int | None = None) -> KVCache:
        c, w = self.config, self.fc.weight
        return KVCache(1, rows, c.num_key_value_heads, max_len, c.head_dim, dtype=w.dtype, device=w.device,
                       num_blocks=num_blocks)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             cache: KVCache, rows: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One cached pass: ``embeds, hidden (B, T, C)`` at RoPE ``positions (B, T)``, keys written to
        cache ``slots (B, T)`` of ``rows (B,)``; each query sees slots ``<=`` its position.
        ``tree = (root (B, 1), sees (B, T, W))``: tree nodes at slots ``root + 1 ..``: each query sees the
        slots up to ``root`` and, of the ``W`` tree slots, those ``sees`` marks (its ancestors and itself).
        Returns the layer output ``(B, T, C)`` (the next step's ``hidden``)."""
        cos, sin = self.rope(positions, hidden.dtype)
        q, k, v, residual = self.layer.project(embeds, hidden, cos, sin)
        cache.write(0, cache.slot_index(rows, slots), k, v)
        if tree is None:
            L = min(int(positions.max()) + 1, cache.max_len)
            mask = torch.arange(L, device=positions.device).view(1, 1, L) <= positions.unsqueeze(-1)  # (B, T, L)
        else:
            root, sees = tree
            W = sees.shape[-1]
            L = min(int(root.max()) + 1 + W, cache.max_len)
            at = torch.arange(L, device=positions.device).view(1, 1, L)
            off = (at - root.view(-1, 1, 1) - 1).clamp(0, W - 1).expand(sees.shape[0], sees.shape[1], L)
            r = root.view(-1, 1, 1)
            mask = (at <= r) | ((at > r) & (at <= r + W) & sees.gather(2, off))
        keys, values = cache.read(0, cache.gather_index(rows, L))  # (B, nkv, L, hd)
        return self.layer.finish(attend(q, keys, values, mask.unsqueeze(1)), residual)

    # ---- training: training-time test ----------------------------------------------------------
    def unrolled(self, embeds: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences (EAGLE-3, section 3.2), without a cache.

        ``embeds (B, T, C)``: the embedding of token x_{p+1} at index p; ``feats (B, T, 3C')``: the
        target's features at p. Step 0 reads the target's fused features and predicts x_{p+2};
        step k reads step k-1's outputs as its hidden input and the true x_{p+k+1} as its token (at
        index p: embeds shifted by k), and predicts x_{p+k+2}. A step-k query at p attends to step 0
        at indices <= p and to its own chain (steps 1..k at index p), exactly what drafting from the
        last real position p sees. Returns each step's layer output ``(B, T, C)``; index p of step
        k is valid for p + k < T.
        """
        B, T, _ = embeds.shape
        dev = embeds.device
        pos = torch.arange(T, device=dev)
        causal = pos.view(T, 1) >= pos.view(1, T)  # (T, T)
        diag = torch.eye(T, dtype=torch.bool, device=dev)
        hidden = self.fc(feats)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for k in range(steps):
            emb = embeds if k == 0 else torch.cat([embeds[:, k:], embeds[:, -1:].expand(B, k, -1)], dim=1)
            cos, sin = self.rope((pos + k).view(1, T), hidden.dtype)
            q, kk, vv, residual = self.layer.project(emb, hidden, cos, sin)
            keys.append(kk)
            values.append(vv)
            mask = torch.cat([causal] + [diag] * k, dim=1).view(1, 1, T, (k + 1) * T)
            y = attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            hidden = self.layer.finish(y, residual)
            outs.append(hidden)
        return outs


def init_head(head: EagleHead, seed: int = 0, std: float | None = None) -> EagleHead:
    """Random weights (norms at 1): a fresh head to train, or an untrained one for tests."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (std or 1.0 / math.sqrt(p.shape[1])))
            else:
                p.zero_()
    return head
