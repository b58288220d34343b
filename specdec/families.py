"""The model families specdec runs, each stated as its differences from the Llama block.

A family is data: which Hugging Face ``model_type`` it is, which switches of ``ModelConfig`` it sets
(per-head or whole-width q/k RMSNorm, where the norms sit, Gemma's ``1 + w`` norm folded into the
weights, the MLP's activation, embedding / attention / residual / logit multipliers, soft-capping,
sliding windows per layer with their own RoPE base, partial rotary dimensions, layers without RoPE),
and what llama.cpp calls it in a GGUF file. The math of every switch lives once, in
``models/llama.py`` (the reference) and ``kernels/csrc/forward.c`` (the native twin).

transformers' own configuration classes read a ``config.json`` here (``hf_config``): the defaults a
file leaves out (Gemma 3's window pattern, SmolLM3's NoPE layers, a RoPE dictionary's missing base)
are then exactly the reference implementation's, not a copy of them.

A row maps both ways, so that the code reading and writing files is one generic function each and no
family's name is compared anywhere else: ``config.json`` -> fields (``switches``, through transformers'
class) and fields -> ``config.json`` (``ModelConfig.to_hf``: the keys every family shares, stated as the
row's ``hf_*`` fields say, then the row's ``hf_keys``); GGUF metadata -> fields (``gguf_file.config_from_gguf``,
with the row's ``gguf_*`` fields); the tensor names of both formats (``hf_renames``, ``gguf_names``; the
Llama roles shared by all in ``formats/gguf_file.py``); where the multi-token-prediction layers sit
(``mtp_layout``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class Family:
    """One architecture: its names and how its config sets the model's switches."""

    model_type: str  # Hugging Face config.json's model_type
    hf_class: str  # its *ForCausalLM class (written by to_hf)
    gguf_arch: str  # general.architecture in a GGUF file from llama.cpp's converter
    summary: str  # what differs from Llama, in words (the docs' table)
    switches: Callable[[Any], dict] = field(default=lambda tc: {})  # transformers config -> ModelConfig fields
    gguf_permuted: bool = False  # llama.cpp's converter permutes Q/K rows (LlamaModel and its subclasses)
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's ``x * (1 + w)``)
    # what llama.cpp's builder for ``gguf_arch`` fixes that its files do not state (src/models/<arch>.cpp):
    gguf_switches: Callable[[Any], dict] = field(default=lambda g: {})  # GGUFMeta (formats/gguf_file.py) -> fields
    gguf_swa_period: int = 0  # with a window and no sliding_window_pattern: every n-th layer global (0: none)
    gguf_swa_theta: float | None = None  # the windowed layers' RoPE base when rope.freq_base_swa is absent
    gguf_nope_period: int = 0  # every n-th layer without RoPE (SmolLM3's n_no_rope_layer_step)
    # Hugging Face weight names that differ from Llama's: (a part of the name, Llama's for it), in order
    hf_renames: tuple[tuple[str, str], ...] = ()
    # config.json, read (ModelConfig.from_hf) and written back (ModelConfig.to_hf):
    hf_plain: bool = False  # its keys read as they are, all ModelConfig's own (else through transformers' class)
    hf_qkv_bias: bool = False  # biases on q, k and v that config.json does not state (Qwen2's has no attention_bias)
    hf_head_dim: bool = True  # config.json's head_dim sizes the heads (False: hidden // heads whatever it says)
    hf_layer_types: bool = True  # windows stated by layer_types (False: one sliding_window on every layer, Mistral)
    # how RoPE is written: "rope_scaling" (rope_theta and Llama's rope_scaling), "rope_parameters" (transformers 5's
    # dict, with the partial rotary factor, which the family's class reads), "by_layer_type" (one rope_parameters
    # per layer type, the sliding layers' base rope_local_theta: Gemma 3)
    hf_rope: str = "rope_scaling"
    hf_experts: tuple[str, str] = ("num_experts", "intermediate_size")  # keys of the expert count and each's size
    hf_mixers: tuple[tuple[str, str], ...] = ()  # a hybrid's recurrent mixers -> their layer_types names
    hf_keys: Callable[[Any], dict] = field(default=lambda c: {})  # ModelConfig -> the family's own other keys
    # GGUF files (formats/gguf_file.py):
    gguf_experts: str = ""  # the family a file of gguf_arch is when it holds experts (Mixtral's are llama's)
    gguf_windowed: str = ""  # ... when it states a sliding window (Mistral's are llama's)
    gguf_eos: tuple[str, ...] = ()  # tokens that end a turn even when the chat template names none (Qwen2's)
    gguf_names: tuple[tuple[str, str], ...] = ()  # the file's model-wide tensors of the family's own -> HF's
    # where the checkpoint's multi-token-prediction layers sit (heads/mtp.py): "layers" (decoder layers past the
    # decoder's, model.layers.{N + i}, counted by num_nextn_predict_layers: GLM-4.5), "mtp" (an mtp.* block beside
    # the model, counted by mtp_num_hidden_layers: Qwen3.5), "" (none)
    mtp_layout: str = ""


