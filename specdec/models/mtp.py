"""A model's own multi-token-prediction (MTP) layers (DeepSeek-V3, DeepSeek-AI 2024, section 2.2; GLM-4.5's
``num_nextn_predict_layers``), as transformers' ``MtpModel`` runs them (``modeling_layers.py``).

A checkpoint holds them past its decoder's layers, at ``model.layers.{N + i}`` (N = ``num_hidden_layers``):
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a whole decoder layer (attention with its own
KV cache, and the family's MLP: experts for GLM-4.5, whatever ``first_k_dense_replace`` says). Their
``embed_tokens`` and ``shared_head.head`` copies are left: the target's embedding and LM head serve, as in
transformers. Layer i at entry p reads the hidden state ``h_p`` of the step before it (for layer 0, the
target's last layer after its final norm: transformers' ``hidden_states[-1]``) and the token ``x_{p+1+i}``:

    o_p = post_norm(block(eh_proj([enorm(embed(x_{p+1+i})), hnorm(h_p)])))   at RoPE position p + 1 + i
    logits = lm_head(o_p)                                                    -> token x_{p+2+i}

and ``o_p`` is layer i + 1's ``h_p``. Its keys go to slot p of layer i's cache (position-addressed: a
rejected draft's entries are overwritten by the next pass, nothing is rolled back).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.models.hf import load_state_dict
from specdec.models.linear import Linear
from specdec.models.llama import (Block, ForwardContext, RMSNorm, Transformer, rope_attention_factor,
                                  rope_frequencies)
from specdec.models.masks import attention_mask
from specdec.runtime.kv_cache import KV_BLOCK, KVCache

# an MTP layer's own weights beside its decoder block (the checkpoint's names -> ours)
_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "norm."}
_SHARED = ("embed_tokens.", "shared_head.head.")  # copies of the target's embedding and LM head


def mtp_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The config the MTP layers are built from: the target's, with ``layers`` layers, each with experts
    where the target has any (transformers' ``get_mtp_config``: ``first_k_dense_replace`` 0)."""
    return dataclasses.replace(cfg, num_hidden_layers=layers, moe_layers=None, layer_windows=None, rope_layers=None,
                               mtp_layers=0)


class MtpLayer(nn.Module):
    """enorm, hnorm, eh_proj, the decoder block and its post-norm (the checkpoint's ``shared_head.norm``)."""

    def __init__(self, cfg: ModelConfig, block: Block) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(C, eps), RMSNorm(C, eps), RMSNorm(C, eps)
        self.eh_proj = Linear(2 * C, C)
        self.block = block


