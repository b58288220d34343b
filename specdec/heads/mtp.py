"""A model's own multi-token-prediction (MTP) layers (DeepSeek-V3, DeepSeek-AI 2024, section 2.2), in the two
layouts checkpoints keep them in.

GLM-4.5 (``num_nextn_predict_layers``), as transformers' ``MtpModel`` runs them (``modeling_layers.py``): past
the decoder's layers, at ``model.layers.{N + i}`` (N = ``num_hidden_layers``), each with its own ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and a whole decoder layer (attention with its own KV cache, and
the family's MLP: experts for GLM-4.5, whatever ``first_k_dense_replace`` says). Their ``embed_tokens`` and
``shared_head.head`` copies are left: the target's embedding and LM head serve, as in transformers.

Qwen3.5 (``mtp_num_hidden_layers``; Qwen3-Next's layout, a family specdec does not run yet; transformers' models
ignore ``^mtp.*``), as vLLM runs them
(``vllm/model_executor/models/qwen3_5_mtp.py``, ``qwen3_next_mtp.py``: ``Qwen3_5MultiTokenPredictor``): under
``mtp.``, beside the language model (also in a multimodal checkpoint, whose language model sits under
``model.language_model.``): one ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc`` (2C -> C) and
``norm`` for the block, and ``mtp.layers.{i}``, each a full-attention Qwen3.5 decoder layer (gated queries,
per-head q/k norms, partial RoPE, the dense MLP). Every one of these RMSNorms is zero-centred ``(1 + w)``,
like the rest of Qwen3.5: the 1 is folded into the weights at load, as the target's loader folds its own.
They are our enorm, hnorm, eh_proj and post-norm, shared by the layers. A GGUF file of ``qwen35`` holds them
as llama.cpp's converter writes them (one more block ``blk.{N + i}``, ``nextn.*``): its conversion
(``gguf_file``) names them ``mtp.*`` again.

Both compute the same thing. MTP layer i at entry p reads the hidden state ``h_p`` of the step before it (for
layer 0, the target's last layer after its final norm: transformers' ``hidden_states[-1]``, and what vLLM's
Qwen3.5 model returns to its drafter: ``Qwen3NextModel.forward`` ends with ``self.norm``) and the token
``x_{p+1+i}``:

    o_p = post_norm(block(eh_proj([enorm(embed(x_{p+1+i})), hnorm(h_p)])))   at RoPE position p + 1 + i
    logits = lm_head(o_p)                                                    -> token x_{p+2+i}

(the embedding first in the concatenation, in both), and ``o_p`` is layer i + 1's ``h_p``: vLLM's Qwen3.5
predictor also returns its output after ``norm``, and its next draft step reads it (``v1/spec_decode/eagle.py``,
method ``mtp``). (vLLM places entry p at the target's position p rather than p + 1: RoPE scores depend on the
difference of positions only, the same.)
Its keys go to slot p of layer i's cache (position-addressed: a rejected draft's entries are overwritten by
the next pass, nothing is rolled back). Past the layers, the last one runs again on its own output
(``proposers/mtp.py``). Released Qwen3.5 / Qwen3-Next checkpoints have one layer, where this is vLLM's
drafting exactly; with more, vLLM's Qwen predictor takes layer ``step % layers`` for draft step ``step`` on
that chain alone, while here layer i drafts token i + 1 over every entry, DeepSeek-V3's and transformers' way.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.formats.hf import load_state_dict, one_line, read_json
from specdec.quant.linear import Linear
from specdec.models.llama import (Block, ForwardContext, RMSNorm, Transformer, rope_attention_factor,
                                  rope_frequencies)
from specdec.models.masks import attention_mask
from specdec.runtime.kv_cache import KV_BLOCK, KVCache

# an MTP layer's own weights beside its decoder block (the checkpoint's names -> ours): GLM-4.5's per layer,
# Qwen3.5's once under mtp. for all its layers
_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "norm."}
_QWEN_OWN = {"pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "fc.": "eh_proj.", "norm.": "norm."}
_SHARED = ("embed_tokens.", "shared_head.head.")  # copies of the target's embedding and LM head


def mtp_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The config the MTP layers are built from: the target's, with ``layers`` layers, each with experts
    where the target has any (transformers' ``get_mtp_config``: ``first_k_dense_replace`` 0), every one a
    full-attention layer (Qwen3.5's MTP layer, in a hybrid target: vLLM's ``layer_type="full_attention"``)."""
    return dataclasses.replace(cfg, num_hidden_layers=layers, moe_layers=None, layer_windows=None, rope_layers=None,
                               layer_mixers=None, mtp_layers=0)  # a hybrid's (Qwen3.5's): full attention


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
    """How many consecutive GLM-style MTP layers ``layers.{n}.``, ``layers.{n + 1}.`` ... a state dict holds."""
    count = 0
    while f"layers.{n + count}.eh_proj.weight" in sd:
        count += 1
    return count


def qwen_mtp_layer_count(sd: dict[str, torch.Tensor]) -> int:
    """How many consecutive Qwen3.5-style MTP decoder layers ``mtp.layers.0.``, ``mtp.layers.1.`` ... it holds."""
    count = 0
    while any(k.startswith(f"mtp.layers.{count}.") for k in sd):
        count += 1
    return count


def stated_mtp_layers(path: Path, cfg: ModelConfig) -> tuple[int, str]:
    """The MTP layers the checkpoint's config states, and the key that states them: GLM-4.5's
    ``num_nextn_predict_layers`` (``cfg.mtp_layers``), or Qwen3.5's ``mtp_num_hidden_layers`` (in a multimodal
    config, its ``text_config``'s)."""
    if cfg.mtp_layers:
        return cfg.mtp_layers, "num_nextn_predict_layers"
    from specdec.families import text_config  # noqa: PLC0415

    config = path / "config.json"
    d = text_config(read_json(config)) if config.is_file() else {}
    return int(d.get("mtp_num_hidden_layers") or 0), "mtp_num_hidden_layers"