def _layer_windows(tc: Any) -> tuple[int, ...] | None:
    """Per layer: the sliding window (keys at positions > p - window seen from position p) or 0 (all keys)."""
    window = getattr(tc, "sliding_window", None)
    types = getattr(tc, "layer_types", None)
    if not window:
        return None
    if getattr(tc, "use_sliding_window", True) is False:
        return None
    if types is None:  # Mistral: every layer
        return tuple(int(window) for _ in range(tc.num_hidden_layers))
    wins = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return wins if any(wins) else None


def _rope_dicts(tc: Any) -> tuple[dict, dict | None]:
    """(the global layers' RoPE parameters, the sliding layers' own or None) from a transformers config."""
    rp = dict(getattr(tc, "rope_parameters", None) or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        return dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {}) or None
    return rp, None


def _qwen3(tc: Any) -> dict:
    return {"qk_norm": "head", "layer_windows": _layer_windows(tc)}


def _gemma3(tc: Any) -> dict:
    _, local = _rope_dicts(tc)
    return {"qk_norm": "head", "norm_placement": "sandwich", "activation": "gelu_tanh",
            "embed_scale": math.sqrt(tc.hidden_size), "attn_scale": float(tc.query_pre_attn_scalar) ** -0.5,
            "layer_windows": _layer_windows(tc), "rope_local_theta": float((local or {}).get("rope_theta", 10000.0)),
            "final_softcap": getattr(tc, "final_logit_softcapping", None),
            "attn_softcap": getattr(tc, "attn_logit_softcapping", None)}


def _gemma2(tc: Any) -> dict:
    return {"norm_placement": "sandwich", "activation": "gelu_tanh", "embed_scale": math.sqrt(tc.hidden_size),
            "attn_scale": float(tc.query_pre_attn_scalar) ** -0.5, "layer_windows": _layer_windows(tc),
            "final_softcap": getattr(tc, "final_logit_softcapping", None),
            "attn_softcap": getattr(tc, "attn_logit_softcapping", None)}


def _phi3(tc: Any) -> dict:
    full, _ = _rope_dicts(tc)
    prf = full.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 1.0))
    return {"partial_rotary_factor": float(prf or 1.0), "layer_windows": _layer_windows(tc)}


def _smollm3(tc: Any) -> dict:
    nope = tuple(int(x) for x in tc.no_rope_layers)
    return {"rope_layers": nope if not all(nope) else None, "layer_windows": _layer_windows(tc)}


def _olmo2(tc: Any) -> dict:
    return {"qk_norm": "full", "norm_placement": "post", "layer_windows": _layer_windows(tc)}