class MtpModel(nn.Module):
    """The MTP layers of a target (``load_mtp``); the embedding and LM head stay the target's (the caller's)."""

    def __init__(self, cfg: ModelConfig, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.config = cfg  # mtp_config(target's config)
        self.layers = nn.ModuleList(MtpLayer(cfg, b) for b in blocks)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.rope_factor = rope_attention_factor(cfg)

    def new_cache(self, rows: int, max_len: int, num_blocks: int | None = None) -> KVCache:
        """One cache layer per MTP layer."""
        cfg, w = self.config, self.layers[0].enorm.weight
        return KVCache(len(self.layers), rows, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype=w.dtype,
                       device=w.device, num_blocks=num_blocks)

    def forward(self, layer: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, cache: KVCache, rows: torch.Tensor) -> torch.Tensor:
        """MTP layer ``layer`` over entries ``embeds`` (the tokens' embeddings) and ``hidden`` (the states they
        read), both ``(B, T, C)``, at RoPE ``positions (B, T)``, keys written to ``slots (B, T)`` of cache
        ``rows (B,)``; each entry sees the slots up to its own. Returns the post-normed outputs ``(B, T, C)``
        (the LM head's input, and the next layer's ``hidden``)."""
        m = self.layers[layer]
        x = m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(hidden)], dim=-1))  # (B, T, C)
        return m.norm(m.block(x, self._context(positions, slots, cache, rows), layer))

    def _context(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache, rows: torch.Tensor
                 ) -> ForwardContext:
        """What the block's attention reads (as ``Transformer._context`` makes it for a chain of tokens)."""
        cache.prepare_writes(rows, slots)
        kv_len = min(-(-(int(slots.max()) + 1) // KV_BLOCK) * KV_BLOCK, cache.max_len)  # whole blocks
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # (B, T, rd/2)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B, 1, T, rd)
        cos, sin = angles.cos() * self.rope_factor, angles.sin() * self.rope_factor
        dtype = self.layers[0].enorm.weight.dtype
        return ForwardContext(cache=cache, rows=rows, slots=cache.slot_index(rows, slots, prepare=False),
                              kv_len=kv_len, mask=attention_mask(slots, None, kv_len).unsqueeze(1),
                              rope=[(cos.to(dtype), sin.to(dtype))], pos=positions)


def mtp_layer_count(sd: dict[str, torch.Tensor], n: int) -> int:
    """How many consecutive MTP layers ``layers.{n}.``, ``layers.{n + 1}.`` ... a state dict holds."""
    count = 0
    while f"layers.{n + count}.eh_proj.weight" in sd:
        count += 1
    return count


@torch.no_grad()
def load_mtp(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> MtpModel:
    """The MTP layers of the Hugging Face directory ``path`` whose decoder ``cfg`` describes; one clear
    error when it holds none (or fewer than its config's ``num_nextn_predict_layers``)."""
    from specdec.families import family  # noqa: PLC0415

    path = Path(path)
    where = f"target {str(path)!r}"
    if not path.is_dir():
        raise SpecdecError(f"method 'mtp' reads the MTP layers from a Hugging Face directory; {where} is not one "
                           "(a GGUF file's MTP layers are not read): load the model's directory")
    n = cfg.num_hidden_layers
    sd = load_state_dict(path, dtype, extra_layers=True)
    found = mtp_layer_count(sd, n)
    if found == 0 or found < cfg.mtp_layers:
        said = f"its config.json states {cfg.mtp_layers} (num_nextn_predict_layers) but " if cfg.mtp_layers else ""
        raise SpecdecError(f"{where} has no multi-token-prediction layers: {said}its weights hold no "
                           f"model.layers.{n + found}.eh_proj.weight (a {cfg.architecture} checkpoint with its MTP "
                           "layers stripped?); use a checkpoint that keeps them (GLM-4.5's do), or another method")
    layers = cfg.mtp_layers or found
    mcfg = mtp_config(cfg, layers)
    own: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
    blocks: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        i, rest = int(k.split(".")[1]) - n, k.split(".", 2)[2]
        if not 0 <= i < layers or rest.startswith(_SHARED):
            continue
        t = t.to(device)
        mine = next((ours for theirs, ours in _OWN.items() if rest.startswith(theirs)), None)
        if mine is not None:
            own[i][mine + rest.split(".")[-1]] = t
        else:
            blocks[f"layers.{i}.{rest}"] = t
    # the decoder blocks load as a Transformer of these layers loads its own (q/k/v and gate/up fused,
    # experts renamed): a carrier built on the meta device lends its loader, then its blocks are taken
    with torch.device("meta"):
        carrier = Transformer(mcfg)
    stand_in = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")  # its embedding and head:
    carrier.load_hf_state_dict({**blocks, "embed_tokens.weight": stand_in, "lm_head.weight": stand_in,  # dropped
                                "norm.weight": torch.empty(cfg.hidden_size, dtype=dtype, device="meta")})
    with torch.device("meta"):
        model = MtpModel(mcfg, carrier.layers)  # its own weights: assigned below
    offset = family(cfg.architecture).norm_offset  # Gemma's (1 + w) norms, as the target's loader folds them
    for i, weights in enumerate(own):
        weights = {k: (v.float() + offset).to(v.dtype) if offset and k.endswith("norm.weight") else v
                   for k, v in weights.items()}
        missing, _ = model.layers[i].load_state_dict(weights, strict=False, assign=True)
        missing = [k for k in missing if not k.startswith("block.")]
        if missing:
            raise SpecdecError(f"{where}'s MTP layer {n + i} lacks {', '.join(sorted(missing))}: the checkpoint is "
                               "incomplete; download or convert it again")
    for prm in model.parameters():
        prm.requires_grad_(False)
    model.inv_freq = rope_frequencies(mcfg).to(device)
    return model.eval()
