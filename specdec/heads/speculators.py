"""EAGLE-3 heads on disk in the layout of vLLM's ``speculators`` project (read from its source:
``Eagle3SpeculatorConfig`` and ``Eagle3Speculator``), so a head trained here can be served by vLLM
and a speculators-format head loads here.

A head is a directory with ``config.json``::

    {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
     "transformer_layer_config": {...one Llama decoder layer...}, "draft_vocab_size": N,
     "norm_before_residual": false, "target_hidden_size": C, "eagle_aux_hidden_state_layer_ids": [...],
     "speculators_config": {"algorithm": "eagle3", "proposal_methods": [...],
                            "default_proposal_method": "greedy",
                            "verifier": {"name_or_path": ..., "architectures": [...]}}}

and ``model.safetensors`` with ``fc.weight``, ``layers.0.*``, ``norm.weight``, ``lm_head.weight``,
``d2t`` (draft id -> offset to its target id) and ``t2d`` (target id -> has a draft id). No
``embed_tokens.weight``: the head reads the verifier's embedding (one in the file is ignored).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from specdec.errors import SpecdecError
from specdec.heads.eagle import EagleConfig, EagleHead

WEIGHTS = "model.safetensors"


def config_dict(c: EagleConfig, verifier: dict[str, Any], num_speculative_tokens: int = 5) -> dict[str, Any]:
    """The speculators ``config.json`` of a head."""
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "torch_dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": verifier,
        },
    }


def parse_config(d: dict[str, Any], where: str) -> EagleConfig:
    """EagleConfig from a speculators ``config.json`` dictionary."""
    if d.get("speculators_model_type") != "eagle3":
        raise SpecdecError(f"{where} is not an EAGLE-3 head (speculators_model_type "
                           f"{d.get('speculators_model_type')!r}, want 'eagle3')")
    try:
        t = d["transformer_layer_config"]
        hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        if int(t.get("head_dim") or hidden // heads) * heads != hidden:
            raise SpecdecError(f"{where}: head_dim * num_attention_heads must equal hidden_size")
        aux = d.get("eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise SpecdecError(f"{where} lacks eagle_aux_hidden_state_layer_ids: say which target layers it reads")
        return EagleConfig(
            hidden_size=hidden, intermediate_size=int(t["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads), vocab_size=int(t["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or t["vocab_size"]),
            aux_layer_ids=tuple(int(i) for i in aux),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=float(t.get("rope_theta", 10000.0)),
            max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
            norm_before_residual=bool(d.get("norm_before_residual", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(f"{where} lacks or mangles field {e}: point to a speculators EAGLE-3 head "
                           "directory (config.json + model.safetensors)") from e


def save_head(out_dir: Path | str, head: EagleHead, verifier: dict[str, Any], dtype: torch.dtype = torch.bfloat16,
              num_speculative_tokens: int = 5) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically (a reader never sees half a head)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
          for k, v in head.state_dict().items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    cfg = out / "config.json.tmp"
    cfg.write_text(json.dumps(config_dict(head.config, verifier, num_speculative_tokens), indent=2) + "\n")
    os.replace(cfg, out / "config.json")
    return out


def load_head(path: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> EagleHead:
    """An EagleHead from a speculators EAGLE-3 directory; one clear error for anything missing."""
    from safetensors import safe_open  # noqa: PLC0415

    path = Path(path)
    cfg_path, weights = path / "config.json", path / WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise SpecdecError(f"'{path}' is not an EAGLE-3 head directory (it needs config.json and "
                           f"{WEIGHTS}): train one with `specdec train eagle` or point to a speculators head")
    try:
        d = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise SpecdecError(f"could not read {cfg_path} ({e}): the head is damaged") from e
    c = parse_config(d, str(cfg_path))
    try:
        with safe_open(str(weights), framework="pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys() if k != "embed_tokens.weight"}
    except Exception as e:  # safetensors raises its own error types
        raise SpecdecError(f"could not read {weights} ({str(e).splitlines()[0]}): the head is damaged") from e
    head = EagleHead(c, fc_bias="fc.bias" in sd)
    if "d2t" not in sd:  # a head over the whole vocabulary
        sd["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        sd["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    sd["t2d"] = sd["t2d"].to(torch.bool)
    sd["d2t"] = sd["d2t"].to(torch.long)
    missing, unexpected = head.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SpecdecError(f"{weights} does not match its config.json: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}")
    return head.to(device=device, dtype=dtype).eval()
