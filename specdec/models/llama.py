"""A compact decoder-only transformer: the Llama block and every family's switches on it.

RMSNorm, rotary position embeddings (Su et al. 2021) with the config's theta (Llama 3, linear, YaRN
and LongRoPE scaling; partial rotary dimensions; layers without RoPE), grouped-query attention (Ainslie
et al. 2023) with optional per-head or whole-width q/k RMSNorm, sliding windows, a query scale and
soft-capping, a gated MLP (SwiGLU, Shazeer 2020, or GeGLU with tanh GeLU), pre-, sandwich or post-norm
blocks, and embedding / residual / logit multipliers. Which family sets which switch:
``specdec/families.py``; the switches themselves: ``ModelConfig``.

One forward serves prefill, decoding, draft verification and self-speculation:
tokens and their positions ``(B, T)`` (rows may sit at different positions), a paged KV cache
written by position, an optional block attention mask (token trees), hidden states of chosen
layers, and a set of layers to skip.
"""
from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig
from specdec.kernels import hugepages
from specdec.kernels.attention import cached_attention
from specdec.quant.linear import Linear, matmul, pack_linears, row_block
from specdec.models import cuda_graphs
from specdec.models.cuda_graphs import CudaGraphs
from specdec.models.masks import attention_mask, check_window, first_slots, sliding
from specdec.models.moe import MLP, MoE, hf_moe_weights, weight_dtype
from specdec.models.native import NativeForward
from specdec.models.recurrent import GatedDeltaNet, ShortConv
from specdec.runtime.kv_cache import KV_BLOCK, KVCache, window_row_blocks
from specdec.runtime.state_cache import DEFAULT_SLOTS, HybridCache, row_state_bytes, slots_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies ``(rotary_dim/2,)`` of the global layers' RoPE (Llama 3, linear, YaRN or
    LongRoPE scaling when the config asks), or with ``local`` the windowed layers' own base (Gemma 3).
    Scalings other than Llama 3's come from transformers' own RoPE functions (the reference); LongRoPE
    takes its short factors, which transformers uses while a sequence stays within the original
    context."""
    d = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = {} if local else (cfg.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "freqs":  # a GGUF file's own per-frequency divisors (rope_freqs), as llama.cpp applies them
        inv = inv / torch.tensor(rs["factors"], dtype=torch.float64)
    elif kind is not None:
        return _transformers_rope(cfg)[0]
    return inv.float()


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN and LongRoPE put on cos and sin (1 for every other RoPE)."""
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) in (None, "llama3", "freqs"):
        return 1.0
    return float(_transformers_rope(cfg)[1])


_ROPES: dict[str, tuple[torch.Tensor, float]] = {}  # repr(config) -> transformers' (inv_freq, attention factor)


def _transformers_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor for ``cfg``'s RoPE scaling (``RopeFields``: from
    the config's own fields), computed once per config (a model's load asks for both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    key = repr(cfg)
    if key not in _ROPES:
        kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
        if kind not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope scaling {kind!r} is not supported")
        with torch.device("cpu"):  # also when the model is being built on the meta device
            if len(_ROPES) >= 16:
                _ROPES.clear()
            inv, factor = ROPE_INIT_FUNCTIONS[kind](RopeFields(cfg), "cpu")
            _ROPES[key] = inv.float(), factor
    inv, factor = _ROPES[key]
    return inv.clone(), factor


