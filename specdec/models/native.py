"""The native twin of ``Transformer.forward`` for blocks of tokens (``kernels/csrc/forward.c``).

Every decoder layer of a forward runs inside one native call with one OpenMP parallel region: no
PyTorch operation, no thread wake-up per operation. ``models/llama.py`` stays the readable reference
and the fallback (no compiler, neither AVX-512 BF16 nor AVX2, a GPU, fp32, a prompt prefill's large products); the
two agree to the last bits of a product's summation order, and the native path is batch-invariant for
any number of rows, which is what exact speculation needs (tests/models/test_native.py).

    native = NativeForward.build(model)   # None where the model or machine does not allow it
    out = native(tokens, input_pos, cache, ...)   # Transformer.forward's arguments and result
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from specdec import kernels
from specdec.kernels.tiles import Mat, bf16_mat
from specdec.quant.linear import Linear
from specdec.models.masks import attention_mask, first_slots
from specdec.models.moe import MoE
from specdec.quant.qlinear import QLinear
from specdec.runtime.kv_cache import KV_BLOCK, KVCache
from specdec.runtime.state_cache import HybridCache

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class Moe(ctypes.Structure):  # sd.h's sd_moe
    _fields_ = [("E", _i64), ("k", _i64), ("router", _i64), ("norm_topk", _i64), ("inter", _i64),
                ("shared_inter", _i64), ("gate", Mat), ("gate_bias", _p), ("experts", ctypes.POINTER(Mat)),
                ("shared_gate_up", Mat), ("shared_down", Mat), ("shared_gate", Mat),
                # the grouped sigmoid router's (router 2: GLM-4.5), and an ungated shared expert
                ("correction", _p), ("n_group", _i64), ("topk_group", _i64), ("routed_scale", ctypes.c_double),
                ("shared_ungated", _i64)]


class Layer(ctypes.Structure):  # forward.c's sd_layer
    _fields_ = [("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat), ("ln1", _p), ("ln2", _p),
                ("post_attn", _p), ("post_ffn", _p), ("q_norm", _p), ("k_norm", _p), ("window", _i64), ("rope", _i64),
                ("moe", ctypes.POINTER(Moe)), ("sinks", _p),
                # a hybrid's layers: the mixer (0 attention, 1 short convolution, 2 gated delta-net), the attention's
                # layer in the KV cache, the recurrent layer's state layer; its weights (kernels/csrc/recurrent.c)
                ("mixer", _i64), ("kv", _i64), ("state", _i64), ("conv_wt", _p), ("conv_b", _p), ("neg_a", _p),
                ("dt_bias", _p), ("gnorm", _p)]


class Model(ctypes.Structure):  # forward.c's sd_model
    _fields_ = [("n_layers", _i64), ("C", _i64), ("nh", _i64), ("nkv", _i64), ("hd", _i64), ("inter", _i64),
                ("eps", ctypes.c_double), ("layers", ctypes.POINTER(Layer)), ("inv_freq", _p), ("norm", _p),
                ("qk_norm", _i64), ("activation", _i64), ("rotary", _i64), ("attn_scale", ctypes.c_double),
                ("residual_scale", ctypes.c_double), ("rope_factor", ctypes.c_double), ("inv_freq_local", _p),
                ("swiglu_limit", ctypes.c_double), ("swiglu_alpha", ctypes.c_double), ("gate_out", _i64),
                ("width", _i64), ("hk", _i64), ("hv", _i64), ("dk", _i64), ("dv", _i64),
                ("attn_softcap", ctypes.c_double)]  # Gemma 2's attention soft-capping, 0: none


class Batch(ctypes.Structure):  # forward.c's sd_batch
    _fields_ = [("M", _i64), ("x", _p), ("pos", _p), ("slot", _p), ("row", _p), ("mask", _p), ("L", _i64),
                ("kc", _p), ("vc", _p), ("layer_stride", _i64), ("table", _p), ("max_blocks", _i64),
                ("bshift", _i64), ("skip", _p), ("mask_win", _p), ("hidden", _p), ("work", _p), ("work_bytes", _i64),
                ("moe_stats", _p), ("ring_in", _p), ("ring_state", _p), ("slots", _i64),
                # the windowed layers' keys and values (KVCache.local) and their table, or NULL
                ("kc_win", _p), ("vc_win", _p), ("win_stride", _i64), ("table_win", _p), ("max_blocks_win", _i64)]


def mat(layer: torch.nn.Module) -> Mat | None:
    """The kernels' view of a tiled ``Linear`` or a ``QLinear`` (None for any other layout)."""
    if isinstance(layer, QLinear):
        w = layer.qweight
        return Mat(w.fmt, w.bits, w.out_features, w.in_features, w.data.data_ptr(), w.scales.data_ptr(),
                   w.bias.data_ptr() if w.bias is not None else None)
    if isinstance(layer, Linear) and layer.tiled is not None:
        return bf16_mat(layer.tiled, layer.out_features, layer.in_features, layer.bias_f32)
    return None


