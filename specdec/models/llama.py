"""A compact Llama-family transformer: Llama 2/3, Qwen2/2.5, SmolLM/SmolLM2, Mistral.

RMSNorm, rotary position embeddings (Su et al. 2021) with the config's theta (and Llama 3
frequency scaling), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020).

One forward serves prefill, decoding, draft verification and self-speculation:
tokens and their positions ``(B, T)`` (rows may sit at different positions), a paged KV cache
written by position, an optional block attention mask (token trees), hidden states of chosen
layers, and a set of layers to skip.
"""
from __future__ import annotations

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
from specdec.models.linear import Linear, matmul, pack_linears, row_block
from specdec.models import cuda_graphs
from specdec.models.cuda_graphs import CudaGraphs
from specdec.models.masks import attention_mask, check_window
from specdec.models.native import NativeForward
from specdec.runtime.kv_cache import KV_BLOCK, KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``(head_dim/2,)``, with Llama 3 scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        # q, k and v as one matmul: same bytes read, a third of the calls
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), fwd, layer))

    def attend(self, qkv: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        """``qkv (B, T, q + 2 kv)`` -> the attention output before ``o_proj``, ``(B, T, q_size)``;
        writes the new keys and values to the cache."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        q = q * fwd.cos + rotate_half(q) * fwd.sin
        k = k * fwd.cos + rotate_half(k) * fwd.sin
        fwd.cache.write(layer, fwd.slots, k, v)
        if not fwd.fused_attention:  # the native kernel reads the cache in place (bf16 on CPU)
            y = cached_attention(q, fwd.cache.k[layer], fwd.cache.v[layer], fwd.cache.table, fwd.rows, fwd.mask,
                                 1.0 / math.sqrt(self.hd))
            if y is not None:
                return y
        if fwd.keys_at is None:  # one gather index per forward, all layers
            rows = torch.arange(B, device=q.device) if fwd.rows is None else fwd.rows
            fwd.keys_at = fwd.cache.gather_index(rows, fwd.kv_len)
        keys, values = fwd.cache.read(layer, fwd.keys_at)  # (B, nkv, L, hd)
        if fwd.fused_attention:  # prompt prefill: PyTorch's fused kernel, not bit-stable across batch shapes
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=fwd.mask, enable_gqa=True)
        elif fwd.tree:
            y = tree_attention(q, keys, values, fwd.mask)  # (B, nh, T, hd)
        else:
            y = attention(q, keys, values, fwd.mask)  # (B, nh, T, hd)
        return y.transpose(1, 2).reshape(B, T, self.q_size)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention, batch-invariant: ``q (B, nh, T, hd)``, ``k, v (B, nkv, L, hd)``,
    ``mask (B, 1, T, L)`` bool -> ``(B, nh, T, hd)``.

    The G = nh/nkv query heads sharing a kv head form the rows of one product per kv head; scores
    are softmaxed in fp32 (as transformers' eager attention does). With L a multiple of
    KV_BLOCK and products from ``linear.matmul``, a query's output is bit-identical however many
    queries, rows and masked keys share the call: PyTorch's fused SDPA kernel is not.
    """
    B, nh, T, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.reshape(B, nkv, g * T, hd)  # (B, nkv, G*T, hd): head h uses kv head h // G
    s = matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd))  # (B, nkv, G*T, L)
    s = s.view(B, nkv, g, T, L).masked_fill_(~mask.view(B, 1, 1, T, L), float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype).view(B, nkv, g * T, L)
    return matmul(p, v).reshape(B, nh, T, hd)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
    y = attention(q.transpose(1, 2).reshape(B * T, nh, 1, hd), gather(k), gather(v), visible.view(B * T, 1, 1, L))
    return y.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, fwd: "ForwardContext", layer: int) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), fwd, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_parts(self, xs: list[torch.Tensor], fwds: list["ForwardContext"], layer: int) -> list[torch.Tensor]:
        """``forward`` of several blocks of tokens ``xs[i] (B_i, T_i, C)``, each with its own context
        (rows, positions, mask), in one pass: every weight product runs once over all their rows, only
        attention runs per part. Every op but attention is row-wise and the products batch-invariant,
        so each part's result is bit-identical to running it alone."""
        a = self.self_attn
        sizes = [x.shape[0] * x.shape[1] for x in xs]
        flat = torch.cat([x.reshape(n, -1) for x, n in zip(xs, sizes)])  # (N, C)
        qkv = a.qkv_proj(self.input_layernorm(flat)).split(sizes)  # per part (n, q + 2 kv)
        ys = [a.attend(q.view(*x.shape[:2], -1), fwd, layer).reshape(n, -1)
              for q, x, fwd, n in zip(qkv, xs, fwds, sizes)]
        h = flat + a.o_proj(torch.cat(ys))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return [y.view(x.shape) for y, x in zip(h.split(sizes), xs)]


