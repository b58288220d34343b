"""GGUF files -> a Hugging Face-style model directory (config, safetensors, tokenizer).

Every family of ``specdec/families.py``, with the names and metadata llama.cpp's own converter
(``convert_hf_to_gguf.py``) writes: the config from the file's ``{arch}.*`` metadata, which tensors
it holds, and what llama.cpp's builder for the architecture fixes (``Family.gguf_*``); the tensors
renamed to Hugging Face's, Q/K rows un-permuted where the family's converter permutes them, Gemma's
+1 taken out of its norms; float tensors kept in their own type (an f32 file gives the fp32 model it
came from), quantized blocks dequantized to bf16 (``gguf_blocks.py`` keeps the blocks themselves).
Mixture-of-experts files (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss, GLM-4.5): the experts' count, top-k and sizes
from the metadata and tensors, the router's rule from the family's builder (GLM-4.5's grouped sigmoid router:
its groups, weight norm and scale from the metadata, its correction bias ``exp_probs_b``), and each layer's
stacked expert tensors written out one expert at a time under the per-expert names the loader fuses.
Hybrid files (LFM2, Qwen3.5): each layer's mixer as the family's builder reads it (LFM2: no key/value heads
means a short convolution; Qwen3.5: ``attention.recurrent_layers`` or ``full_attention_interval``), the
recurrent tensors under transformers' names, and what the converter changed undone (``undo_conversion``). Qwen3.5's
multi-token-prediction block (the converter's extra blocks past ``block_count - nextn_predict_layers``) is
written under the checkpoint's ``mtp.*`` names, beside the decoder (``mtp_tensor_name``; method mtp loads it);
GLM-4.5's (``glm4moe``: whole decoder layers past the decoder's, with their ``nextn.*`` tensors) under its
checkpoints' ``model.layers.{N + i}.*`` names (``glm_mtp_tensor_name``).

Conversion writes into a temp directory beside the target and renames it at the end, so the
cache holds a complete model directory or none.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.families import family, gguf_family
from specdec.formats import registry
from specdec.formats.gguf_reader import GGUFFile
from specdec.formats.hf import one_line
from specdec.formats.progress import ModelProgress


def convert_gguf(gguf_path: Path, target: Path, *, progress: ModelProgress | None = None) -> Path:
    """Convert a GGUF file into the model directory ``target``, atomically (temp dir + rename)."""
    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader, gguf_path)  # a file that fails these checks shows no progress
    if progress is not None:  # building the tokenizer is conversion too (it was counted as the check)
        progress.phase("convert", 1, "converting")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        registry.remove_stale_temp(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-{target.name}-", dir=target.parent))
    except OSError as e:
        raise SpecdecError(f"could not write to {target.parent} ({e.strerror or e}): free disk space "
                           "or fix permissions (or set SPECDEC_HOME), then try again") from e
    try:
        write_model_files(reader, gguf_path, config, tmp)  # the tokenizer first: it fails fast
        write_safetensors_from_gguf(reader, config, tmp / "model.safetensors", progress)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    except OSError as e:
        raise SpecdecError(f"could not write {target} ({e.strerror or e}): free disk space or fix "
                           "permissions (or set SPECDEC_HOME), then try again") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_model_files(reader, gguf_path: Path, config: ModelConfig, out: Path) -> None:
    """Everything of the model directory but its weights: the tokenizer files (``write_tokenizer_from_gguf``),
    ``config.json`` and ``generation_config.json`` (the config's end-of-sequence ids, which the tokenizer reads)."""
    write_tokenizer_from_gguf(gguf_path, out, _field(reader, "tokenizer.ggml.pre"),
                              model_type=config.to_hf().get("model_type"),
                              tokenizer_model=_field(reader, "tokenizer.ggml.model"), reader=reader)
    hf_config = config.to_hf()
    mtp = int(_field(reader, f"{_field(reader, 'general.architecture')}.nextn_predict_layers", 0) or 0)
    if mtp and family(config.architecture).mtp_layout == "mtp":  # its MTP block, written as mtp.* (mtp_tensor_name)
        hf_config["mtp_num_hidden_layers"] = mtp
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def open_gguf(path: Path) -> GGUFFile:
    """``path``'s metadata and tensors (``gguf_reader.GGUFFile``: what specdec reads of gguf's GGUFReader, in a
    fraction of its time), or a one-line SpecdecError if the file is not a whole GGUF."""
    try:
        reader = GGUFFile(path)
    except (ValueError, struct.error, IndexError, KeyError, TypeError, OverflowError, MemoryError, OSError) as e:
        raise SpecdecError(f"'{path}' is not a valid GGUF file (truncated or corrupt): {one_line(e)}; "
                           "download or copy it again") from e
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


class GGUFMeta:
    """A GGUF file's metadata as llama.cpp's loader reads it: ``{arch}.`` keys, tensor names, and the
    sizes every family's switches start from (``families.Family.gguf_switches`` gets one)."""

    def __init__(self, reader, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensors = {t.name: t for t in reader.tensors}
        # the decoder's layers: llama.cpp counts multi-token-prediction layers (Qwen3.5's nextn) in block_count
        self.layers = int(self.get("block_count")) - int(self.get("nextn_predict_layers", 0) or 0)
        self.hidden = int(self.get("embedding_length"))
        self.heads = int(self.get("attention.head_count"))
        self.head_dim = int(self.get("attention.key_length", self.hidden // self.heads))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``{arch}.{key}`` (``default`` when the file has none)."""
        return _field(self.reader, f"{self.arch}.{key}", default)

    def f32(self, key: str, default: float | None = None) -> float | None:
        v = self.get(key)
        return default if v is None else _f32(v)

    def vector(self, name: str) -> np.ndarray | None:
        """A small tensor (``rope_freqs.weight``, ...) as float64, or None."""
        import gguf

        t = self.tensors.get(name)
        return None if t is None else np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()


def config_from_gguf(reader, path: Path) -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata and tensor shapes, read as llama.cpp's
    loader reads them (``src/llama-model.cpp`` and ``src/models/<arch>.cpp``): what every file states
    (sizes, RoPE, windows, soft-caps, Granite's multipliers), which tensors exist (q/k norms per head or
    whole width, the norms' placement), and what llama.cpp's builder fixes for the family
    (``families.Family.gguf_*``: Gemma's scales and window pattern, SmolLM3's NoPE layers)."""
    arch = _field(reader, "general.architecture")
    try:
        fam = gguf_family(str(arch), int(_field(reader, f"{arch}.expert_count", 0) or 0))
    except SpecdecError as e:
        raise SpecdecError(f"'{path}' holds a {arch!r} model: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors or _field(reader, f"{arch}.block_count") is None:
        raise SpecdecError(f"'{path}' lacks token_embd.weight or {arch}.block_count: it is not a "
                           "complete model file; download or convert it again")
    g = GGUFMeta(reader, arch)
    rope_theta = g.f32("rope.freq_base", 10000.0)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None or not tokens.count():
        raise SpecdecError(f"'{path}' has no tokenizer (tokenizer.ggml.tokens): specdec needs a GGUF "
                           "file with llama.cpp tokenizer metadata, as llama.cpp's converter writes")
    template = _field(reader, "tokenizer.chat_template") or ""
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"),
           _field(reader, "tokenizer.ggml.eom_token_id")]  # (GLM-4.5's <|observation|>: an end of generation too)
    ends = [t for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")  # end-of-turn
            if t in template or t in fam.gguf_eos]
    at = tokens.string_indexes(ends) if ends else {}
    eos += [at.get(t) for t in ends]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    windows = _layer_windows(g, fam)
    if windows and fam.gguf_windowed:  # a llama file that states a window: Mistral's
        fam = family(fam.gguf_windowed)
    rotary = int(g.get("rope.dimension_count", g.head_dim))
    fixed = dict(fam.gguf_switches(g))
    mixers = fixed.get("layer_mixers") or ()
    attn = f"blk.{mixers.index('attention') if 'attention' in mixers else 0}."  # the first attention layer's tensors
    q_norm = tensors.get(attn + "attn_q_norm.weight")
    switches = {
        "qk_norm": "" if q_norm is None else ("head" if int(q_norm.shape[0]) == g.head_dim else "full"),
        # a norm after the MLP makes the one after attention a "post" norm (Gemma's sandwich, OLMo 2's);
        # without one, post_attention_norm is the norm before the MLP (gpt-oss's name for ffn_norm)
        "norm_placement": ("pre" if "blk.0.post_ffw_norm.weight" not in tensors
                           else "sandwich" if "blk.0.attn_norm.weight" in tensors else "post"),
        "layer_windows": windows,
        "rope_local_theta": g.f32("rope.freq_base_swa", fam.gguf_swa_theta),
        "partial_rotary_factor": rotary / g.head_dim if rotary != g.head_dim else 1.0,
        "rope_layers": _rope_layers(g, fam),
        "attn_softcap": g.f32("attn_logit_softcapping"),
        "final_softcap": g.f32("final_logit_softcapping"),
        # Granite's multipliers (llama.cpp's names)
        "embed_scale": g.f32("embedding_scale", 1.0),
        "residual_scale": g.f32("residual_scale", 1.0),
        "attn_scale": g.f32("attention.scale"),
        "logits_scaling": g.f32("logit_scale", 1.0),
        # gpt-oss's: a sink logit per head, a bias on the attention's output
        "attn_sinks": attn + "attn_sinks.weight" in tensors,
        "o_bias": attn + "attn_output.bias" in tensors,
        **_experts(g, path),
    }
    rope_scaling = _rope_scaling(g, rope_theta, rotary, path)
    more_rope = fixed.pop("rope_scaling", None)  # what the family's builder fixes of the scaling the file states
    if rope_scaling and more_rope and more_rope.get("rope_type") == rope_scaling.get("rope_type"):
        rope_scaling = {**rope_scaling, **more_rope}
    switches.update(fixed)
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=g.hidden,
        intermediate_size=int(g.get("feed_forward_length", switches.get("moe_intermediate_size", 0))),
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=_kv_heads(g, path),
        head_dim=g.head_dim,
        rms_norm_eps=g.f32("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(g.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=attn + "attn_q.bias" in tensors or attn + "attn_qkv.bias" in tensors,
        architecture=fam.model_type,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        **switches,
    )


def _kv_heads(g: GGUFMeta, path: Path) -> int:
    """The key/value heads of every attention layer: llama.cpp's ``head_count_kv``, one number or one per layer
    (LFM2's files: 0 on the convolution layers, which its builder reads as recurrent: ``Family.gguf_switches``)."""
    kv = g.get("attention.head_count_kv", g.heads)
    if not isinstance(kv, list):
        return int(kv)
    counts = sorted({int(x) for x in kv[:g.layers]} - {0})
    if len(counts) != 1:
        raise SpecdecError(f"'{path}' states {g.arch}.attention.head_count_kv {kv!r}: specdec needs one number of "
                           "key/value heads for every attention layer")
    return counts[0]


def _experts(g: GGUFMeta, path: Path) -> dict:
    """The mixture-of-experts fields, as llama.cpp's loader reads them: ``expert_count`` experts of which
    ``expert_used_count`` are taken per token; the layers with a router (``ffn_gate_inp``) carry experts
    (the others a dense MLP of ``feed_forward_length``); each expert's size (``expert_feed_forward_length``,
    or ``feed_forward_length`` for Mixtral's llama files) and the shared expert's as their tensors have
    them; router and expert biases (gpt-oss) where the file holds them. How the router's probabilities are
    taken is the family's builder's (``Family.gguf_switches``). None of it for a dense file."""
    n = int(g.get("expert_count", 0) or 0)
    moe = tuple(int(f"blk.{i}.ffn_gate_inp.weight" in g.tensors) for i in range(g.layers))
    if n <= 0 or not any(moe):
        return {}
    used = g.get("expert_used_count")
    used = sorted(set(used)) if isinstance(used, list) else [used]
    if len(used) != 1 or used[0] is None or not 0 < int(used[0]) <= n:
        raise SpecdecError(f"'{path}' states {g.arch}.expert_used_count {g.get('expert_used_count')!r} for "
                           f"{n} experts: specdec needs one number of experts per token for every layer")
    first = moe.index(1)
    blk = f"blk.{first}."
    if blk + "ffn_gate_exps.weight" in g.tensors:
        size = int(g.tensors[blk + "ffn_gate_exps.weight"].shape[1])
    elif blk + "ffn_gate_up_exps.weight" in g.tensors:  # the converter's --fuse-gate-up-exps
        size = int(g.tensors[blk + "ffn_gate_up_exps.weight"].shape[1]) // 2
    else:
        raise SpecdecError(f"'{path}' has a router but no expert weights (ffn_gate_exps or ffn_gate_up_exps) "
                           f"in layer {first}: it is not a complete model file; download or convert it again")
    shared = g.tensors.get(blk + "ffn_up_shexp.weight")
    return {"num_experts": n, "experts_per_tok": int(used[0]), "moe_intermediate_size": size,
            "moe_layers": None if all(moe) else moe,
            "shared_expert_size": 0 if shared is None else int(shared.shape[1]),
            "router_bias": blk + "ffn_gate_inp.bias" in g.tensors,
            "expert_bias": any(f"{blk}ffn_{p}_exps.bias" in g.tensors for p in ("gate", "up", "gate_up", "down"))}


def _layer_windows(g: GGUFMeta, fam) -> tuple[int, ...] | None:
    """Per layer the sliding window, as llama.cpp's ``load_swa_pattern`` reads it: the file's
    ``sliding_window_pattern`` (one flag per layer, or a period n: every n-th layer global), else the
    family's default period (Gemma 3: 6, Gemma 2: 2), else every layer."""
    window = int(g.get("attention.sliding_window", 0) or 0)
    if window <= 0:
        return None
    pattern = g.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        flags = [bool(x) for x in pattern][:g.layers]
    else:
        n = int(pattern) if pattern is not None else fam.gguf_swa_period
        flags = [n == 0 or i % n < n - 1 for i in range(g.layers)]
    wins = tuple(window if f else 0 for f in flags)
    return wins if any(wins) else None


def _rope_layers(g: GGUFMeta, fam) -> tuple[int, ...] | None:
    """Per layer 1 (RoPE) or 0 (none): SmolLM3's every n-th layer without, as llama.cpp hard-codes it."""
    n = fam.gguf_nope_period
    if not n:
        return None
    flags = tuple(int((i + 1) % n != 0) for i in range(g.layers))
    return flags if not all(flags) else None


def _rope_scaling(g: GGUFMeta, theta: float, rotary: int, path: Path) -> dict | None:
    """The RoPE scaling a file states, as a Hugging Face ``rope_scaling`` dict where one matches:
    Llama 3's (``rope_freqs`` factors equal to those of Meta's llama3 settings) round-trips to a config
    transformers reads; other factors are used as given (``{"rope_type": "freqs"}``: inverse frequencies
    divided by them, as llama.cpp does); Phi-3's LongRoPE from its two factor tensors; linear; YaRN."""
    kind = g.get("rope.scaling.type")
    factor = g.f32("rope.scaling.factor")
    freqs = g.vector("rope_freqs.weight")
    if freqs is not None:  # llama 3.1+: per-frequency factors instead of parameters
        scaling = {"rope_type": "llama3", "factor": _f32(freqs.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if np.allclose(_llama3_factors(scaling, theta, rotary), freqs, rtol=1e-5):
            return scaling
        return {"rope_type": "freqs", "factors": [float(x) for x in freqs]}  # the float32 values themselves
    long, short = g.vector("rope_factors_long.weight"), g.vector("rope_factors_short.weight")
    if long is not None and short is not None:  # Phi-3's LongRoPE
        orig = int(g.get("rope.scaling.original_context_length"))
        scaling = {"rope_type": "longrope", "long_factor": [_f32(x) for x in long],
                   "short_factor": [_f32(x) for x in short], "original_max_position_embeddings": orig}
        ctx = int(g.get("context_length", orig))
        default = math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0
        attn = g.f32("rope.scaling.attn_factor", default)
        if abs(attn - default) > 1e-6 * default:  # a factor other than transformers' own
            scaling["attention_factor"] = attn
        return scaling
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": int(g.get("rope.scaling.original_context_length"))}
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if g.get(f"rope.scaling.{key}") is not None:
                scaling[hf] = g.f32(f"rope.scaling.{key}")
        return scaling
    raise SpecdecError(f"'{path}' uses rope scaling {kind!r}, which specdec does not support: use "
                       "a model without it or its Hugging Face directory")


def _llama3_factors(s: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1-style scaling (see convert_hf_to_gguf.py)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out)


_LAYER_NAMES = {  # llama.cpp's tensor roles -> Hugging Face's names (the norms' by placement: Block's docstring)
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixture of experts: the router (Qwen-MoE's and OLMoE's name; the loader takes it for every family), the
    # shared expert and its sigmoid gate (Qwen2-MoE); the experts themselves: _EXPERT_PARTS
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# llama.cpp's stacked experts (GGUF shape (inputs, rows, experts)) -> each expert's tensors, by their rows
_EXPERT_PARTS = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
                 "ffn_gate_up_exps": ("gate_proj", "up_proj")}  # the converter's --fuse-gate-up-exps: gate rows first
# the recurrent layers' tensors (LFM2's short convolution, Qwen3.5's gated delta-net) -> transformers' names; a
# delta-net's attn_qkv is its in_proj_qkv, ssm_a its A_log, ssm_dt.bias its dt_bias (``hf_tensor_name``)
_RECURRENT_NAMES = {
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ssm_conv1d": "linear_attn.conv1d", "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FOLDED = ("rope_freqs", "rope_factors_long", "rope_factors_short")  # read into the config


def hf_tensor_name(gguf_name: str, config: ModelConfig | None = None, fused_up: bool = False) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors folded into the config).

    ``ffn_norm`` is the norm before the MLP: Llama's ``post_attention_layernorm``, Gemma's
    ``pre_feedforward_layernorm`` (``config``'s placement says which); ``fused_up``: the file's
    ``ffn_up`` holds gate and up rows (Phi-3: no ``ffn_gate``), our ``gate_up_proj``.
    """
    m = re.fullmatch(r"blk\.(\d+)\.ssm_a", gguf_name)  # Qwen3.5's -exp(A_log), a tensor without a kind
    if m:
        return f"model.layers.{m.group(1)}.linear_attn.A_log"
    base, _, kind = gguf_name.rpartition(".")
    if base in _FOLDED:
        return None
    arch = config.architecture if config is not None else None
    own = dict(family(arch).gguf_names) if arch is not None else {}  # the family's own (LFM2's final norm)
    if base in own:
        return f"{own[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", base)
    if m:
        role = m.group(2)
        delta = config is not None and config.mixer(int(m.group(1))) == "delta"
        if role == "ssm_dt" and kind == "bias":
            return f"model.layers.{m.group(1)}.linear_attn.dt_bias"
        if role == "exp_probs_b" and kind == "bias":  # GLM-4.5's router's correction bias (a buffer, fp32)
            return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
        if role == "attn_qkv" and delta:
            name = "linear_attn.in_proj_qkv"
        elif role in _RECURRENT_NAMES:
            name = _RECURRENT_NAMES[role]
        elif role == "ffn_norm":
            sandwich = config is not None and config.norm_placement == "sandwich"
            name = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        elif role == "ffn_up" and fused_up:
            name = "mlp.gate_up_proj"
        elif role == "attn_sinks" and kind == "weight":  # gpt-oss: a parameter, not a module's weight
            return f"model.layers.{m.group(1)}.self_attn.sinks"
        else:
            name = _LAYER_NAMES.get(role)
        if name is not None:
            return f"model.layers.{m.group(1)}.{name}.{kind}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    arch = f"a {arch}" if arch is not None else "a"
    raise SpecdecError(f"unexpected tensor {gguf_name!r} in the GGUF file: specdec does not know its role "
                       f"in {arch} decoder (see docs/families.md)")


class TensorRows:
    """Rows ``start:`` of a GGUF tensor's raw blocks as a tensor of GGUF shape ``shape`` (one expert of a stacked
    expert tensor, or its gate or up half): what the writer and the block loader read of a reader tensor
    (``name``, ``tensor_type``, ``shape``, ``data``, ``data_offset``), a view of the file's bytes."""

    def __init__(self, t, start: int, shape: tuple[int, ...]) -> None:
        data = t.data
        flat = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)  # a view: rows of blocks
        rows = math.prod(shape[1:])
        self.data = flat[start] if len(shape) == 1 else flat[start:start + rows]
        self.name = f"{t.name}[rows {start}:{start + max(rows, 1)}]"
        self.tensor_type = t.tensor_type
        self.shape = np.array(shape, dtype=np.int64)
        self.data_offset = int(t.data_offset) + start * flat.shape[1] * flat.dtype.itemsize
        self.n_bytes = self.data.nbytes


# llama.cpp's names of Qwen3.5's MTP block's own tensors (``_QwenMtpMixin``: on its first block, ``blk.{N}``)
_NEXTN_NAMES = {"nextn.eh_proj": "mtp.fc", "nextn.enorm": "mtp.pre_fc_norm_embedding",
                "nextn.hnorm": "mtp.pre_fc_norm_hidden", "nextn.shared_head_norm": "mtp.norm"}


def mtp_tensor_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The Hugging Face name of a tensor of a block past the decoder's: Qwen3.5's MTP block as llama.cpp's converter
    writes it (``_QwenMtpMixin``: ``mtp.layers.{i}.*`` as block ``blk.{N + i}``, ``mtp.fc`` and its norms as that
    block's ``nextn.*``), named as Qwen3.5's checkpoints name it (``mtp.*``: ``heads/mtp.py`` loads it); None for
    what the checkpoints do not hold (``nextn.embed_tokens``, ``nextn.shared_head_head``: copies of the
    embedding and head)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", gguf_name)
    if m is None:
        return None
    i, role, kind = int(m.group(1)) - config.num_hidden_layers, m.group(2), m.group(3)
    if role.startswith("nextn."):
        return f"{_NEXTN_NAMES[role]}.{kind}" if role in _NEXTN_NAMES else None
    # the layer is a full-attention one: named as the decoder's attention layers are
    name = hf_tensor_name(f"blk.0.{role}.{kind}", dataclasses.replace(config, layer_mixers=None))
    return None if name is None else f"mtp.layers.{i}.{name.split('.', 3)[3]}"


# llama.cpp's names of GLM-4.5's MTP layers' own tensors (``Glm4MoeModel``: on each MTP block ``blk.{N + i}``)
_GLM_NEXTN_NAMES = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
                    "nextn.shared_head_norm": "shared_head.norm"}


def glm_mtp_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of an MTP layer's own tensor (``blk.{N + i}.nextn.*``) in a GLM-4.5 file, as
    llama.cpp's converter writes it (``Glm4MoeModel``: the checkpoint's ``model.layers.{N + i}``, whose decoder
    layer's tensors are named as the decoder's are): the checkpoint's name (``heads/mtp.py`` loads it); None for
    ``nextn.embed_tokens`` and ``nextn.shared_head_head``, copies of the embedding and LM head, not read."""
    m = re.fullmatch(r"blk\.(\d+)\.(nextn\.\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in _GLM_NEXTN_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_GLM_NEXTN_NAMES[m.group(2)]}.{m.group(3)}"


def tensor_plan(reader, config: ModelConfig) -> list[tuple[str, Any]]:
    """(Hugging Face name, tensor) of every weight the file holds, in the file's order.

    A stacked expert tensor (``blk.N.ffn_*_exps``) becomes one ``TensorRows`` per expert, named as Qwen-MoE's
    checkpoints name each expert's (``mlp.experts.E.gate_proj.weight``, ...: what the loader fuses as it fuses
    theirs; a fused gate|up tensor is cut into its gate and up rows). Expert biases (gpt-oss) take the names of
    our module's own (``mlp.experts.E.gate_up_proj.bias``: a list of the gate's and the up's rows, joined
    in that order; ``down_proj.bias``), which the loader keeps as they are. The blocks past the decoder's (the
    MTP layers) are Qwen3.5's ``mtp.*`` (``mtp_tensor_name``) or GLM-4.5's ``model.layers.{N + i}.*``: their
    decoder layer's tensors named as the decoder's, their ``nextn.*`` by ``glm_mtp_tensor_name``.
    """
    tensors = {t.name: t for t in reader.tensors}
    fused_up = "blk.0.ffn_up.weight" in tensors and "blk.0.ffn_gate.weight" not in tensors
    plan: list[tuple[str, Any]] = []
    layout = family(config.architecture).mtp_layout
    glm_mtp = layout == "layers" and config.mtp_layers  # decoder layers past the decoder's, named alike
    for t in reader.tensors:
        layer = re.match(r"blk\.(\d+)\.", t.name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers and (not glm_mtp or ".nextn." in t.name):
            # MTP layers' own tensors, written as the checkpoints hold them, for method mtp (Qwen3.5's, GLM-4.5's)
            name = (glm_mtp_tensor_name(t.name) if glm_mtp else
                    mtp_tensor_name(t.name, config) if layout == "mtp" else None)
            if name is not None:
                plan.append((name, t))
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(ffn_\w+_exps)\.(weight|bias)", t.name)
        if m and m.group(2) in _EXPERT_PARTS:
            plan += _expert_plan(t, int(m.group(1)), m.group(2), m.group(3), tensors)
            continue
        name = hf_tensor_name(t.name, config, fused_up)
        if name is None:
            continue
        if name.endswith(".shared_expert_gate.weight") and len(t.shape) == 1:  # llama.cpp's shape {n_embd}
            t = TensorRows(t, 0, (int(t.shape[0]), 1))
        plan.append((name, t))
    return plan


def _expert_plan(t, layer: int, role: str, kind: str, tensors: dict) -> list[tuple[str, Any]]:
    """Stacked expert tensor ``t`` (``blk.{layer}.{role}.{kind}``) as each expert's tensors (``tensor_plan``)."""
    parts, experts = _EXPERT_PARTS[role], int(t.shape[-1])
    at = f"model.layers.{layer}.mlp.experts"
    if kind == "weight":  # GGUF (inputs, rows, experts): expert e's rows e*rows ... (e+1)*rows
        inputs, rows = int(t.shape[0]), int(t.shape[1])
        each = rows // len(parts)
        return [(f"{at}.{e}.{p}.weight", TensorRows(t, e * rows + j * each, (inputs, each)))
                for e in range(experts) for j, p in enumerate(parts)]
    rows = int(t.shape[0])  # a bias: GGUF (rows, experts)
    if role == "ffn_down_exps":
        return [(f"{at}.{e}.down_proj.bias", TensorRows(t, e, (rows,))) for e in range(experts)]
    if role == "ffn_gate_up_exps":
        return [(f"{at}.{e}.gate_up_proj.bias", TensorRows(t, e, (rows,))) for e in range(experts)]
    if role == "ffn_up_exps":  # joined to the gate's, below
        if f"blk.{layer}.ffn_gate_exps.bias" not in tensors:
            raise SpecdecError(f"the GGUF file has {t.name} but not blk.{layer}.ffn_gate_exps.bias: specdec "
                               "takes biases on both or neither of the experts' gate and up products")
        return []
    up = tensors.get(f"blk.{layer}.ffn_up_exps.bias")
    if up is None:
        raise SpecdecError(f"the GGUF file has {t.name} but not blk.{layer}.ffn_up_exps.bias: specdec "
                           "takes biases on both or neither of the experts' gate and up products")
    return [(f"{at}.{e}.gate_up_proj.bias", [TensorRows(t, e, (rows,)), TensorRows(up, e, (int(up.shape[0]),))])
            for e in range(experts)]


def qk_row_order(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The rows of Hugging Face tensor ``name`` (q, k, or fused q|k|v, weight or bias) in the order
    that undoes llama.cpp's Q/K permutation, for the families whose converter permutes
    (``Family.gguf_permuted``); None where nothing moves."""
    if not family(config.architecture).gguf_permuted:
        return None
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    if ".q_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_attention_heads)
    if ".k_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_key_value_heads)
    if ".qkv_proj." in name:
        return np.concatenate([unpermute_qk(np.arange(q), config.num_attention_heads),
                               q + unpermute_qk(np.arange(kv), config.num_key_value_heads),
                               np.arange(q + kv, rows)])
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rope pairs interleaved -> rotate_half halves).

    llama.cpp's converter (``LlamaModel.permute``) stores HF row ``h*d + j*d/2 + i`` of head ``h``
    at row ``h*d + 2*i + j``; this is its exact inverse, for weights ``(n_head*d, in)`` and biases
    ``(n_head*d,)``. Qwen2 files are not permuted.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def v_head_order(n: int, config: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Qwen3.5 value-head reordering over ``n`` rows (or columns) of whole value heads.

    transformers groups the value heads by the key head they share ``[K0 v0..v(r-1), K1 v0.., ...]``; llama.cpp's
    converter (``_LinearAttentionVReorderBase._reorder_v_heads``) stores them tiled ``[v0 of K0, v0 of K1, ...,
    v1 of K0, ...]`` (each head's ``n / heads`` entries kept together): file entry ``(j K + k) d + i`` is
    Hugging Face's ``(k r + j) d + i``. This is its inverse: Hugging Face's entry ``p`` is the file's ``order[p]``."""
    k = config.delta_k_heads
    r = config.delta_v_heads // k
    return np.arange(n).reshape(r, k, n // (r * k)).transpose(1, 0, 2).reshape(-1)


def row_order(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The rows of Hugging Face tensor ``name`` in the file's order that undoes what llama.cpp's converter
    moved: Q/K rows (``qk_row_order``), and Qwen3.5's value heads (``v_head_order``) in a delta-net's
    ``in_proj_qkv`` and convolution (their value rows, after the query and key rows), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias``; None where nothing moves."""
    order = qk_row_order(name, rows, config)
    if order is not None or ".linear_attn." not in name or config.delta_v_heads == config.delta_k_heads:
        return order
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        qk = 2 * config.delta_k_heads * config.delta_k_dim
        return np.concatenate([np.arange(qk), qk + v_head_order(rows - qk, config)])
    if name.endswith((".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return v_head_order(rows, config)
    return None


def column_order(name: str, columns: int, config: ModelConfig) -> np.ndarray | None:
    """The columns (inputs) of Hugging Face tensor ``name`` in the file's order: a Qwen3.5 delta-net's
    ``out_proj`` takes the value heads the converter reordered (``v_head_order``); None for all others."""
    if name.endswith(".linear_attn.out_proj.weight") and config.delta_v_heads != config.delta_k_heads:
        return v_head_order(columns, config)
    return None


def undo_conversion(name: str, shape: list[int], config: ModelConfig):
    """What turns tensor ``name`` of Hugging Face's ``shape`` as the file holds it (float32) back into Hugging
    Face's: rows and columns put back (``row_order``, ``column_order``), Qwen3.5's ``ssm_a = -exp(A_log)`` taken
    back to ``A_log``; None where the file's tensor is Hugging Face's."""
    rows = row_order(name, shape[0], config)
    columns = column_order(name, shape[-1], config) if len(shape) == 2 else None
    a_log = name.endswith(".linear_attn.A_log")
    if rows is None and columns is None and not a_log:
        return None

    def undo(w: np.ndarray) -> np.ndarray:
        w = w if rows is None else w[rows]
        w = w if columns is None else w[:, columns]
        return np.log(-w) if a_log else w
    return undo


_KEPT = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}  # float tensors keep their type exact


def conversion_plan(reader, config: ModelConfig) -> list[tuple[str, list, list[int], str, int]]:
    """(Hugging Face name, the file's tensors joined along its first dimension, Hugging Face shape, safetensors
    dtype, bytes per item) of every weight, in the file's order (``tensor_plan``): float tensors (F32, F16,
    BF16) keep their type, quantized blocks become BF16. From the shapes alone: no page of the file is read."""
    plan = []
    for name, t in tensor_plan(reader, config):
        parts = t if isinstance(t, list) else [t]  # (a reader tensor is a NamedTuple)
        kinds = {p.tensor_type.name for p in parts}
        dtype, size = _KEPT.get(kinds.pop(), ("BF16", 2)) if len(kinds) == 1 else ("BF16", 2)
        shapes = [[int(n) for n in reversed(p.shape.tolist())] for p in parts]
        plan.append((name, parts, [sum(sh[0] for sh in shapes), *shapes[0][1:]], dtype, size))
    return plan


def tensor_chunks(src, name: str, parts: list, shape: list[int], config: ModelConfig,
                  chunk_elements: int = 1 << 22) -> Iterator[np.ndarray]:
    """Tensor ``name`` of ``conversion_plan`` in row chunks (float32, or the file's own float type), read from the
    open file ``src`` with plain reads: what the family's converter moved or changed undone (``undo_conversion``: Q/K rows
    un-permuted, Qwen3.5's value heads put back in transformers' order, its ``-exp(A_log)`` back to ``A_log``),
    and the family's ``norm_offset`` (Gemma's and Qwen3.5's +1, which llama.cpp's converter folds into the
    norms) taken back out: specdec's loader adds it, as it does for a Hugging Face directory."""
    import gguf

    undo = undo_conversion(name, shape, config)
    # (a delta-net's gated norm of its outputs is plain in Qwen3.5 too: the converter adds nothing to it)
    norm = name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")  # (the converter's enorm/hnorm)
    shift = family(config.architecture).norm_offset if norm and ".linear_attn." not in name else 0.0
    if undo is not None:
        (t,) = parts
        data = _read_rows(src, t, 0, _row_layout(t)[0])
        yield undo(np.asarray(gguf.dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape))
        return
    for t in parts:
        n_rows, _ = _row_layout(t)  # shapes only: no page of the memory map is read
        elements = math.prod(int(n) for n in t.shape.tolist()) // n_rows
        rows = max(1, chunk_elements // max(1, elements))
        for r in range(0, n_rows, rows):
            w = gguf.dequantize(_read_rows(src, t, r, min(n_rows, r + rows)), t.tensor_type)
            yield np.asarray(w, dtype=np.float32) - np.float32(shift) if shift else w


def write_safetensors_from_gguf(reader, config: ModelConfig, out: Path, progress: ModelProgress | None = None,
                                chunk_elements: int = 1 << 22) -> None:
    """Dequantize tensor by tensor (big ones row-chunk by row-chunk, ``tensor_chunks``) straight into
    safetensors: float tensors (F32, F16, BF16) in their own type, exact (an f32 file loads in fp32 as its
    source did), quantized blocks as bf16, each tensor as the family's checkpoints hold it (``tensor_chunks``).

    The header is known from the shapes alone, so no more than one tensor is ever in memory (one
    expert's, of a stacked expert tensor: ``tensor_plan``). The blocks are read with plain file reads,
    not through the reader's memory map, whose touched pages would count in the process's resident
    memory until the reader is gone.
    """
    plan = conversion_plan(reader, config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, shape, dtype, size in plan:
        nbytes = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    progress = progress or ModelProgress(out.name, enabled=False)
    progress.phase("convert", offset, "converting")
    with open(out, "wb") as f, open(gguf_path_of(reader), "rb") as src:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, parts, shape, dtype, size in plan:
            for w in tensor_chunks(src, name, parts, shape, config, chunk_elements):
                _write(f, w, dtype)
            progress.advance(size * math.prod(shape))
        if f.tell() != 8 + len(head) + offset:
            raise SpecdecError(f"converting to {out} wrote {f.tell()} bytes instead of "
                               f"{8 + len(head) + offset}: report this as a bug")


def gguf_path_of(reader) -> str:
    """The file a GGUF reader maps."""
    return getattr(reader, "path", None) or reader.data.filename


def _row_layout(t) -> tuple[int, int]:
    """(rows, items per row) of GGUF tensor ``t``'s raw blocks as ``t.data`` lays them out."""
    shape = [int(n) for n in t.data.shape]
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (1, shape[0])


def _read_rows(src, t, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of GGUF tensor ``t``'s raw blocks, read from the open file ``src``."""
    _, row_items = _row_layout(t)
    item = t.data.dtype.itemsize
    src.seek(int(t.data_offset) + start * row_items * item)
    raw = np.frombuffer(src.read((stop - start) * row_items * item), dtype=t.data.dtype)
    return raw.reshape(stop - start, row_items)  # (rows, items): what gguf.dequantize takes


def stored(w: np.ndarray, dtype: str) -> torch.Tensor:
    """``w``'s values as safetensors ``dtype`` holds them (F32, F16 exact for what came from those types; BF16
    rounds): what loading the converted file gives."""
    w = np.ascontiguousarray(w, dtype=np.float16 if dtype == "F16" else np.float32)
    x = torch.from_numpy(w if w.flags.writeable else w.copy())
    return x.to(torch.bfloat16) if dtype not in ("F32", "F16") else x


def _write(f, w: np.ndarray, dtype: str) -> None:
    """``w``'s values as safetensors ``dtype`` (``stored``)."""
    x = stored(w, dtype)
    f.write((x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy().tobytes())


_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2", None)  # Qwen2's regex (or unstated)
# the tokenizer classes with a regex of their own -> the pre-tokenizers (tokenizer.ggml.pre) that are theirs
_OWN_PRE = {"Qwen2Tokenizer": _QWEN2_PRE, "Qwen3_5Tokenizer": ("qwen35", None)}
# tokenizer classes made for one tokenizer.ggml.model (Gemma's sentencepiece: "llama"; None: not stated)
_OWN_MODEL = {"GemmaTokenizer": (None, "llama")}
# pre-tokenizers after which llama.cpp splits every digit alone, and those whose own tokenizer.json has NFC
_DIGITS_ALONE_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_NFC_PRE = ("qwen2",)


def write_tokenizer_from_gguf(gguf_path: Path, out_dir: Path, pre: str | None, model_type: str | None = None,
                              tokenizer_model: str | None = None, reader=None) -> None:
    """Build the fast tokenizer the GGUF metadata describes and save it (chat template included).

    ``model_type`` (the config's, known from our own read of the metadata) picks the tokenizer class
    as AutoTokenizer would from it: told nothing, AutoTokenizer parses the whole GGUF once more with
    gguf's generic reader just to learn the model type (5 s for SmolLM2, 15 s for Qwen2.5's vocabulary:
    most of a first run's wait). The files saved are the same either way
    (tests/formats/test_gguf_reading.py). A class made for another tokenizer than the file states
    (``tokenizer_model``, ``tokenizer.ggml.model``, and ``pre``: Qwen2's or Qwen3.5's regex on a file
    whose pre-tokenizer is not theirs (``_OWN_PRE``), Gemma's sentencepiece class on a byte-level BPE
    vocabulary) is not used: transformers' generic backend then builds what the file states, as llama.cpp
    reads it. A sentencepiece vocabulary's user-defined pieces are all matched whole in the text first
    (``_match_user_defined_whole``; ``reader``: the file's, opened again if not given).
    """
    import transformers
    from tokenizers import normalizers, pre_tokenizers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    # the file alone in a folder (a link): transformers also reads tokenizer files it finds beside a GGUF
    # (another model's tokenizer.model or tokenizer.json next to it would change the tokenizer)
    alone = Path(tempfile.mkdtemp(prefix=".gguf-tokenizer-"))
    name = gguf_path.name
    try:
        os.symlink(gguf_path.resolve(), alone / name)
        where = str(alone)
    except OSError:
        where = str(gguf_path.parent)
    try:
        backend_cls = getattr(transformers, "TokenizersBackend", None)  # transformers 5
        cls_name = TOKENIZER_MAPPING_NAMES.get(model_type)
        if backend_cls is not None and ((cls_name in _OWN_PRE and pre not in _OWN_PRE[cls_name])
                                        or (cls_name in _OWN_MODEL and tokenizer_model not in _OWN_MODEL[cls_name])):
            tok = backend_cls.from_pretrained(where, gguf_file=name)
        elif model_type in TOKENIZER_MAPPING_NAMES:
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name, tokenizer_type=model_type)
        elif model_type is not None and backend_cls is not None:  # AutoTokenizer's choice: no class for the type
            tok = backend_cls.from_pretrained(where, gguf_file=name)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise SpecdecError(f"could not build a tokenizer from '{gguf_path}' ({one_line(e)}): the "
                           "file needs llama.cpp tokenizer metadata (tokenizer.ggml.*)") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
        shutil.rmtree(alone, ignore_errors=True)
    backend = tok.backend_tokenizer
    # llama.cpp splits every digit alone before GPT-2's regex for these; transformers' GGUF
    # tokenizer builder does not, so "2024" would be cut differently from the model's training.
    if pre in _DIGITS_ALONE_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _NFC_PRE and backend.normalizer is None:  # Qwen2's own tokenizer.json has NFC
        backend.normalizer = normalizers.NFC()
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for junk in ("is_local", "local_files_only"):
        cfg.pop(junk, None)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if tokenizer_model == "llama":
        _match_user_defined_whole(reader if reader is not None else open_gguf(gguf_path), out_dir / "tokenizer.json")


def _match_user_defined_whole(reader, tokenizer_json: Path) -> None:
    """Make every user-defined piece of a sentencepiece vocabulary (``token_type`` 4) an added token of the
    saved tokenizer, matched whole in the text before any pieces are merged: so llama.cpp
    (``tokenizer_st_partition``, longest first) and sentencepiece itself cut text. transformers' builder adds
    them all but Gemma's runs of spaces, which the file stores as real spaces ("  ") and it respells as
    "\u2581\u2581" in the vocabulary: left to the merges, a run longer than the longest such piece (31 spaces
    in Gemma 3) came out as 16 + 20 where sentencepiece and llama.cpp take 31 + 5. Those are added under
    the vocabulary's spelling, matched in the normalized text (where a space is "\u2581"), so they keep their
    ids and decode through the decoder as every other piece does."""
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    if not tokens or not types:
        return
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab, added = data["model"].get("vocab"), data.get("added_tokens") or []
    if not isinstance(vocab, dict):
        return
    have = {a["id"] for a in added}
    missing = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        spelled = text.replace(" ", "\u2581")
        if kind == 4 and i not in have and spelled != text and vocab.get(spelled) == i:
            missing.append({"id": i, "content": spelled, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": True, "special": False})
    if missing:
        data["added_tokens"] = sorted(added + missing, key=lambda a: a["id"])
        tokenizer_json.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