class RopeFields:
    """What transformers' RoPE functions (``ROPE_INIT_FUNCTIONS``) read of a config, from a ModelConfig's fields:
    the global layers' ``rope_parameters`` (base, partial rotary factor, the scaling), the head and context
    sizes. Its ``standardize_rope_params`` is ``PreTrainedConfig``'s for one global dictionary: the scalings
    fitted to a pretraining length take the model's context when they do not state theirs."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.head_dim, self.hidden_size = cfg.head_dim, cfg.hidden_size
        self.num_attention_heads, self.max_position_embeddings = cfg.num_attention_heads, cfg.max_position_embeddings
        rp = {"rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
              **copy.deepcopy(cfg.rope_scaling or {})}
        rp.setdefault("rope_type", rp.get("type", "default"))
        if rp["rope_type"] in ("llama3", "yarn", "longrope"):
            rp.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
        self.rope_parameters = rp

    def standardize_rope_params(self) -> None:
        """(done in ``__init__``)"""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dimensions of each head of ``x (B, n, T, hd)`` (all of them
    unless the rotary dimensions are partial, as in Phi-3); the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr = x[..., :rd]
    return torch.cat((xr * cos + rotate_half(xr) * sin, x[..., rd:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        # Qwen3.5: each head's queries followed by as many gate values (q_proj twice as wide)
        self.gated = cfg.attn_output_gate
        self.q_width = self.q_size * (2 if self.gated else 1)
        # q, k and v as one matmul: same bytes read, a third of the calls
        self.qkv_proj = Linear(cfg.hidden_size, self.q_width + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.attn_sinks:  # gpt-oss: one learned logit per head in every softmax's denominator
            self.sinks = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.sink = cfg.attn_sinks
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3 / Gemma 3: over each head; OLMo 2: over all of q and all of k
            q_dim, k_dim = (self.hd, self.hd) if cfg.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps)
        self.window = cfg.window(layer)  # 0: every earlier key
        # its layer in the KV cache: among the windowed layers (the cache's windowed group, KVCache.local) for a
        # windowed layer, else among the others (a hybrid's cache holds attention layers only)
        self.kv = cfg.kv_index(layer)
        self.rope_table = cfg.rope_table(layer)  # index into ForwardContext.rope, -1: no RoPE (NoPE layer)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(self.hd)
        self.softcap = cfg.attn_softcap

    def forward(self, x: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), fwd, layer))

    def attend(self, qkv: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        """``qkv (B, T, q + 2 kv)`` -> the attention output before ``o_proj``, ``(B, T, q_size)``;
        writes the new keys and values to the cache (``layer``: the model's layer; its place in the cache
        is ``self.kv``, which differs in a hybrid model)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.q_width, self.kv_size, self.kv_size], dim=-1)
        if not self.gated:
            return self._attend(q, k, v, fwd)
        q, gate = q.reshape(B, T, self.n_heads, 2 * self.hd).chunk(2, dim=-1)
        y = self._attend(q.reshape(B, T, self.q_size), k, v, fwd)
        return y * torch.sigmoid(gate.reshape(B, T, self.q_size))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd: "ForwardContext") -> torch.Tensor:
        B, T, _ = q.shape
        layer = self.kv
        cache, slots = (fwd.cache.local, fwd.local_slots) if self.window else (fwd.cache, fwd.slots)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_table >= 0:
            cos, sin = fwd.rope[self.rope_table]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        cache.write(layer, slots, k, v)
        mask = fwd.mask if not self.window else fwd.window_mask(self.window)
        sinks = self.sinks if self.sink else None
        plain = self.softcap is None and sinks is None  # what the fused and in-place kernels compute
        if not fwd.fused_attention and plain:  # the native kernel reads the cache in place (bf16 on CPU)
            y = cached_attention(q, cache.k[layer], cache.v[layer], cache.table, fwd.rows, mask, self.scale)
            if y is not None:
                return y
        keys, values = cache.read(layer, fwd.keys_index(cache))  # (B, nkv, L, hd)
        if fwd.fused_attention and plain:  # prompt prefill: PyTorch's fused kernel, not bit-stable across batch shapes
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=self.scale)
        elif fwd.tree or self.window:  # holes in the mask: a tree's, or keys left behind by a window
            y = tree_attention(q, keys, values, mask, self.scale, self.softcap, sinks)  # (B, nh, T, hd)
        else:
            y = attention(q, keys, values, mask, self.scale, self.softcap, sinks)  # (B, nh, T, hd)
        return y.transpose(1, 2).reshape(B, T, self.q_size)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention, batch-invariant: ``q (B, nh, T, hd)``, ``k, v (B, nkv, L, hd)``,
    ``mask (B, 1, T, L)`` bool -> ``(B, nh, T, hd)``.

    The G = nh/nkv query heads sharing a kv head form the rows of one product per kv head; scores
    are softmaxed in fp32 (as transformers' eager attention does). With L a multiple of
    KV_BLOCK and products from ``linear.matmul``, a query's output is bit-identical however many
    queries, rows and masked keys share the call: PyTorch's fused SDPA kernel is not. ``sinks (nh,)``
    (gpt-oss): each head's softmax also counts ``exp(sink)`` in its denominator, a key with no value.
    """
    B, nh, T, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.reshape(B, nkv, g * T, hd)  # (B, nkv, G*T, hd): head h uses kv head h // G
    s = matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd) if scale is None else scale)  # (B, nkv, G*T, L)
    if softcap is not None:  # Gemma 2: scores squashed into (-cap, cap)
        s = torch.tanh(s / softcap) * softcap
    s = s.view(B, nkv, g, T, L).masked_fill_(~mask.view(B, 1, 1, T, L), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, nkv, g, 1, 1).expand(B, nkv, g, T, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L].to(q.dtype).reshape(B, nkv, g * T, L)
    else:
        p = torch.softmax(s, dim=-1).to(q.dtype).view(B, nkv, g * T, L)
    return matmul(p, v).reshape(B, nh, T, hd)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attention`` for a mask with holes (a token tree): same shapes, and each query's result is
    bit-identical to decoding its own branch as a chain.

    A query's visible keys are gathered to the front, in slot order, and attended as one query over
    them (``attention`` with T = 1): the reductions then add the same values in the same lanes as a
    chain whose keys sit in consecutive slots. Costs a (B*T, nkv, L, hd) copy of the keys and values.
    """
    B, nh, T, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    m = mask.reshape(B, T, L)
    order = torch.sort((~m).to(torch.uint8), dim=-1, stable=True).indices  # (B, T, L) visible keys first
    idx = order.view(B, 1, T * L, 1).expand(B, nkv, T * L, hd)

    def gather(x: torch.Tensor) -> torch.Tensor:  # (B, nkv, L, hd) -> (B*T, nkv, L, hd)
        return x.gather(2, idx).view(B, nkv, T, L, hd).transpose(1, 2).reshape(B * T, nkv, L, hd)

    visible = torch.arange(L, device=q.device) < m.sum(-1).view(B * T, 1)  # (B*T, L)
    y = attention(q.transpose(1, 2).reshape(B * T, nh, 1, hd), gather(k), gather(v), visible.view(B * T, 1, 1, L),
                  scale, softcap, sinks)
    return y.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)