@dataclass
class ForwardContext:
    """What every layer of one forward shares: rope tables, cache slots, the attention mask."""

    cache: KVCache
    rows: torch.Tensor | None  # (B,) cache rows, None = rows 0..B-1
    slots: tuple[torch.Tensor, ...]  # index for KVCache.write
    kv_len: int  # keys [0, kv_len) are read
    mask: torch.Tensor  # (B, 1, T, kv_len) bool, True = attend
    cos: torch.Tensor  # (B, 1, T, hd)
    sin: torch.Tensor  # (B, 1, T, hd)
    fused_attention: bool = False  # see Transformer.forward
    tree: bool = False  # the mask has holes (a token tree): attention compacts each query's keys
    keys_at: torch.Tensor | None = None  # (B, nkv, kv_len) where the keys lie (KVCache.gather_index), made once


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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
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
        cfg, w = self.config, self.embed_tokens.weight
        return KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, max_len, cfg.head_dim,
                       dtype=w.dtype, device=w.device, num_blocks=num_blocks)

    def block_bytes(self) -> int:
        """Bytes of one KV cache block (keys and values of every layer)."""
        cfg = self.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * KV_BLOCK * cfg.head_dim * self.embed_tokens.weight.element_size()

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
        fwd = self._context(tokens.shape, input_pos, cache, rows, cache_pos, attn_mask, fused_attention, kv_len)
        x = self.embed_tokens(tokens)  # (B, T, C)
        parts, fwds = [x], [fwd]
        for pc in prompt_chunks:  # more parts: (1, C) tokens of another row each, fused attention
            dev = tokens.device
            ptoks = torch.tensor([pc.tokens], device=dev)
            ppos = torch.arange(pc.start, pc.start + ptoks.shape[1], device=dev).unsqueeze(0)
            fwds.append(self._context(ptoks.shape, ppos, cache, torch.tensor([pc.row], device=dev), None, None, True))
            parts.append(self.embed_tokens(ptoks))
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

    def _output(self, x: torch.Tensor, hidden: dict[int, torch.Tensor], logits_positions: str | torch.Tensor
                ) -> ForwardOutput:
        """The LM head over the final norm's output ``x (B, T, C)`` at ``logits_positions``."""
        if isinstance(logits_positions, torch.Tensor):
            x = x.gather(1, logits_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        elif logits_positions == "last":
            x = x[:, -1:]
        elif logits_positions == "none":
            return ForwardOutput(logits=None, hidden=hidden)
        return ForwardOutput(logits=self.lm_head(x), hidden=hidden)

    def prepare(self, cache: KVCache, rows: torch.Tensor | None, cache_pos: torch.Tensor,
                attn_mask: torch.Tensor | None) -> int:
        """The host's part of a forward writing slots ``cache_pos (B, T)``: checks them, maps (and makes
        the rows' own) the blocks they fall in; returns how many keys the forward reads (whole blocks)."""
        if attn_mask is not None:
            check_window(cache_pos, attn_mask)
        cache.prepare_writes(torch.arange(cache_pos.shape[0]) if rows is None else rows, cache_pos)
        return min(-(-(int(cache_pos.max()) + 1) // KV_BLOCK) * KV_BLOCK, cache.max_len)  # keys read: whole blocks

    def _context(self, shape: torch.Size, input_pos: torch.Tensor, cache: KVCache, rows: torch.Tensor | None,
                 cache_pos: torch.Tensor | None, attn_mask: torch.Tensor | None, fused_attention: bool,
                 kv_len: int | None = None) -> ForwardContext:
        """What every layer needs for tokens of ``shape (B, T)`` (see ``forward`` for the arguments;
        ``kv_len``: see ``layers_forward``)."""
        B, T = shape
        cache_pos = input_pos if cache_pos is None else cache_pos
        if kv_len is None:
            kv_len = self.prepare(cache, rows, cache_pos, attn_mask)
        mask = attention_mask(cache_pos, attn_mask, kv_len)  # (B, T, L)
        mask = mask.unsqueeze(1)  # (B, 1, T, L)
        angles = input_pos.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # (B, T, hd/2)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B, 1, T, hd)
        dtype = self.embed_tokens.weight.dtype
        return ForwardContext(cache=cache, rows=rows, slots=cache.slot_index(rows, cache_pos, prepare=False),
                              kv_len=kv_len,
                              mask=mask, cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
                              fused_attention=fused_attention, tree=attn_mask is not None)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face–named weights (``model.`` prefix stripped), fusing q/k/v and gate/up.

        ``sd`` is consumed: each layer's unfused weights leave it as they are fused, so loading holds
        one copy of the model plus one layer (not two copies of every fused matrix).
        """
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            sd[a + "qkv_proj.weight"] = torch.cat([sd.pop(f"{a}{n}_proj.weight") for n in "qkv"])
            if self.config.attention_bias:
                sd[a + "qkv_proj.bias"] = torch.cat([sd.pop(f"{a}{n}_proj.bias") for n in "qkv"])
            sd[m + "gate_up_proj.weight"] = torch.cat([sd.pop(m + "gate_proj.weight"), sd.pop(m + "up_proj.weight")])
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


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None, *,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                seed: int = 0) -> Transformer:
    """A model with the given Hugging Face–named weights (the dict is consumed), or random weights
    (tests) when None."""
    if state_dict is not None:
        with torch.device("meta"):
            model = Transformer(cfg)
        for k in list(state_dict):  # in place: the caller's dict is consumed (see load_hf_state_dict)
            state_dict[k] = state_dict[k].to(device=device, dtype=dtype)
        model.load_hf_state_dict(state_dict)
        model.inv_freq = rope_frequencies(cfg).to(device)
        return model.eval()
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / math.sqrt(p.shape[-1]))
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