def _granite(tc: Any) -> dict:
    return {"embed_scale": float(tc.embedding_multiplier), "residual_scale": float(tc.residual_multiplier),
            "attn_scale": float(tc.attention_multiplier), "logits_scaling": float(tc.logits_scaling)}


def _mistral(tc: Any) -> dict:
    return {"layer_windows": _layer_windows(tc)}


def _lfm2(tc: Any) -> dict:
    ff = int(tc.intermediate_size)
    if tc.block_auto_adjust_ff_dim:  # Lfm2MLP's own sizing of block_ff_dim
        ff = int(2 * ff / 3)
        if tc.block_ffn_dim_multiplier is not None:
            ff = int(tc.block_ffn_dim_multiplier * ff)
            ff = tc.block_multiple_of * ((ff + tc.block_multiple_of - 1) // tc.block_multiple_of)
    return {"qk_norm": "head", "rms_norm_eps": float(tc.norm_eps), "intermediate_size": ff,
            "layer_mixers": tuple("conv" if t == "conv" else "attention" for t in tc.layer_types),
            "conv_kernel": int(tc.conv_L_cache), "conv_bias": bool(tc.conv_bias)}


def _qwen3_5(tc: Any) -> dict:
    full, _ = _rope_dicts(tc)
    return {"qk_norm": "head", "attn_output_gate": True,
            "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0) or 1.0),
            "layer_mixers": tuple("delta" if t == "linear_attention" else "attention" for t in tc.layer_types),
            "conv_kernel": int(tc.linear_conv_kernel_dim), "delta_k_heads": int(tc.linear_num_key_heads),
            "delta_v_heads": int(tc.linear_num_value_heads), "delta_k_dim": int(tc.linear_key_head_dim),
            "delta_v_dim": int(tc.linear_value_head_dim)}


def _lfm2_gguf(g: Any) -> dict:
    """llama.cpp's lfm2 builder: a layer without key/value heads (``head_count_kv`` 0 in its per-layer list) is
    a short convolution of ``shortconv.l_cache`` taps; biases where the file holds them (its converter writes
    none: LFM2's checkpoints have none)."""
    kv = g.get("attention.head_count_kv", g.heads)
    kv = [int(x) for x in kv[:g.layers]] if isinstance(kv, list) else [int(kv)] * g.layers
    return {"layer_mixers": tuple("attention" if n else "conv" for n in kv),
            "conv_kernel": int(g.get("shortconv.l_cache")),
            "conv_bias": any(f"blk.{i}.shortconv.in_proj.bias" in g.tensors for i in range(g.layers))}


def _qwen3_5_gguf(g: Any) -> dict:
    """llama.cpp's qwen35 builder: attention's output gated always; the delta-net layers those of
    ``attention.recurrent_layers``, else all but every ``full_attention_interval``-th (default 4); their heads
    and sizes from the ``ssm.*`` keys (value heads ``time_step_rank``, key heads ``group_count``, key size
    ``state_size``, value size ``inner_size`` / value heads)."""
    flags = g.get("attention.recurrent_layers")
    if flags is None:
        n = int(g.get("full_attention_interval", 4) or 4)
        flags = [(i + 1) % n != 0 for i in range(g.layers)]
    hv = int(g.get("ssm.time_step_rank"))
    return {"attn_output_gate": True, "layer_mixers": tuple("delta" if f else "attention" for f in flags[:g.layers]),
            "conv_kernel": int(g.get("ssm.conv_kernel")), "delta_k_heads": int(g.get("ssm.group_count")),
            "delta_v_heads": hv, "delta_k_dim": int(g.get("ssm.state_size")),
            "delta_v_dim": int(g.get("ssm.inner_size")) // hv}


def _moe_layers(tc: Any) -> tuple[int, ...] | None:
    """Qwen2/3-MoE: which layers carry experts (``decoder_sparse_step``, ``mlp_only_layers``); None: all."""
    step, dense = getattr(tc, "decoder_sparse_step", 1) or 1, set(getattr(tc, "mlp_only_layers", None) or ())
    layers = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(tc.num_hidden_layers))
    return None if all(layers) else layers


def _experts(tc: Any, size: int, **kw: Any) -> dict:
    """The mixture-of-experts fields shared by every MoE family (``num_experts`` may be spelled
    ``num_local_experts``: transformers' attribute maps read both)."""
    return {"num_experts": int(tc.num_experts if hasattr(tc, "num_experts") else tc.num_local_experts),
            "experts_per_tok": int(tc.num_experts_per_tok), "moe_intermediate_size": int(size), **kw}


def _qwen3_moe(tc: Any) -> dict:
    return {**_qwen3(tc), **_experts(tc, tc.moe_intermediate_size, norm_topk_prob=bool(tc.norm_topk_prob),
                                      moe_layers=_moe_layers(tc))}


def _qwen2_moe(tc: Any) -> dict:
    return {"layer_windows": _layer_windows(tc), "attention_bias": True,  # on q, k and v, as Qwen2
            **_experts(tc, tc.moe_intermediate_size, norm_topk_prob=bool(tc.norm_topk_prob),
                       moe_layers=_moe_layers(tc), shared_expert_size=int(tc.shared_expert_intermediate_size))}


def _mixtral(tc: Any) -> dict:
    return {"layer_windows": _layer_windows(tc), **_experts(tc, tc.intermediate_size, norm_topk_prob=True)}


def _olmoe(tc: Any) -> dict:
    if getattr(tc, "clip_qkv", None) is not None:
        raise SpecdecError("OLMoE with clip_qkv is not supported (every released OLMoE model leaves it unset)")
    return {"qk_norm": "full", **_experts(tc, tc.intermediate_size, norm_topk_prob=bool(tc.norm_topk_prob))}


def _gpt_oss(tc: Any) -> dict:
    return {"layer_windows": _layer_windows(tc), "attn_sinks": True, "o_bias": bool(tc.attention_bias),
            "activation": "swiglu_oai", "swiglu_limit": float(tc.swiglu_limit), "swiglu_alpha": float(tc.swiglu_alpha),
            **_experts(tc, tc.intermediate_size, router="topk_softmax", router_bias=True, expert_bias=True)}


def _glm4_moe(tc: Any) -> dict:
    """GLM-4.5: GQA with biases on q, k, v, partial RoPE, optional per-head q/k norms; the first
    ``first_k_dense_replace`` layers dense, then experts behind DeepSeek-V3's grouped sigmoid router with an
    ungated shared expert; ``num_nextn_predict_layers`` MTP layers after the decoder's (``method: mtp``)."""
    full, _ = _rope_dicts(tc)
    k, n = int(tc.first_k_dense_replace), int(tc.num_hidden_layers)
    return {"qk_norm": "head" if tc.use_qk_norm else "",
            "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0) or 1.0),
            **_experts(tc, tc.moe_intermediate_size, router="sigmoid_group", norm_topk_prob=bool(tc.norm_topk_prob),
                       moe_layers=tuple(int(i >= k) for i in range(n)) if k else None,
                       shared_expert_size=int(tc.moe_intermediate_size * tc.n_shared_experts), shared_expert_gate=False,
                       routed_scale=float(tc.routed_scaling_factor), n_group=int(tc.n_group),
                       topk_group=int(tc.topk_group)),
            "mtp_layers": int(getattr(tc, "num_mtp_layers", 0) or 0)}


def _glm4_moe_gguf(g: Any) -> dict:
    """llama.cpp's glm4moe builder: the experts behind the sigmoid router (``expert_gating_func`` 2, its default)
    with the correction bias (``exp_probs_b``, a tensor) and the groups the file states (``expert_group_count``,
    ``expert_group_used_count``; none: one group), the k weights renormalised with ``expert_weights_norm`` and
    times ``expert_weights_scale`` (0: none); the shared experts added ungated; the ``nextn_predict_layers``
    MTP layers past the decoder's where the file holds them (the converter's --no-mtp leaves them out; its
    --mtp writes them alone: no decoder)."""
    gating = int(g.get("expert_gating_func", 0) or 0)
    if gating not in (0, 2):
        raise SpecdecError(f"the GGUF file states glm4moe.expert_gating_func {gating}: specdec runs GLM-4.5's "
                           "sigmoid router (2) only")
    nextn = int(g.get("nextn_predict_layers", 0) or 0)
    if nextn and "blk.0.attn_norm.weight" not in g.tensors:
        raise SpecdecError("the GGUF file holds GLM-4.5's multi-token-prediction layers alone (llama.cpp's converter "
                           "with --mtp), not the model: load the model's own GGUF file (or its Hugging Face directory)")
    groups = max(int(g.get("expert_group_count", 0) or 0), 1)
    scale = g.f32("expert_weights_scale", 0.0)
    return {"router": "sigmoid_group", "norm_topk_prob": bool(g.get("expert_weights_norm", False)),
            "routed_scale": scale if scale else 1.0, "n_group": groups,
            "topk_group": (int(g.get("expert_group_used_count", 0) or 0) or groups) if groups > 1 else 1,
            "shared_expert_gate": False,
            "mtp_layers": nextn if f"blk.{g.layers}.nextn.eh_proj.weight" in g.tensors else 0}


def _gemma_gguf(big_layers: int) -> Callable[[Any], dict]:
    """llama.cpp's Gemma 2 / Gemma 3 builders: GeGLU-tanh, embeddings times sqrt(C), and queries scaled by
    1/sqrt(head_dim), or 1/sqrt(C / heads) for the 27B model (``big_layers`` layers): Google's
    query_pre_attn_scalar, which the files do not carry."""
    def switches(g: Any) -> dict:
        qpas = g.hidden / g.heads if g.layers == big_layers else g.head_dim
        return {"activation": "gelu_tanh", "embed_scale": math.sqrt(g.hidden), "attn_scale": float(qpas) ** -0.5}
    return switches


# the families' own config.json keys, from ModelConfig ``c`` (``Family.hf_keys``: the inverse of their switches
# beyond what ``ModelConfig.to_hf`` writes for every family)
def _gemma_hf(c: Any) -> dict:
    qpas = (c.attn_scale or c.head_dim ** -0.5) ** -2
    return {"hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(qpas) if abs(qpas - round(qpas)) < 1e-6 * qpas else qpas,
            "final_logit_softcapping": c.final_softcap, "attn_logit_softcapping": c.attn_softcap}


def _phi3_hf(c: Any) -> dict:
    d = {"partial_rotary_factor": c.partial_rotary_factor}
    omp = (c.rope_scaling or {}).get("original_max_position_embeddings")
    if omp:  # Phi3Config's own key, which wins over rope_scaling's
        d["original_max_position_embeddings"] = omp
    return d


def _smollm3_hf(c: Any) -> dict:
    return {"no_rope_layers": list(c.rope_layers or [1] * c.num_hidden_layers)}


def _granite_hf(c: Any) -> dict:
    return {"embedding_multiplier": c.embed_scale, "residual_multiplier": c.residual_scale,
            "attention_multiplier": c.attn_scale or c.head_dim ** -0.5, "logits_scaling": c.logits_scaling}


def _lfm2_hf(c: Any) -> dict:
    if not c.layer_mixers:
        return {}
    return {"conv_L_cache": c.conv_kernel, "conv_bias": c.conv_bias, "norm_eps": c.rms_norm_eps,
            "block_auto_adjust_ff_dim": False, "block_ff_dim": c.intermediate_size}


def _qwen3_5_hf(c: Any) -> dict:
    if not c.layer_mixers:
        return {}
    return {"linear_conv_kernel_dim": c.conv_kernel, "linear_num_key_heads": c.delta_k_heads,
            "linear_num_value_heads": c.delta_v_heads, "linear_key_head_dim": c.delta_k_dim,
            "linear_value_head_dim": c.delta_v_dim}


def _qwen_moe_hf(c: Any) -> dict:
    if not c.num_experts:
        return {}
    return {"norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(c.num_hidden_layers) if not c.is_moe(i)]}


def _qwen2_moe_hf(c: Any) -> dict:
    return {**_qwen_moe_hf(c), "shared_expert_intermediate_size": c.shared_expert_size} if c.num_experts else {}


def _olmoe_hf(c: Any) -> dict:
    return {"norm_topk_prob": c.norm_topk_prob} if c.num_experts else {}


def _gpt_oss_hf(c: Any) -> dict:
    return {"swiglu_limit": c.swiglu_limit, "swiglu_alpha": c.swiglu_alpha} if c.num_experts else {}


def _glm4_moe_hf(c: Any) -> dict:
    if not c.num_experts:
        return {}
    dense = [i for i in range(c.num_hidden_layers) if not c.is_moe(i)]
    if dense != list(range(len(dense))):
        raise SpecdecError("glm4_moe's dense layers are its first ones (first_k_dense_replace)")
    return {"norm_topk_prob": c.norm_topk_prob, "routed_scaling_factor": c.routed_scale, "n_group": c.n_group,
            "topk_group": c.topk_group, "first_k_dense_replace": len(dense),
            "n_shared_experts": c.shared_expert_size // c.moe_intermediate_size,
            "num_nextn_predict_layers": c.mtp_layers, "use_qk_norm": c.qk_norm == "head",
            "partial_rotary_factor": c.partial_rotary_factor}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", "the parent: pre-norm blocks, RoPE, GQA, SwiGLU",
           gguf_permuted=True, hf_plain=True, gguf_experts="mixtral", gguf_windowed="mistral"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", "biases on q, k and v", hf_plain=True, hf_qkv_bias=True,
           gguf_eos=("<|endoftext|>",)),
    Family("mistral", "MistralForCausalLM", "llama", "a sliding window on every layer", _mistral, gguf_permuted=True,
           hf_layer_types=False),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", "per-head q/k RMSNorm before RoPE, no q/k/v biases", _qwen3),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3",
           "sandwich norms with (1 + w), per-head q/k norm, GeLU-tanh, embeddings times sqrt(C), "
           "5 sliding-window layers per global one with their own RoPE base, query scale from "
           "query_pre_attn_scalar", _gemma3, norm_offset=1.0, gguf_switches=_gemma_gguf(62), gguf_swa_period=6,
           gguf_swa_theta=10000.0, hf_rope="by_layer_type", hf_keys=_gemma_hf),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2",
           "sandwich norms with (1 + w), GeGLU-tanh, alternating windows, attention and final-logit "
           "soft-capping", _gemma2, norm_offset=1.0, gguf_switches=_gemma_gguf(46), gguf_swa_period=2,
           hf_keys=_gemma_hf),
    Family("phi3", "Phi3ForCausalLM", "phi3", "fused qkv and gate_up weights, partial rotary dimensions, "
           "LongRoPE", _phi3, hf_keys=_phi3_hf),
    Family("smollm3", "SmolLM3ForCausalLM", "smollm3", "every fourth layer without RoPE (NoPE)", _smollm3,
           gguf_permuted=True, gguf_nope_period=4, hf_keys=_smollm3_hf),
    Family("olmo2", "Olmo2ForCausalLM", "olmo2", "norms after attention and MLP (no pre-norm), whole-width "
           "q/k RMSNorm", _olmo2, gguf_swa_period=4),
    Family("granite", "GraniteForCausalLM", "granite", "embedding, attention, residual and logit multipliers",
           _granite, gguf_permuted=True, hf_head_dim=False, hf_keys=_granite_hf),
    Family("lfm2", "Lfm2ForCausalLM", "lfm2", "a hybrid: gated short convolutions (B * x, a depthwise causal "
           "convolution, times C) in place of attention in most layers, per-head q/k RMSNorm", _lfm2,
           hf_renames=(("embedding_norm.", "norm."), (".operator_norm.", ".input_layernorm."),
                       (".ffn_norm.", ".post_attention_layernorm."), (".feed_forward.w1.", ".mlp.gate_proj."),
                       (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
                       (".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."),
                       (".k_layernorm.", ".k_norm."), (".conv.conv.", ".conv.conv_")), gguf_switches=_lfm2_gguf,
           hf_rope="rope_parameters", hf_mixers=(("conv", "conv"),), hf_keys=_lfm2_hf,
           gguf_names=(("token_embd_norm", "model.embedding_norm"),)),  # its final norm (llama.cpp's OUTPUT_NORM_LFM2)
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen35", "a hybrid: three of every four layers gated "
           "delta-nets (a recurrent state per head after a causal convolution), the rest attention with an "
           "output gate and partial RoPE; zero-centred (1 + w) RMSNorms", _qwen3_5, norm_offset=1.0,
           hf_renames=((".linear_attn.conv1d.", ".linear_attn.conv_"),), gguf_switches=_qwen3_5_gguf,
           hf_rope="rope_parameters", hf_mixers=(("delta", "linear_attention"),), hf_keys=_qwen3_5_hf,
           mtp_layout="mtp"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", "Qwen3 with a mixture of experts in place of the "
           "MLP (softmax router, top-k, renormalised)", _qwen3_moe,
           gguf_switches=lambda g: {"norm_topk_prob": True},  # llama.cpp's qwen3moe builder renormalises
           hf_experts=("num_experts", "moe_intermediate_size"), hf_keys=_qwen_moe_hf),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe", "Qwen2 with a mixture of experts plus a shared expert "
           "gated by a sigmoid", _qwen2_moe,
           gguf_switches=lambda g: {"norm_topk_prob": False},  # llama.cpp's qwen2moe builder: not renormalised
           hf_experts=("num_experts", "moe_intermediate_size"), hf_keys=_qwen2_moe_hf),
    Family("mixtral", "MixtralForCausalLM", "llama", "Mistral with 8 experts per layer, 2 taken per token",
           _mixtral, gguf_permuted=True, gguf_switches=lambda g: {"norm_topk_prob": True},  # llama's MoE builder
           hf_experts=("num_local_experts", "intermediate_size")),
    Family("olmoe", "OlmoeForCausalLM", "olmoe", "whole-width q/k RMSNorm, 64 experts, 8 per token, "
           "probabilities not renormalised", _olmoe,
           gguf_switches=lambda g: {"norm_topk_prob": False},  # llama.cpp's olmoe builder: not renormalised
           hf_keys=_olmoe_hf),
    Family("gpt_oss", "GptOssForCausalLM", "gpt-oss", "attention sinks, biases everywhere, alternating windows, "
           "YaRN, experts with a clamped SwiGLU, router bias, softmax over the top-k logits", _gpt_oss,
           # llama.cpp's gpt-oss builder: its SwiGLU constants and softmax over the top-k logits, every second
           # layer global; YaRN as gpt-oss's own (transformers' GptOssConfig): correction range not rounded
           gguf_switches=lambda g: {"activation": "swiglu_oai", "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
                                    "router": "topk_softmax", "rope_scaling": {"rope_type": "yarn", "truncate": False}},
           gguf_swa_period=2, hf_experts=("num_local_experts", "intermediate_size"), hf_keys=_gpt_oss_hf),
    Family("glm4_moe", "Glm4MoeForCausalLM", "glm4moe", "GLM-4.5: biases on q, k and v, partial RoPE, optional "
           "per-head q/k norm, leading dense layers, then experts behind a grouped sigmoid router with a correction "
           "bias and an ungated shared expert; its multi-token-prediction layers draft (method mtp)", _glm4_moe,
           gguf_switches=_glm4_moe_gguf, hf_experts=("n_routed_experts", "moe_intermediate_size"),
           hf_keys=_glm4_moe_hf, mtp_layout="layers"),
)}
ALIASES = {"smollm": "llama", "smollm2": "llama", "gemma3": "gemma3_text"}
# multimodal checkpoints whose language model is a family above: its config is their ``text_config`` and its
# weights sit under ``model.language_model.`` (the vision tower and MTP layers beside it are not read)
WRAPPERS = {"qwen3_5": "qwen3_5_text"}


