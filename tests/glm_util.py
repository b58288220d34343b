"""Tiny random GLM-4.5-style models (``glm4_moe``) built by transformers' own classes, with multi-token-
prediction layers (transformers' ``MtpModel``) saved into the checkpoint as GLM-4.5's are: at
``model.layers.{num_hidden_layers + i}`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of
the embedding and LM head, and a decoder layer with its experts one tensor per expert).

Three layers (one dense, then experts), 8 experts in 4 groups of which 2 compete, 2 per token, two shared
experts, a routed scale of 2.5, per-head q/k norms, biases on q/k/v, RoPE on half of each head; every norm
weight, bias and router correction bias moved off its initial value.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from conftest import make_tokenizer

GLM_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                  moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                  n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                  use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def _perturb(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights, biases and the routers' correction biases off their initial values; routers, embedding and
    head large enough that routing and tokens vary."""
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if "rotary" in name:
                continue
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed" in name or "lm_head" in name or "shared_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def glm_models(vocab: int, seed: int = 0, mtp_layers: int = 1, predictive: bool = False, **overrides):
    """(transformers' Glm4MoeForCausalLM, its MtpModel of ``mtp_layers`` layers), random, fp32, eval;
    ``predictive``: MTP layers whose drafts the target often accepts."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    kw = {**GLM_CONFIG, **overrides, "vocab_size": vocab, "num_nextn_predict_layers": mtp_layers,
          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    cfg = AutoConfig.for_model("glm4_moe", **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    _perturb(model, gen)
    mtp = MtpModel(model, mtp_layers).eval() if mtp_layers else None
    if mtp is not None:
        with torch.no_grad():  # every weight set here (transformers' MtpModel leaves its experts uninitialised)
            for name, t in [*mtp.layers.named_parameters(), *mtp.layers.named_buffers()]:
                if t.dim() >= 2:
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
                else:
                    t.fill_(1.0 if "norm" in name else 0.0)
        _perturb(mtp.layers, gen)
        if predictive:
            # the target's layers are small beside its embeddings, so its next token nearly follows from its
            # last one; an eh_proj passing the token's embedding on (and the target's final norm after it)
            # makes each layer draft that: drafts often accepted, not always
            C = cfg.hidden_size
            with torch.no_grad():
                for layer in mtp.layers:
                    layer.eh_proj.weight.copy_(torch.cat([torch.eye(C), torch.zeros(C, C)], dim=1))
                    layer.enorm.weight.fill_(1.0)
                    layer.post_norm.weight.copy_(model.model.norm.weight)
    return model, mtp


def glm_config(vocab: int = 97, mtp_layers: int = 0, **overrides):
    """specdec's ModelConfig of the tiny GLM-4.5 (as read from transformers' config of it), no weights."""
    from transformers import AutoConfig

    from specdec.config import ModelConfig

    kw = {**GLM_CONFIG, **overrides, "vocab_size": vocab, "num_nextn_predict_layers": mtp_layers,
          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    return ModelConfig.from_hf({**AutoConfig.for_model("glm4_moe", **kw).to_dict(), "model_type": "glm4_moe"})


def checkpoint_mtp_weights(mtp, n: int) -> dict[str, torch.Tensor]:
    """``mtp``'s weights under GLM-4.5's checkpoint names (layer i at ``model.layers.{n + i}``)."""
    out = {}
    for name, t in [*mtp.layers.named_parameters(), *mtp.layers.named_buffers()]:
        i, rest = name.split(".", 1)
        p = f"model.layers.{n + int(i)}."
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):  # (E, 2I, C) -> one gate and one up per expert
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif rest.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[p + rest] = t
    for i in range(len(mtp.layers)):  # GLM-4.5's checkpoints repeat these per MTP layer
        out[f"model.layers.{n + i}.embed_tokens.weight"] = mtp.embed_tokens.weight
        out[f"model.layers.{n + i}.shared_head.head.weight"] = mtp.shared_head.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def glm_dir(root: Path, seed: int = 0, mtp_layers: int = 1, predictive: bool = False, **overrides) -> Path:
    """A saved directory (model + tokenizer) whose ``model.safetensors`` also holds the MTP layers, as
    GLM-4.5's checkpoints do; made once per root."""
    from safetensors.torch import load_file, save_file

    out = root / f"glm4_moe-{seed}-mtp{mtp_layers}{'-predictive' if predictive else ''}"
    if (out / "config.json").is_file():
        return out
    tmp = root / f".{out.name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(tmp)
    model, mtp = glm_models(vocab, seed, mtp_layers, predictive, **overrides)
    model.save_pretrained(tmp)
    if mtp is not None:
        weights = load_file(str(tmp / "model.safetensors"))
        weights.update(checkpoint_mtp_weights(mtp, model.config.num_hidden_layers))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def reference(path: Path, monkeypatch=None):
    """transformers' model of ``path`` (fp32, eager); with ``monkeypatch`` its MTP layers are found at the tiny
    model's layer numbers (transformers looks for GLM-4.5's own, 46 and 92)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

    if monkeypatch is not None:
        n = int(re.search(r'"num_hidden_layers": (\d+)', (path / "config.json").read_text()).group(1))
        monkeypatch.setattr(Glm4MoeForCausalLM, "_keys_to_ignore_on_load_unexpected",
                            [rf"model\.layers\.{n + i}\..*" for i in range(4)])
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