class _Work:
    """The scratch buffer handed to the kernels (``sd_forward_work_bytes``: per thread, attention scores
    and indices for ``L`` keys, so it grows with the context): grown on demand, a quarter more than asked,
    so a steady load allocates nothing per call; given back when it has stayed far larger than needed.
    After ``SHRINK_AFTER`` calls in a row that each needed under a quarter of it, it is replaced by one
    sized for the largest of those needs, so one long-context request does not pin its scratch (about
    1 GB at 128k keys with many threads) for the life of the process. ``trim()`` gives it back at once
    (``model.native.work.trim()``, e.g. when a server goes idle); the next call allocates what it needs."""

    SHRINK_AFTER = 64  # calls: a few seconds of decoding, so a burst of short steps does not thrash it

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._small = 0  # consecutive calls that needed under a quarter of the buffer
        self._peak = 0  # the largest need among them

    def get(self, nbytes: int) -> torch.Tensor:
        cap = self.buf.numel()
        if cap < nbytes:
            self._alloc(nbytes)
        elif nbytes < cap // 4:
            self._small += 1
            self._peak = max(self._peak, nbytes)
            if self._small >= self.SHRINK_AFTER:
                self._alloc(self._peak)
        else:
            self._small = self._peak = 0
        return self.buf

    def trim(self) -> None:
        """Release the buffer now."""
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._small = self._peak = 0

    def _alloc(self, nbytes: int) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)  # the old one goes first: never both at once
        self.buf = torch.empty(int(nbytes * 1.25) + 4096, dtype=torch.uint8)
        self._small = self._peak = 0


def tile_linears(module: torch.nn.Module) -> int:
    """For inference: every bf16 ``torch.nn.Linear`` of ``module`` (a drafting head) becomes a ``Linear``
    on the native tiles (one native product per call instead of oneDNN's costly one-row path); returns
    how many. Nothing changes where the native kernels are missing."""
    if kernels.library() is None:
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                lin = Linear(child.in_features, child.out_features, bias=child.bias is not None, dtype=torch.bfloat16)
                lin.weight = torch.nn.Parameter(child.weight.detach(), requires_grad=False)
                if child.bias is not None:
                    lin.bias = torch.nn.Parameter(child.bias.detach(), requires_grad=False)
                if lin.tile():
                    setattr(parent, name, lin)
                    count += 1
    return count


def missing_features(cfg) -> list[str]:
    """The family switches of ``cfg`` (``ModelConfig``) that the native forward does not run."""
    out = []
    if len({w for w in (cfg.layer_windows or ()) if w}) > 1:
        out.append("sliding windows of several sizes")
    if cfg.rotary_dim % 16:
        out.append(f"{cfg.rotary_dim} rotary dimensions (a multiple of 16 runs natively)")
    if cfg.qk_norm == "full" and (cfg.num_key_value_heads * cfg.head_dim) % 16:
        out.append("a whole-width k norm of this size")
    if cfg.attn_output_gate and cfg.qk_norm == "full":
        out.append("gated attention outputs with a whole-width q norm")
    if "delta" in (cfg.layer_mixers or ()) and (cfg.delta_k_dim % 16 or cfg.delta_v_dim % 16):
        out.append(f"delta-net heads of {cfg.delta_k_dim} x {cfg.delta_v_dim} (multiples of 16 run natively)")
    return out


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run natively (None: it can)."""
    cfg = model.config
    if kernels.library() is None:
        return f"no native kernels ({kernels.reason()})"
    if model.embed_tokens.weight.dtype != torch.bfloat16 or model.embed_tokens.weight.device.type != "cpu":
        return "native forward: bf16 weights on the CPU only"
    missing = missing_features(cfg)
    if missing:
        return f"native forward: {cfg.architecture} needs {', '.join(missing)}, which it lacks yet"
    hd, g = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    if hd % 16 or hd > 256 or g > 16 or cfg.num_attention_heads % cfg.num_key_value_heads:
        return f"native forward: head size {hd} / group {g} not supported"
    if cfg.hidden_size % 32 or cfg.intermediate_size % 32:
        return "native forward: hidden and intermediate sizes must be multiples of 32"
    if cfg.num_experts:
        if (cfg.moe_intermediate_size % 32 or cfg.shared_expert_size % 32
                or not 0 < cfg.experts_per_tok <= cfg.num_experts):
            return "native forward: expert sizes must be multiples of 32, and 1 <= experts per token <= experts"
    for blk in model.layers:
        m = blk.mlp
        if isinstance(m, MoE):
            if any(r.tiles() is None for r in _routers(m)):
                return "native forward: a router's weight is not bf16 (or the native product is missing)"
            linears = [x for e in _mlps(m) for x in (e.gate_up_proj, e.down_proj)]
        else:
            linears = [m.gate_up_proj, m.down_proj]
        if any(mat(x) is None for x in (*_mixer_products(blk), *linears)):
            return "native forward: a layer's weights are neither tiled bf16 nor quantized"
    return None


def _mixer_products(blk: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A block's token mixer's input and output products: attention's qkv and o, a recurrent layer's
    in_proj and out_proj."""
    if blk.kind == "attention":
        return blk.self_attn.qkv_proj, blk.self_attn.o_proj
    r = blk.conv if blk.kind == "conv" else blk.linear_attn
    return r.in_proj, r.out_proj