def text_config(d: dict) -> dict:
    """``config.json``'s dictionary, or a multimodal wrapper's language model's (``WRAPPERS``)."""
    inner = WRAPPERS.get(str(d.get("model_type") or "").lower())
    if inner is None or not isinstance(d.get("text_config"), dict):
        return d
    text = {"tie_word_embeddings": d.get("tie_word_embeddings", False), **d["text_config"], "model_type": inner}
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return text


def family(model_type: str) -> Family:
    """The family of a Hugging Face ``model_type``, or one clear error naming the supported ones."""
    mt = ALIASES.get(model_type, model_type)
    if mt not in FAMILIES:
        raise SpecdecError(f"unsupported model_type {model_type!r}: specdec runs "
                           f"{', '.join(sorted(FAMILIES))} (see docs/families.md)")
    return FAMILIES[mt]


def gguf_family(arch: str, experts: int = 0) -> Family:
    """The family of a GGUF file's ``general.architecture`` and ``{arch}.expert_count`` (``experts``), or one
    clear error naming the supported ones. llama.cpp's converter writes Mistral's and Mixtral's as ``llama``:
    with experts that is Mixtral, else the first family of the name (a window makes it Mistral:
    ``gguf_file.config_from_gguf``)."""
    for f in FAMILIES.values():
        if f.gguf_arch == arch:
            return FAMILIES[f.gguf_experts] if experts > 0 and f.gguf_experts else f
    names = {}
    for f in FAMILIES.values():
        names.setdefault(f.gguf_arch, []).append(f.model_type)
    listed = ", ".join(a if len(ms) == 1 else f"{a} ({' and '.join(ms)})" for a, ms in sorted(names.items()))
    raise SpecdecError(f"unsupported GGUF architecture {arch!r}: specdec runs GGUF files of {listed} "
                       "(see docs/families.md)")