class Block(nn.Module):
    """One decoder layer. Its norms carry Hugging Face's names for each placement:

    - ``pre`` (Llama): h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))
    - ``sandwich`` (Gemma): h = x + post_attention_layernorm(attn(input_layernorm(x)));
      out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    - ``post`` (OLMo 2): h = x + post_attention_layernorm(attn(x)); out = h + post_feedforward_layernorm(mlp(h))

    and each branch is multiplied by ``residual_scale`` (Granite) before its residual add.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.residual_scale = cfg.residual_scale
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        if self.placement != "post":
            self.input_layernorm = RMSNorm(C, eps)
        self.kind = cfg.mixer(layer)  # the token mixer, named as transformers names it
        if self.kind == "attention":
            self.self_attn = Attention(cfg, layer)
        elif self.kind == "conv":
            self.conv = ShortConv(cfg, layer)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        self.post_attention_layernorm = RMSNorm(C, eps)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(C, eps)
        if self.placement != "pre":
            self.post_feedforward_layernorm = RMSNorm(C, eps)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)

    def norms(self) -> tuple[RMSNorm | None, RMSNorm | None, RMSNorm | None, RMSNorm | None]:
        """(before attention, after attention, before the MLP, after the MLP); None where absent."""
        p = self.placement
        return (None if p == "post" else self.input_layernorm,
                None if p == "pre" else self.post_attention_layernorm,
                self.post_attention_layernorm if p == "pre" else (self.pre_feedforward_layernorm if p == "sandwich" else None),
                None if p == "pre" else self.post_feedforward_layernorm)

    def _branch(self, y: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        y = y if norm is None else norm(y)
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def forward(self, x: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        return self.forward_parts([x], [fwd], layer)[0]

    def forward_parts(self, xs: list[torch.Tensor], fwds: list["ForwardContext"], layer: int) -> list[torch.Tensor]:
        """The layer over several blocks of tokens ``xs[i] (B_i, T_i, C)``, each with its own context
        (rows, positions, mask), in one pass: every weight product runs once over all their rows, only
        attention runs per part. Every op but attention is row-wise and the products batch-invariant,
        so each part's result is bit-identical to running it alone (one part: ``forward``)."""
        pre_attn, post_attn, pre_mlp, post_mlp = self.norms()
        sizes = [x.shape[0] * x.shape[1] for x in xs]
        flat = xs[0].reshape(sizes[0], -1) if len(xs) == 1 else torch.cat([x.reshape(n, -1) for x, n in zip(xs, sizes)])
        if self.kind == "attention":
            a = self.self_attn
            proj, out = a.qkv_proj, a.o_proj
            def mix(p, fwd): return a.attend(p, fwd, layer)  # noqa: E704
        else:  # a recurrent mixer: its in_proj, its state read and written by position, its out_proj
            m = self.conv if self.kind == "conv" else self.linear_attn
            proj, out, mix = m.in_proj, m.out_proj, m.mix
        qkv = proj(flat if pre_attn is None else pre_attn(flat)).split(sizes)  # per part (n, q + 2 kv)
        ys = [mix(q.view(*x.shape[:2], -1), fwd).reshape(n, -1) for q, x, fwd, n in zip(qkv, xs, fwds, sizes)]
        h = flat + self._branch(out(ys[0] if len(ys) == 1 else torch.cat(ys)), post_attn)
        h = h + self._branch(self.mlp(h if pre_mlp is None else pre_mlp(h)), post_mlp)
        return [y.view(x.shape) for y, x in zip(h.split(sizes), xs)]