def _mlps(m: MoE) -> list[torch.nn.Module]:
    """An MoE layer's experts, then its shared expert if any."""
    return [*m.experts, *([m.shared_expert] if m.cfg.shared_expert_size else [])]


def _routers(m: MoE) -> list[torch.nn.Module]:
    """An MoE layer's router, then its shared expert's gate if any (GLM-4.5's shared expert has none)."""
    return [m.router, *([m.shared_expert_gate] if m.cfg.shared_expert_size and m.cfg.shared_expert_gate else [])]


class NativeForward:
    """Runs a ``Transformer``'s decoder layers natively; the embedding lookup and the LM head (one
    native product, ``Linear``/``QLinear``) stay in Python.

    ``moe_stats``: set it to ``torch.zeros(n_layers, num_experts, 3, dtype=torch.int64)`` and every call
    adds, per MoE layer and expert, the rows routed to it and the tiles of its gate/up and down products
    computed (an expert chosen by any row: each of its tiles once per call, whatever the rows)."""

    moe_stats: torch.Tensor | None = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.lib = kernels.library()
        sizes = (ctypes.c_int64 * 4)()
        self.lib.sd_forward_struct_sizes(sizes)
        if list(sizes) != [ctypes.sizeof(Layer), ctypes.sizeof(Model), ctypes.sizeof(Batch), ctypes.sizeof(Moe)]:
            raise RuntimeError(f"native forward: the library's structs ({list(sizes)} bytes) differ from "
                               "models/native.py's mirrors: rebuild the kernels (python -m specdec.kernels --force)")
        layers = (Layer * cfg.num_hidden_layers)()
        self._keep: list = []  # what the structs point to
        for i, blk in enumerate(model.layers):
            m = blk.mlp
            pre_attn, post_attn, pre_mlp, post_mlp = (self._bf16(n.weight) if n is not None else None
                                                      for n in blk.norms())
            moe = self._moe(m) if isinstance(m, MoE) else None
            gate_up, down = (Mat(), Mat()) if moe else (mat(m.gate_up_proj), mat(m.down_proj))
            first, out = (mat(x) for x in _mixer_products(blk))
            if blk.kind == "attention":
                a = blk.self_attn
                q_norm, k_norm = ((self._bf16(a.q_norm.weight), self._bf16(a.k_norm.weight)) if cfg.qk_norm
                                  else (None, None))
                layers[i] = Layer(first, out, gate_up, down, pre_attn, pre_mlp, post_attn, post_mlp, q_norm, k_norm,
                                  a.window, a.rope_table, moe, self._f32(a.sinks) if a.sink else None, 0, a.kv, -1)
            else:  # a recurrent mixer (kernels/csrc/recurrent.c): its weights as the kernels read them
                delta = blk.kind == "delta"
                r = blk.linear_attn if delta else blk.conv
                bias = None if delta or r.conv_bias is None else self._f32(r.conv_bias)
                layers[i] = Layer(first, out, gate_up, down, pre_attn, pre_mlp, post_attn, post_mlp, None, None, 0, -1,
                                  moe, None, 2 if delta else 1, -1, r.state, self._f32(r.conv_weight.t()), bias,
                                  self._f32(-r.A_log.float().exp()) if delta else None,
                                  self._f32(r.dt_bias) if delta else None,
                                  self._bf16(r.norm.weight) if delta else None)
        self.layers = layers
        # a hybrid's recurrent layers (their rings in the HybridCache, read and written by position)
        self.state_layers = cfg.state_layers
        # the positions before a run it reads: the convolution's earlier inputs (a delta-net's state: the last)
        self._back = np.arange(-max(cfg.conv_kernel - 1, 1 if "delta" in (cfg.layer_mixers or ()) else 0), 0)
        self._live: dict[frozenset[int], np.ndarray] = {}  # skip_layers -> the state layers run
        attn = next((blk.self_attn for blk in model.layers if blk.kind == "attention"), None)
        self.inv_freq = model.inv_freq.float().contiguous()
        self.inv_freq_local = None if model.inv_freq_local is None else model.inv_freq_local.float().contiguous()
        self.window = max(cfg.layer_windows or (0,))
        self.struct = Model(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps, layers,
                            self.inv_freq.data_ptr(), self._bf16(model.norm.weight),
                            {"": 0, "head": 1, "full": 2}[cfg.qk_norm],
                            {"gelu_tanh": 1, "swiglu_oai": 2}.get(cfg.activation, 0),
                            cfg.rotary_dim, attn.scale if attn is not None else cfg.head_dim ** -0.5,
                            cfg.residual_scale, model.rope_factor,
                            self.inv_freq_local.data_ptr() if self.inv_freq_local is not None else None,
                            cfg.swiglu_limit, cfg.swiglu_alpha, int(cfg.attn_output_gate), cfg.conv_kernel,
                            cfg.delta_k_heads, cfg.delta_v_heads, cfg.delta_k_dim, cfg.delta_v_dim,
                            attn_softcap=cfg.attn_softcap or 0.0)
        self.work = _Work()
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _moe(self, m: MoE):
        """The kernels' view of an MoE layer (``sd_moe``): the tiled router (the reference's own,
        ``Router.tiles``), each expert's two products, the shared expert and its gate (none: GLM-4.5's), the
        grouped sigmoid router's correction bias (fp32) and groups."""
        cfg, C = m.cfg, m.cfg.hidden_size
        experts = (Mat * (2 * cfg.num_experts))(*[mat(x) for e in m.experts for x in (e.gate_up_proj, e.down_proj)])
        router = m.router.tiles()
        shared, gated = cfg.shared_expert_size, cfg.shared_expert_size and cfg.shared_expert_gate
        s_gu, s_dn, s_gate = Mat(), Mat(), Mat()
        if shared:
            s_gu, s_dn = mat(m.shared_expert.gate_up_proj), mat(m.shared_expert.down_proj)
        if gated:
            sg = m.shared_expert_gate.tiles()
            self._keep.append(sg)
            s_gate = bf16_mat(sg, 1, C, None)
        bias = m.e_score_correction_bias
        st = Moe(cfg.num_experts, cfg.experts_per_tok, {"topk_softmax": 1, "sigmoid_group": 2}.get(cfg.router, 0),
                 int(cfg.norm_topk_prob), cfg.moe_intermediate_size, shared, bf16_mat(router, cfg.num_experts, C, None),
                 self._bf16(m.router.bias) if m.router.bias is not None else None, experts, s_gu, s_dn, s_gate,
                 self._f32(bias) if bias is not None else None, cfg.n_group, cfg.topk_group, cfg.routed_scale,
                 int(bool(shared) and not gated))
        self._keep += [router, experts, st]
        return ctypes.pointer(st)

    def _f32(self, t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _bf16(self, t: torch.Tensor) -> int:
        t = t.detach().to(torch.bfloat16).contiguous()
        self._keep.append(t)
        return t.data_ptr()

    @classmethod
    def build(cls, model: torch.nn.Module) -> "NativeForward | None":
        return None if unsupported(model) else cls(model)

    def _stats(self) -> int | None:
        """``moe_stats``'s address for the call (checked: int64, contiguous, one (E, 3) block per layer)."""
        st = self.moe_stats
        if st is None:
            return None
        cfg = self.model.config
        shape = (cfg.num_hidden_layers, cfg.num_experts, 3)
        if st.dtype != torch.int64 or not st.is_contiguous() or tuple(st.shape) != shape:
            raise ValueError("moe_stats: an int64 tensor (layers, experts, 3), contiguous")
        return st.data_ptr()

    def _rings(self, cache: KVCache, row: torch.Tensor, pos: torch.Tensor, skip_layers: frozenset[int]):
        """A hybrid's state rings for a call over tokens at positions ``pos`` of cache rows ``row`` (M,):
        checks that each run of the call (a row's consecutive positions) finds the entries it reads holding
        their positions (``HybridCache``'s own check and error), and returns the rings' addresses (ctypes
        arrays, one entry per state layer) and what the call writes: (the state layers run, the rows, the
        positions), the last ``slots`` positions of each run, as ``HybridCache.write_state`` records them.
        On numpy views of the small index tensors: a decode step pays tens of microseconds, not hundreds."""
        if not isinstance(cache, HybridCache):
            raise TypeError("native forward: a hybrid model's forward needs its HybridCache (model.new_cache)")
        S, slots = len(self.state_layers), cache.slots
        r, p = row.numpy(), pos.numpy()
        M = len(r)
        cut = np.flatnonzero((r[1:] != r[:-1]) | (p[1:] != p[:-1] + 1)) + 1
        first, ends = np.concatenate(([0], cut)), np.concatenate((cut, [M]))  # each run's first token, its end
        run_rows = r[first]
        if len(run_rows) > 1 and len(np.unique(run_rows)) != len(run_rows):
            raise ValueError("native forward: a row of a hybrid model must come as one run of consecutive positions")
        ins = (ctypes.c_void_p * S)(*[x.data_ptr() for x in cache.inputs])
        sts = (ctypes.c_void_p * S)(*[None if x is None else x.data_ptr() for x in cache.states])
        live = self._live.get(skip_layers)
        if live is None:
            live = np.array([s for s, i in enumerate(self.state_layers) if i not in skip_layers], dtype=np.int64)
            self._live[skip_layers] = live
        if not len(live):
            return ins, sts, None
        held = cache.held.numpy()
        need = p[first][:, None] + self._back  # (runs, back): the positions read
        got = held[live[:, None, None], run_rows[None, :, None], (need % slots)[None]]
        if bool(((got != need) & (need >= 0)).any()):
            for s in live.tolist():
                cache._check(s, torch.from_numpy(run_rows), torch.from_numpy(need))  # raises, saying where
        kept = np.repeat(ends, ends - first) - np.arange(M) <= slots
        return ins, sts, (live, r[kept], p[kept])

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache, *,
                 rows: torch.Tensor | None, cache_pos: torch.Tensor | None, attn_mask: torch.Tensor | None,
                 skip_layers: frozenset[int], hidden_layers: tuple[int, ...],
                 logits_positions: str | torch.Tensor, prompt_chunks: Sequence) -> tuple[torch.Tensor, dict]:
        """``Transformer.forward`` on the native path: returns (the final norm's output of the rows asked
        for, the hidden states asked for)."""
        B, T = tokens.shape
        if self.state_layers and attn_mask is not None:  # as Transformer._context says on the PyTorch path
            raise ValueError("token trees are not supported on hybrid models (their recurrent states follow "
                             "one chain of tokens)")
        cache_pos = input_pos if cache_pos is None else cache_pos
        if rows is None:  # rows 0..B-1, each T times (kept: a decode step builds them every token)
            if (B, T) not in self._rows:
                self._rows[(B, T)] = (torch.arange(B), torch.arange(B).repeat_interleave(T))
            rows, per_token = self._rows[(B, T)]
        else:
            per_token = rows.repeat_interleave(T)
        toks, pos, slots, row = [tokens.reshape(-1)], [input_pos.reshape(-1)], [cache_pos.reshape(-1)], [per_token]
        # every part is mapped before any computes: a windowed group keeps what the earliest part reads
        since = first_slots(rows, cache_pos, prompt_chunks, 0 if attn_mask is None else attn_mask.shape[-1])
        self.model.prepare(cache, rows, cache_pos, attn_mask, since)  # checks the slots (and a tree's mask), maps them
        last = int(cache_pos.max())
        for pc in prompt_chunks:
            p = torch.arange(pc.start, pc.start + len(pc.tokens))
            cache.prepare_writes(torch.tensor([pc.row]), p.view(1, -1), since)
            toks.append(torch.tensor(pc.tokens))
            pos.append(p)
            slots.append(p)
            row.append(torch.full((len(pc.tokens),), pc.row))
        if len(toks) > 1:
            toks, pos, slots, row = (torch.cat(v) for v in (toks, pos, slots, row))
        else:
            toks, pos, slots, row = toks[0], pos[0], slots[0], row[0]
        pos, slots, row = (v if v.dtype == torch.int64 and v.is_contiguous() else v.to(torch.int64).contiguous()
                           for v in (pos, slots, row))
        M = toks.numel()
        rings = self._rings(cache, row, pos, skip_layers) if self.state_layers else None
        L = int(slots.max()) + 1 if prompt_chunks else last + 1
        mask = None
        if attn_mask is not None:
            kv_len = -(-L // KV_BLOCK) * KV_BLOCK
            parts = [attention_mask(cache_pos, attn_mask, kv_len).reshape(B * T, kv_len)]
            if M > B * T:
                keys = torch.arange(kv_len)
                parts.append(keys.view(1, -1) <= slots[B * T:].view(-1, 1))
            mask = torch.cat(parts).contiguous().view(torch.uint8)
            L = kv_len
        mask_win = None
        if self.window:  # the windowed layers' keys: the mask's (or the causal slots') within the window
            base = (mask.view(torch.bool) if mask is not None
                    else torch.arange(L).view(1, -1) <= slots.view(-1, 1))  # (M, L)
            mask_win = (base & (torch.arange(L).view(1, -1) > pos.view(-1, 1) - self.window)).contiguous().view(torch.uint8)
        x = self.model.embed(toks).contiguous()  # (M, C)
        n = self.struct.n_layers
        skip = None
        if skip_layers:
            skip = torch.zeros(n, dtype=torch.uint8)
            skip[list(skip_layers)] = 1
        hidden_bufs = {i: torch.empty_like(x) for i in hidden_layers if i >= 0}
        hidden_ptrs = None
        if hidden_bufs:
            hidden_ptrs = (ctypes.c_void_p * n)(*[hidden_bufs[i].data_ptr() if i in hidden_bufs else None
                                                  for i in range(n)])
        threads = self.lib.sd_num_threads()
        need = self.lib.sd_forward_work_bytes(ctypes.byref(self.struct), M, L, threads)
        work = self.work.get(need)
        kc, vc = cache.k, cache.v
        batch = Batch(M, x.data_ptr(), pos.data_ptr(), slots.data_ptr(), row.data_ptr(),
                      mask.data_ptr() if mask is not None else None, L, kc.data_ptr(), vc.data_ptr(),
                      kc[:1].numel(), cache.table.data_ptr(), cache.table.shape[1], KV_BLOCK.bit_length() - 1,
                      skip.data_ptr() if skip is not None else None,
                      mask_win.data_ptr() if mask_win is not None else None,
                      ctypes.cast(hidden_ptrs, ctypes.c_void_p) if hidden_ptrs is not None else None,
                      work.data_ptr(), work.numel(), self._stats())
        if cache.local is not None:
            lc = cache.local
            batch.kc_win, batch.vc_win, batch.win_stride = lc.k.data_ptr(), lc.v.data_ptr(), lc.k[0].numel()
            batch.table_win, batch.max_blocks_win = lc.table.data_ptr(), lc.table.shape[1]
        elif self.model.config.windowed_layers:
            raise ValueError("a model with windowed layers needs its windowed keys' cache (Transformer.new_cache)")
        if rings is not None:
            batch.ring_in, batch.ring_state, batch.slots = (ctypes.cast(rings[0], _p), ctypes.cast(rings[1], _p),
                                                            cache.slots)
        rc = self.lib.sd_forward(ctypes.byref(self.struct), ctypes.byref(batch))
        if rc == -4:
            raise MemoryError("native forward: out of memory for a thread's scratch (rows widened to fp32)")
        if rc != 0:
            raise RuntimeError(f"native forward failed ({rc})")
        if rings is not None and rings[2] is not None:  # the entries written now hold their positions
            live, wrow, wpos = rings[2]
            cache.held.numpy()[live[:, None], wrow[None], (wpos % cache.slots)[None]] = wpos[None]
        C = x.shape[-1]
        hidden = {i: h[:B * T].view(B, T, C) for i, h in hidden_bufs.items()}
        out = x[:B * T].view(B, T, C)
        if -1 in hidden_layers:
            hidden[-1] = out
        return out, hidden
