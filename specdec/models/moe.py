"""Mixture-of-experts MLPs (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss): a router picks ``experts_per_tok``
of ``num_experts`` gated MLPs for each token, and the token's output is their weighted sum.

Routers, as ``ModelConfig.router`` says:

- ``softmax`` (Qwen-MoE, Mixtral, OLMoE): probabilities = softmax(logits) in fp32 over every expert,
  the k largest taken; with ``norm_topk_prob`` divided by their sum.
- ``topk_softmax`` (gpt-oss): the k largest logits (a bias added first), softmax over those k.
- ``sigmoid_group`` (GLM-4.5, DeepSeek-V3's ``noaux_tc``): scores = sigmoid(logits) in fp32; for choosing
  only, a per-expert correction bias is added; the experts form ``n_group`` groups, each scored by the
  sum of its two best, and only the ``topk_group`` best groups compete for the k; the chosen experts'
  weights are their unbiased scores (divided by their sum with ``norm_topk_prob``) times ``routed_scale``.

Ties among equal scores go to the lower expert index (``topk``; the native kernel's rule too). Each chosen expert runs over the rows that chose it, so its weights are read once per
forward however many rows picked it; a row's result is then the sum over its k choices in rank order
(the highest weight first), accumulated in fp32: it depends on that row alone, so the layer is
batch-invariant like the dense MLP. A shared expert adds ``sigmoid(w . x) * mlp(x)`` (Qwen2-MoE), or
``mlp(x)`` whole without ``shared_expert_gate`` (GLM-4.5).
The router's product is the native forward's own where the kernels run (bf16 on the CPU: ``Router``),
so both paths score the experts alike, bit for bit, from the same rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec import kernels
from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.kernels import tiles
from specdec.quant.linear import Linear, matmul, tile_bf16


# weights kept in fp32 whatever the model's dtype (transformers' ``_keep_in_fp32_modules_strict``): GLM-4.5's
# router correction bias is added to sigmoid scores in [0, 1], where bf16's rounding would move the choice
FP32_WEIGHTS = ("e_score_correction_bias",)


def weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight ``name`` loads as in a model of ``dtype`` (``FP32_WEIGHTS`` stay fp32)."""
    return torch.float32 if name.endswith(FP32_WEIGHTS) else dtype