def hf_config(model_type: str, d: dict) -> Any:
    """transformers' configuration object for a ``config.json`` dictionary (its defaults filled in)."""
    from transformers import AutoConfig  # noqa: PLC0415 (config stays import-light until a model loads)

    d = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version", "auto_map", "model_type")}
    from transformers.utils import logging as tf_logging  # noqa: PLC0415

    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()  # its warnings about a tiny test model's token ids are not the user's
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError, KeyError) as e:
        raise SpecdecError(f"config.json of model_type {model_type!r} is not valid: {str(e).splitlines()[0]}") from e
    finally:
        tf_logging.set_verbosity(verbosity)


def switches(model_type: str, d: dict) -> tuple[dict, dict]:
    """(``d`` with transformers' defaults filled in, the ModelConfig fields that ``model_type``'s config
    sets beyond Llama's, with the global layers' RoPE as transformers reads it)."""
    fam = family(model_type)
    tc = hf_config(fam.model_type, d)
    full = {**tc.to_dict(), "model_type": "llama"}
    full.pop("rope_parameters", None)
    out = fam.switches(tc)
    rope, _ = _rope_dicts(tc)
    if "rope_theta" in rope:
        out["rope_theta"] = float(rope["rope_theta"])
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        out["rope_scaling"] = scaling
    return full, {k: v for k, v in out.items() if v is not None}