@dataclass
class ForwardContext:
    """What every layer of one forward shares: rope tables, cache slots, the attention mask."""

    cache: KVCache
    rows: torch.Tensor | None  # (B,) cache rows, None = rows 0..B-1
    slots: tuple[torch.Tensor, ...]  # index for KVCache.write
    kv_len: int  # keys [0, kv_len) are read
    mask: torch.Tensor  # (B, 1, T, kv_len) bool, True = attend
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # per RoPE table: cos, sin (B, 1, T, rotary_dim)
    pos: torch.Tensor  # (B, T) the tokens' positions (sliding windows)
    fused_attention: bool = False  # see Transformer.forward
    tree: bool = False  # the mask has holes (a token tree): attention compacts each query's keys
    local_slots: tuple[torch.Tensor, ...] | None = None  # index for the windowed group's KVCache.write (cache.local)
    keys_at: dict[int, torch.Tensor] = field(default_factory=dict)  # id(cache group) -> where the keys lie, made once
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, made once per forward

    def keys_index(self, cache: KVCache) -> torch.Tensor:
        """``(B, nkv, kv_len)``: where the keys of ``cache`` (the cache or its windowed group) lie
        (``KVCache.gather_index``), made once per forward and group."""
        if id(cache) not in self.keys_at:
            self.keys_at[id(cache)] = cache.gather_index(self.row_ids, self.kv_len)
        return self.keys_at[id(cache)]

    @property
    def row_ids(self) -> torch.Tensor:
        """``(B,)`` the cache rows, also when ``rows`` is None."""
        return torch.arange(self.pos.shape[0], device=self.pos.device) if self.rows is None else self.rows

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` narrowed to a sliding window (``masks.sliding``), made once per window and forward."""
        if window not in self.windowed:
            self.windowed[window] = sliding(self.mask, self.pos, window)
        return self.windowed[window]


@dataclass
class PromptChunk:
    """A piece of one prompt prefilled inside another forward (a decode or verification step):
    ``tokens`` written to cache row ``row`` at positions ``start..``; no logits. Its weight products
    share the step's reads of the weights, so a long prompt's prefill barely slows the streams
    decoding beside it (Sarathi-Serve's mixed batches: Agrawal et al. 2024)."""

    row: int
    tokens: list[int]
    start: int

    @classmethod
    def split(cls, row: int, tokens: list[int], start: int, size: int) -> list["PromptChunk"]:
        """``tokens`` (placed at ``start..``) as chunks of ``size``, the last one shorter."""
        return [cls(row, tokens[a:a + size], start + a) for a in range(0, len(tokens), size)]


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # (B, T', V) for the requested positions
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, T, C); -1 = final norm


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; placeholders on the meta device (a GGUF load's quantized rows) stay placeholders
    without meta arithmetic (which imports torch._dynamo on first use: 1.6 s of a load)."""
    if all(p.is_meta for p in parts):
        return torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        device = torch.get_default_device()  # where tensors are made (a torch.device context's)
        # On the meta device (a load fills the model) no random start and no arithmetic: PyTorch's meta
        # arithmetic (normal_, arange's steps) imports torch._dynamo on first use, 1.6 s of a load.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size) if device.type == "meta" else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        with torch.device("cpu"):  # a few numbers, then to the model's device
            rope = rope_frequencies(cfg), rope_frequencies(cfg, local=True) if cfg.rope_local_theta else None
        self.register_buffer("inv_freq", rope[0].to(device), persistent=False)
        # the windowed layers' own RoPE base (Gemma 3): a second table
        self.register_buffer("inv_freq_local", None if rope[1] is None else rope[1].to(device), persistent=False)
        self.rope_factor = rope_attention_factor(cfg)  # YaRN / LongRoPE: cos and sin times it
        self.native: NativeForward | None = None  # see make_native
        self.graphs: CudaGraphs | None = None  # see use_cuda_graphs

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(), ...: the native twin and graphs hold addresses
        self.native = self.graphs = None
        return super()._apply(fn, recurse)

    def use_cuda_graphs(self, on: bool | None = None) -> bool:
        """Replay the decode and verification forwards as CUDA graphs (``models.cuda_graphs``) on a GPU:
        ``on`` None follows ``SPECDEC_CUDA_GRAPHS`` (default on); False where the model is not on a GPU."""
        on = cuda_graphs.enabled() if on is None else on
        self.graphs = CudaGraphs() if on and self.embed_tokens.weight.is_cuda else None
        return self.graphs is not None

    def make_native(self) -> bool:
        """Re-lay the bf16 weights out for the native kernels and run blocks of tokens through
        ``models.native`` from now on (see ``forward``); False (nothing changed but the re-layout)
        where the model or machine does not allow it, or ``SPECDEC_NATIVE=0`` asks for the PyTorch path
        (oneDNN-packed products, as before the native path: for comparisons)."""
        native = os.environ.get("SPECDEC_NATIVE", "1") != "0"  # "0": the PyTorch path, oneDNN-packed products
        pack_linears(self, native)
        if native:
            hugepages.rehome(self)  # the streamed weights on 2 MB pages (a forward 3-15% faster)
        self.native = NativeForward.build(self) if native else None
        return self.native is not None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, rows: int, max_len: int, num_blocks: int | None = None) -> KVCache:
        """A KV cache for the attention layers; a hybrid model's also holds its recurrent layers'
        states (``HybridCache``, rings of ``state_slots`` entries per row). The windowed layers' keys go to
        its windowed group (``KVCache.local``), which frees what leaves their window."""
        cfg, w = self.config, self.embed_tokens.weight
        windowed = cfg.windowed_layers
        args = (len(cfg.attention_layers) - len(windowed), rows, cfg.num_key_value_heads, max_len, cfg.head_dim)
        if not cfg.layer_mixers:
            cache = KVCache(*args, dtype=w.dtype, device=w.device, num_blocks=num_blocks)
        else:
            cache = HybridCache(*args, dtype=w.dtype, device=w.device, num_blocks=num_blocks,
                                conv_dims=self._conv_dims(), state_shapes=self._state_shapes(), slots=self.state_slots,
                                width=cfg.conv_kernel)
        if windowed:
            cache.local = KVCache(len(windowed), rows, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype=w.dtype,
                                  device=w.device, window=cfg.group_window)
        return cache

    state_slots = DEFAULT_SLOTS  # a hybrid model's state entries per row (HybridCache)

    def fit_state_slots(self, block: int, cache: KVCache | None = None) -> None:
        """A hybrid's rings (of new caches, and of ``cache``) wide enough for blocks of ``block`` tokens
        (``state_cache.slots_for``); nothing for other models."""
        if self.config.layer_mixers:
            slots = max(self.state_slots, slots_for(block, self.config.conv_kernel))
            if isinstance(cache, HybridCache):
                cache.ensure_slots(slots)  # may refuse (a request runs): then nothing changes
            self.state_slots = slots

    def _conv_dims(self) -> list[int]:
        return [(b.conv if b.kind == "conv" else b.linear_attn).conv_dim
                for b in (self.layers[i] for i in self.config.state_layers)]

    def _state_shapes(self) -> list[tuple[int, int, int] | None]:
        cfg = self.config
        return [None if cfg.mixer(i) == "conv" else (cfg.delta_v_heads, cfg.delta_k_dim, cfg.delta_v_dim)
                for i in cfg.state_layers]

    def block_bytes(self, windowed: bool = False) -> int:
        """Bytes of one KV cache block: keys and values of every attention layer without a window (``windowed``:
        of every windowed layer, a block of the cache's windowed group)."""
        cfg = self.config
        n = len(cfg.windowed_layers) if windowed else len(cfg.attention_layers) - len(cfg.windowed_layers)
        return 2 * n * cfg.num_key_value_heads * KV_BLOCK * cfg.head_dim * self.embed_tokens.weight.element_size()

    def window_bytes(self, max_len: int) -> int:
        """Bytes of one sequence's windowed keys at most (the windowed group's blocks of a row, whatever its
        context; 0 without windowed layers)."""
        window = self.config.group_window
        return window_row_blocks(window, max_len) * self.block_bytes(windowed=True) if window else 0

    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent states (a hybrid model's; 0 for others), whatever its length."""
        if not self.config.layer_mixers:
            return 0
        return row_state_bytes(self._conv_dims(), self._state_shapes(), self.state_slots, self.embed_tokens.weight.dtype)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache, *,
                rows: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, skip_layers: frozenset[int] = frozenset(),
                hidden_layers: tuple[int, ...] = (), logits_positions: str | torch.Tensor = "all",
                fused_attention: bool = False, prompt_chunks: Sequence[PromptChunk] = ()) -> ForwardOutput:
        """Run the model over ``tokens (B, T)`` at RoPE positions ``input_pos (B, T)``.

        rows: which cache rows the B sequences use (default 0..B-1).
        cache_pos: cache slots the new keys/values go to (default ``input_pos``). Slots of one row
            must be consecutive; a token tree stores its nodes in consecutive slots while their
            RoPE positions repeat by depth.
        attn_mask: ``(B, T, W)`` bool (True = may attend) over the W slots that end at each row's
            last new slot: W = T, among the new tokens; W > T, also earlier slots (a drafter growing
            a token tree over several calls passes the whole tree). Every slot before that window
            stays visible. Default: causal by slot. A token tree's queries then attend exactly as
            their own branch would as a chain (``tree_attention``; the native kernel compacts too).
        skip_layers: layers not run (self-speculation); they also write no cache.
        hidden_layers: return the hidden state after these blocks (-1: after the final norm).
        logits_positions: "all", "last", "none", or a ``(B, T')`` index tensor of positions.
        fused_attention: PyTorch's fused attention even on a batch-invariant model: for prompt
            prefill, which plain and speculative decoding run identically (one sequence, same
            chunks), so its results need not match other batch shapes; much faster on long prompts.
        prompt_chunks: also prefill these pieces of other sequences' prompts in the same pass (see
            ``PromptChunk``); the outputs are those of ``tokens`` alone, bit for bit, and each chunk's
            cache is what a prefill call of it alone writes (with at most ``row_block`` tokens).
        """
        if prompt_chunks and skip_layers:
            raise ValueError("a prompt chunk cannot ride a forward that skips layers")
        if self.native is not None and row_block(self.embed_tokens.weight.dtype) is not None:
            # blocks of tokens (not a prompt prefill's whole products): every layer in one native call
            x, hidden = self.native(tokens, input_pos, cache, rows=rows, cache_pos=cache_pos, attn_mask=attn_mask,
                                    skip_layers=skip_layers, hidden_layers=hidden_layers,
                                    logits_positions=logits_positions, prompt_chunks=prompt_chunks)
            return self._output(x, hidden, logits_positions)
        if (self.graphs is not None and not (prompt_chunks or fused_attention) and torch.is_inference_mode_enabled()
                and row_block(self.embed_tokens.weight.dtype) is not None):  # a GPU's decode and verification forwards
            logits, hidden = self.graphs(self, tokens, input_pos, cache, rows=rows, cache_pos=cache_pos,
                                         attn_mask=attn_mask, skip_layers=skip_layers, hidden_layers=hidden_layers,
                                         logits_positions=logits_positions)
            return ForwardOutput(logits=logits, hidden=hidden)
        return self.layers_forward(tokens, input_pos, cache, rows=rows, cache_pos=cache_pos, attn_mask=attn_mask,
                                   skip_layers=skip_layers, hidden_layers=hidden_layers,
                                   logits_positions=logits_positions, fused_attention=fused_attention,
                                   prompt_chunks=prompt_chunks)

    def layers_forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache, *,
                       rows: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, skip_layers: frozenset[int] = frozenset(),
                       hidden_layers: tuple[int, ...] = (), logits_positions: str | torch.Tensor = "all",
                       fused_attention: bool = False, prompt_chunks: Sequence[PromptChunk] = (),
                       kv_len: int | None = None) -> ForwardOutput:
        """``forward`` on the PyTorch path, one operator at a time. With ``kv_len`` (a multiple of
        KV_BLOCK past every slot written) the caller has mapped the blocks written and checked the
        positions (``prepare``): the call then makes no host synchronization, so it can be captured as
        a CUDA graph (``models.cuda_graphs``), and it reads ``kv_len`` keys."""
        # every part is mapped before any computes: a windowed group keeps what the earliest part reads
        since = first_slots(rows, input_pos if cache_pos is None else cache_pos, prompt_chunks,
                            0 if attn_mask is None else attn_mask.shape[-1])
        fwd = self._context(tokens.shape, input_pos, cache, rows, cache_pos, attn_mask, fused_attention, kv_len,
                            since)
        x = self.embed(tokens)  # (B, T, C)
        parts, fwds = [x], [fwd]
        for pc in prompt_chunks:  # more parts: (1, C) tokens of another row each, fused attention
            dev = tokens.device
            ptoks = torch.tensor([pc.tokens], device=dev)
            ppos = torch.arange(pc.start, pc.start + ptoks.shape[1], device=dev).unsqueeze(0)
            fwds.append(self._context(ptoks.shape, ppos, cache, torch.tensor([pc.row], device=dev), None, None, True,
                                      since=since))
            parts.append(self.embed(ptoks))
        hidden: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            if i not in skip_layers:
                parts = [block(x, fwd, i)] if len(parts) == 1 else block.forward_parts(parts, fwds, i)
                x = parts[0]
            if i in hidden_layers:
                hidden[i] = x
        x = self.norm(x)
        if -1 in hidden_layers:
            hidden[-1] = x
        return self._output(x, hidden, logits_positions)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(B, T, C)``, times the family's ``embed_scale`` (Gemma: sqrt(C), rounded to
        the weights' dtype as transformers does; Granite's embedding_multiplier)."""
        x = self.embed_tokens(tokens)
        scale = self.config.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def _output(self, x: torch.Tensor, hidden: dict[int, torch.Tensor], logits_positions: str | torch.Tensor
                ) -> ForwardOutput:
        """The LM head over the final norm's output ``x (B, T, C)`` at ``logits_positions``, divided by
        ``logits_scaling`` (Granite) and soft-capped (Gemma 2) where the family does."""
        if isinstance(logits_positions, torch.Tensor):
            x = x.gather(1, logits_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        elif logits_positions == "last":
            x = x[:, -1:]
        elif logits_positions == "none":
            return ForwardOutput(logits=None, hidden=hidden)
        logits = self.lm_head(x)
        cfg = self.config
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return ForwardOutput(logits=logits, hidden=hidden)

    def prepare(self, cache: KVCache, rows: torch.Tensor | None, cache_pos: torch.Tensor,
                attn_mask: torch.Tensor | None, since: dict[int, int] | None = None) -> int:
        """The host's part of a forward writing slots ``cache_pos (B, T)``: checks them, maps (and makes
        the rows' own) the blocks they fall in; returns how many keys the forward reads (whole blocks).
        ``since``: ``masks.first_slots`` of the forward (None: of these slots and their mask)."""
        if attn_mask is not None:
            check_window(cache_pos, attn_mask)
            since = first_slots(rows, cache_pos, (), attn_mask.shape[-1]) if since is None else since
        cache.prepare_writes(torch.arange(cache_pos.shape[0]) if rows is None else rows, cache_pos, since)
        return min(-(-(int(cache_pos.max()) + 1) // KV_BLOCK) * KV_BLOCK, cache.max_len)  # keys read: whole blocks

    def _context(self, shape: torch.Size, input_pos: torch.Tensor, cache: KVCache, rows: torch.Tensor | None,
                 cache_pos: torch.Tensor | None, attn_mask: torch.Tensor | None, fused_attention: bool,
                 kv_len: int | None = None, since: dict[int, int] | None = None) -> ForwardContext:
        """What every layer needs for tokens of ``shape (B, T)`` (see ``forward`` for the arguments;
        ``kv_len``: see ``layers_forward``; ``since``: see ``prepare``)."""
        B, T = shape
        if self.config.layer_mixers and attn_mask is not None:
            raise ValueError("token trees are not supported on hybrid models (their recurrent states follow "
                             "one chain of tokens)")
        cache_pos = input_pos if cache_pos is None else cache_pos
        if kv_len is None:
            kv_len = self.prepare(cache, rows, cache_pos, attn_mask, since)
        mask = attention_mask(cache_pos, attn_mask, kv_len)  # (B, T, L)
        mask = mask.unsqueeze(1)  # (B, 1, T, L)
        dtype = self.embed_tokens.weight.dtype
        tables = []
        for inv in (self.inv_freq, self.inv_freq_local):
            if inv is None:
                break
            angles = input_pos.to(inv.dtype).unsqueeze(-1) * inv  # (B, T, rd/2)
            angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B, 1, T, rd)
            cos, sin = angles.cos(), angles.sin()
            if self.rope_factor != 1.0:
                cos, sin = cos * self.rope_factor, sin * self.rope_factor
            tables.append((cos.to(dtype), sin.to(dtype)))
        local = None if cache.local is None else cache.local.slot_index(rows, cache_pos, prepare=False)
        return ForwardContext(cache=cache, rows=rows, slots=cache.slot_index(rows, cache_pos, prepare=False),
                              local_slots=local,
                              kv_len=kv_len, mask=mask, rope=tables, pos=input_pos,
                              fused_attention=fused_attention, tree=attn_mask is not None)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face–named weights (``model.`` prefix stripped), fusing q/k/v and gate/up.

        ``sd`` is consumed: each layer's unfused weights leave it as they are fused, so loading holds
        one copy of the model plus one layer (not two copies of every fused matrix).
        """
        from specdec.families import family  # noqa: PLC0415

        fam = family(self.config.architecture)
        offset = fam.norm_offset
        if any(k.startswith("language_model.") for k in sd):  # a multimodal checkpoint (families.WRAPPERS)
            for k in list(sd):
                if k.startswith("language_model."):
                    sd[k[len("language_model."):]] = sd.pop(k)
                elif not k.startswith("lm_head."):
                    del sd[k]  # the vision tower, MTP layers
        for k in [k for k in sd if any(a in k for a, _ in fam.hf_renames)]:
            new = k
            for a, b in fam.hf_renames:
                new = new.replace(a, b)
            sd[new] = sd.pop(k)
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            if self.config.mixer(i) != "attention":
                _recurrent_weights(sd, p, self.config.mixer(i))
            elif a + "qkv_proj.weight" not in sd:  # Phi-3 ships them fused already, in this order
                sd[a + "qkv_proj.weight"] = _cat([sd.pop(f"{a}{n}_proj.weight") for n in "qkv"])
            if self.config.attention_bias and a + "qkv_proj.bias" not in sd:
                sd[a + "qkv_proj.bias"] = _cat([sd.pop(f"{a}{n}_proj.bias") for n in "qkv"])
            if self.config.is_moe(i):
                hf_moe_weights(sd, p, self.config)
            elif m + "gate_up_proj.weight" not in sd:
                sd[m + "gate_up_proj.weight"] = _cat([sd.pop(m + "gate_proj.weight"), sd.pop(m + "up_proj.weight")])
        if offset:  # Gemma's RMSNorm computes x * (1 + w): the 1 folded into the weights, as llama.cpp does
            # (not into a delta-net's gated norm of its outputs, a plain RMSNorm in Qwen3.5 too)
            for k in [k for k in sd if k.endswith("norm.weight") and ".linear_attn." not in k]:
                sd[k] = (sd[k].float() + offset).to(sd[k].dtype)
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the architecture: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self.tie_weights()
        for p in self.parameters():
            p.requires_grad_(False)


def _recurrent_weights(sd: dict[str, torch.Tensor], p: str, kind: str) -> None:
    """A recurrent layer's weights as our modules hold them: the convolution's ``(D, 1, width)`` as
    ``(D, width)``; a delta-net's four input products as one (``GatedDeltaNet.in_proj``)."""
    m = p + ("conv." if kind == "conv" else "linear_attn.")
    if sd.get(m + "conv_weight") is not None and sd[m + "conv_weight"].dim() == 3:
        sd[m + "conv_weight"] = sd[m + "conv_weight"].squeeze(1)
    if kind == "delta" and m + "in_proj.weight" not in sd:
        sd[m + "in_proj.weight"] = torch.cat([sd.pop(f"{m}in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None, *,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                seed: int = 0) -> Transformer:
    """A model with the given Hugging Face–named weights (the dict is consumed), or random weights
    (tests) when None."""
    if state_dict is not None:
        with torch.device("meta"):
            model = Transformer(cfg)
        for k in list(state_dict):  # in place: the caller's dict is consumed (see load_hf_state_dict)
            state_dict[k] = state_dict[k].to(device=device, dtype=weight_dtype(k, dtype))  # FP32_WEIGHTS stay fp32
        model.load_hf_state_dict(state_dict)
        model.inv_freq = rope_frequencies(cfg).to(device)
        if cfg.rope_local_theta:
            model.inv_freq_local = rope_frequencies(cfg, local=True).to(device)
        return model.eval()
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / math.sqrt(p.shape[-1]))
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