def activate(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's ``act(gate) * up`` for ``cfg.activation``: SwiGLU, GeGLU-tanh (Gemma) or gpt-oss's
    clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    if cfg.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if cfg.activation == "swiglu_oai":
        lim = cfg.swiglu_limit
        gate, up = gate.clamp(max=lim), up.clamp(min=-lim, max=lim)
        return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))
    return F.silu(gate) * up


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))``, gate and up as one product."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.inter = cfg.intermediate_size if size is None else size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(activate(self.cfg, gate, up))


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row, largest first, equal scores in expert order (``torch.topk`` leaves
    ties to its implementation; a stable sort states the rule the native kernel follows too)."""
    top, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return top[..., :k], idx[..., :k]


def route(cfg: ModelConfig, logits: torch.Tensor, correction: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``(N, E)`` -> (expert indices ``(N, k)`` int64, their weights ``(N, k)`` fp32), in
    rank order (see the module's docstring); ``correction (E,)``: the ``sigmoid_group`` router's bias."""
    if cfg.router == "sigmoid_group":
        return route_sigmoid_group(cfg, logits, correction)
    if cfg.router == "topk_softmax":
        top, idx = topk(logits, cfg.experts_per_tok)
        return idx, torch.softmax(top.float(), dim=-1)
    top, idx = topk(torch.softmax(logits.float(), dim=-1), cfg.experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return idx, top


def route_sigmoid_group(cfg: ModelConfig, logits: torch.Tensor, correction: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` for ``sigmoid_group`` (transformers' ``Glm4MoeTopkRouter``), each row on its own."""
    scores = torch.sigmoid(logits.float())  # (N, E)
    choice = scores if correction is None else scores + correction.float()
    N, E = choice.shape
    G = cfg.n_group
    if G > 1 and cfg.topk_group < G:  # only the best groups' experts compete
        group = topk(choice.view(N, G, E // G), 2)[0].sum(-1)  # (N, G) each group's two best
        keep = torch.zeros(N, G, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, topk(group, cfg.topk_group)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    idx = topk(choice, cfg.experts_per_tok)[1]  # (N, k)
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scale


class Router(nn.Module):
    """A small product left unquantized (the router, the shared expert's gate): ``x W^T (+ b)`` with
    rows that do not depend on how many share the call. In bf16 on the CPU with the native kernels built
    it is their tiled product (``tiles()``), the one the native forward runs, so the two paths get the
    same logits bit for bit from the same rows; else ``linear.matmul``. The bias is added in the
    weights' dtype (a rounded add, as the native forward does)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._tiled: tuple[tuple, torch.Tensor] | None = None

    def tiles(self) -> torch.Tensor | None:
        """The weight re-laid for the native product (``linear.tile_bf16``), made on first use and again
        when the weight changes; None where that product does not run (not bf16 on the CPU, an odd
        width, no kernels)."""
        w = self.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[1] % 2 or not w.numel():
            return None
        if kernels.library() is None:
            return None
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version
            version = None
        key = (w.data_ptr(), version, tuple(w.shape))
        if self._tiled is None or self._tiled[0] != key:
            self._tiled = (key, tile_bf16(w.detach()))
        return self._tiled[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiled = self.tiles() if x.dtype == torch.bfloat16 else None
        if tiled is not None:
            n, k = self.weight.shape
            y = tiles.matmul(tiled, n, k, None, x.reshape(-1, k)).view(*x.shape[:-1], n)
        else:
            y = matmul(x, self.weight.t())
        return y if self.bias is None else y + self.bias


class MoE(nn.Module):
    """A router and ``num_experts`` gated MLPs (each an ``MLP``, so quantization and the products'
    layouts treat an expert like any dense layer), plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg.hidden_size, cfg.num_experts, cfg.router_bias)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size, bias=cfg.expert_bias)
                                     for _ in range(cfg.num_experts))
        if cfg.shared_expert_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Router(cfg.hidden_size, 1, False)
        # the sigmoid_group router's bias for choosing (fp32 as loaded: FP32_WEIGHTS)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
                                        if cfg.router == "sigmoid_group" else None)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x (N, C)`` -> their experts and weights (``route``)."""
        return route(self.cfg, self.router(x), self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.select(x)  # (N, k)
        N, k = idx.shape
        ys = torch.zeros(N, k, shape[-1], dtype=torch.float32, device=x.device)
        flat = idx.reshape(-1)
        for e in torch.unique(flat).tolist():  # each chosen expert once, over the rows that chose it
            at = (flat == e).nonzero().squeeze(1)  # positions in (N*k)
            ys.view(N * k, -1)[at] = self.experts[e](x[at // k]).float()
        out = torch.zeros(N, shape[-1], dtype=torch.float32, device=x.device)
        for j in range(k):  # rank order, per row: independent of the other rows
            out += w[:, j:j + 1] * ys[:, j]
        out = out.to(x.dtype)
        if self.cfg.shared_expert_size and self.cfg.shared_expert_gate:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        elif self.cfg.shared_expert_size:
            out = out + self.shared_expert(x)
        return out.reshape(shape)

    def experts_touched(self, x: torch.Tensor) -> int:
        """How many distinct experts rows ``x (..., C)`` route to (the weights a forward reads)."""
        return int(torch.unique(self.select(x.reshape(-1, x.shape[-1]))[0]).numel())


def hf_moe_weights(sd: dict[str, torch.Tensor], p: str, cfg: ModelConfig) -> None:
    """Rename and fuse, in ``sd``, layer prefix ``p``'s expert weights from a Hugging Face checkpoint to
    this module's names: per-expert ``gate_proj``/``up_proj``/``down_proj`` (Qwen-MoE, OLMoE), Mixtral's
    ``block_sparse_moe`` ``w1``/``w3``/``w2``, or stacked 3-D tensors (gpt-oss, with gate and up
    interleaved along the last dimension, and transformers' own fused layout). Each expert's gate and up
    become one ``gate_up_proj`` (gate first) as in the dense MLP. gpt-oss's MXFP4 experts arrive from
    ``hf.load_state_dict`` (``quant/mxfp4.py``) per expert and fused already, beside their stacked biases."""
    out = p + "mlp."
    for src in (p + "mlp.", p + "block_sparse_moe."):
        for name in ("gate", "router"):
            for t in ("weight", "bias"):
                if src + f"{name}.{t}" in sd and not (src == out and name == "router"):
                    sd[out + f"router.{t}"] = sd.pop(src + f"{name}.{t}")
    if out + "gate.e_score_correction_bias" in sd:  # GLM-4.5's router
        sd[out + "e_score_correction_bias"] = sd.pop(out + "gate.e_score_correction_bias")
    src = p + ("block_sparse_moe." if p + "block_sparse_moe.experts.0.w1.weight" in sd else "mlp.")
    names = {"gate": "w1", "up": "w3", "down": "w2"} if src.endswith("block_sparse_moe.") else {
        n: f"{n}_proj" for n in ("gate", "up", "down")}
    if cfg.shared_expert_size:
        for k in [k for k in sd if k.startswith(out + "shared_experts.")]:  # GLM-4.5's name
            sd[out + "shared_expert." + k[len(out + "shared_experts."):]] = sd.pop(k)
        s = out + "shared_expert."
        sd[s + "gate_up_proj.weight"] = torch.cat([sd.pop(s + "gate_proj.weight"), sd.pop(s + "up_proj.weight")])
    stacked = sd.pop(src + "experts.gate_up_proj", None)
    gu_bias, down_bias = sd.pop(src + "experts.gate_up_proj_bias", None), sd.pop(src + "experts.down_proj_bias", None)
    if stacked is not None:  # (E, 2I, C) transformers' layout, or gpt-oss's (E, C, 2I) with gate/up interleaved
        down = sd.pop(src + "experts.down_proj")
        inter = cfg.moe_intermediate_size
        oai = stacked.shape[1] == cfg.hidden_size and stacked.shape[2] == 2 * inter and cfg.activation == "swiglu_oai"
        for e in range(stacked.shape[0]):
            q = f"{out}experts.{e}."
            if oai:
                w = stacked[e].t()
                sd[q + "gate_up_proj.weight"] = torch.cat([w[0::2], w[1::2]]).contiguous()
                sd[q + "down_proj.weight"] = down[e].t().contiguous()
                if gu_bias is not None:
                    sd[q + "gate_up_proj.bias"] = torch.cat([gu_bias[e][0::2], gu_bias[e][1::2]])
            else:
                sd[q + "gate_up_proj.weight"], sd[q + "down_proj.weight"] = stacked[e], down[e]
                if gu_bias is not None:
                    sd[q + "gate_up_proj.bias"] = gu_bias[e]
            if down_bias is not None:
                sd[q + "down_proj.bias"] = down_bias[e]
        return
    if src + "experts.gate_up_proj_blocks" in sd:  # hf.load_state_dict reads them (quant/mxfp4.py)
        raise SpecdecError("MXFP4 expert blocks (gate_up_proj_blocks / _scales) reached the model undecoded: "
                           "read the checkpoint with specdec.formats.hf.load_state_dict, which decodes them")
    for e in range(cfg.num_experts):
        s, q = f"{src}experts.{e}.", f"{out}experts.{e}."
        if q + "gate_up_proj.weight" not in sd:  # (gpt-oss's MXFP4 experts come out of hf.py fused already)
            sd[q + "gate_up_proj.weight"] = torch.cat([sd.pop(s + names["gate"] + ".weight"),
                                                       sd.pop(s + names["up"] + ".weight")])
        if q + "down_proj.weight" not in sd:
            sd[q + "down_proj.weight"] = sd.pop(s + names["down"] + ".weight")
        if gu_bias is not None:  # stacked biases beside per-expert weights: gpt-oss's MXFP4 experts, interleaved
            b = gu_bias[e]
            sd[q + "gate_up_proj.bias"] = torch.cat([b[0::2], b[1::2]]) if cfg.activation == "swiglu_oai" else b
        if down_bias is not None:
            sd[q + "down_proj.bias"] = down_bias[e]