@torch.no_grad()
def load_mtp(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> MtpModel:
    """The MTP layers of the Hugging Face directory ``path`` (a GGUF file's converted one too) whose decoder
    ``cfg`` describes, in either layout (GLM-4.5's ``model.layers.{N + i}``, Qwen3.5's ``mtp.*``); one clear
    error when it holds none, or fewer than its config states."""
    from specdec.families import family  # noqa: PLC0415

    path = Path(path)
    where = f"target {str(path)!r}"
    if not path.is_dir():
        raise SpecdecError(f"method 'mtp' reads the MTP layers from a Hugging Face directory; {where} is not one: "
                           "load the model's directory (or its GGUF file, which specdec converts into one)")
    n = cfg.num_hidden_layers
    sd = load_state_dict(path, dtype, extra_layers=True)
    stated, key = stated_mtp_layers(path, cfg)
    # the layout: the weights' (a checkpoint holding none: its family's)
    qwen = any(k.startswith("mtp.") for k in sd) or (family(cfg.architecture).mtp_layout == "mtp"
                                                      and not mtp_layer_count(sd, n))
    if qwen:
        found = qwen_mtp_layer_count(sd) if "mtp.fc.weight" in sd else 0
        lacking = "mtp.fc.weight" if "mtp.fc.weight" not in sd else f"mtp.layers.{found}.*"
        keep = "Qwen3.5's keep them under mtp.*; a GGUF file of qwen35 keeps them unless converted with --no-mtp"
    else:
        found = mtp_layer_count(sd, n)
        lacking, keep = (f"model.layers.{n + found}.eh_proj.weight",
                         "GLM-4.5's do; a GGUF file of glm4moe keeps them unless converted with --no-mtp")
    if found == 0 or found < stated:
        said = f"its config.json states {stated} ({key}) but " if stated else ""
        from specdec.home import specdec_home  # noqa: PLC0415

        if qwen and path.resolve().parent == (specdec_home() / "models").resolve():  # a converted GGUF file
            keep += (f"; a model specdec converted before it kept them: delete {path} and load the file again "
                     "to convert it anew")
        raise SpecdecError(f"{where} has no multi-token-prediction layers: {said}its weights hold no {lacking} "
                           f"(a {cfg.architecture} checkpoint with its MTP layers stripped?); use a checkpoint that "
                           f"keeps them ({keep}), or another method")
    layers = stated or found
    mcfg = mtp_config(cfg, layers)
    own: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
    blocks: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if qwen:
            if not k.startswith("mtp."):
                continue
            rest = k[len("mtp."):]
            if rest.startswith("layers."):
                i, rest = int(rest.split(".")[1]), rest.split(".", 2)[2]
                if i < layers:
                    blocks[f"layers.{i}.{rest}"] = t.to(device)
                continue
            mine = next((ours for theirs, ours in _QWEN_OWN.items() if rest.startswith(theirs)), None)
            if mine is not None:  # one set for every layer: layer 0's, shared below
                own[0][mine + rest.split(".")[-1]] = t.to(device)
            continue
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
    # experts renamed, Qwen3.5's +1 folded into the block's norms): a carrier built on the meta device lends
    # its loader, then its blocks are taken
    with torch.device("meta"):
        carrier = Transformer(mcfg)
    stand_in = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")  # its embedding and head:
    try:
        carrier.load_hf_state_dict({**blocks, "embed_tokens.weight": stand_in, "lm_head.weight": stand_in,  # dropped
                                    "norm.weight": torch.empty(cfg.hidden_size, dtype=dtype, device="meta")})
    except (KeyError, ValueError) as e:
        raise SpecdecError(f"{where}'s MTP layers do not match its decoder's layers ({one_line(e)}): the "
                           "checkpoint is incomplete or of another model; download or convert it again") from e
    with torch.device("meta"):
        model = MtpModel(mcfg, carrier.layers)  # its own weights: assigned below
    offset = family(cfg.architecture).norm_offset  # Gemma's and Qwen3.5's (1 + w) norms, as the target's are folded
    for i, weights in enumerate(own):
        if qwen and i:  # one enorm, hnorm, eh_proj and post-norm for all the layers: layer 0's
            first = model.layers[0]
            model.layers[i].enorm, model.layers[i].hnorm = first.enorm, first.hnorm
            model.layers[i].eh_proj, model.layers[i].norm = first.eh_proj, first.norm
            continue
        weights = {k: (v.float() + offset).to(v.dtype) if offset and k.endswith("norm.weight") else v
                   for k, v in weights.items()}
        missing, _ = model.layers[i].load_state_dict(weights, strict=False, assign=True)
        missing = [k for k in missing if not k.startswith("block.")]
        if missing:
            names = _QWEN_OWN if qwen else _OWN
            theirs = sorted(next(t for t, o in names.items() if k.startswith(o)) + k.split(".")[-1] for k in missing)
            layer = "block" if qwen else f"layer {n + i}"
            raise SpecdecError(f"{where}'s MTP {layer} lacks {', '.join(('mtp.' if qwen else '') + t for t in theirs)}:"
                               " the checkpoint is incomplete; download or convert it again")
    for prm in model.parameters():
        prm.requires_grad_(False)
    model.inv_freq = rope_frequencies(mcfg).to(device)
    return model.eval()
