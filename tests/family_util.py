"""Tiny random-weight models of every family, built by transformers' own classes (the outside reference).

``family_dir(root, name)`` saves one with ``save_pretrained`` beside the suites' tiny BPE tokenizer:
seeded, 4 layers, hidden 64, head size 16, every norm weight and bias moved off its initial value (so
Gemma's zero-initialised ``1 + w`` norms and OLMo's q/k norms are really tested), and a sliding window
of 16 positions where the family has windows (the tests' prompts are longer).
"""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import make_tokenizer

WINDOW = 16
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
_SWA = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]

# family name -> (model_type, the config's own keys beyond _COMMON)
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "llama3.2": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "gemma3": ("gemma3_text", dict(query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=_SWA,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Phi-4-mini's shape of RoPE: LongRoPE on 3/4 of each head (48 of 64 dimensions: 24 factors)
    "phi3": ("phi3", dict(tie_word_embeddings=False, hidden_size=256, head_dim=64, original_max_position_embeddings=128, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.05 * i for i in range(24)], "long_factor": [2.0 + 0.25 * i for i in range(24)],
        "original_max_position_embeddings": 128})),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, rope_theta=2e6)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
                                logits_scaling=8.0)),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0, layer_types=["sliding_attention", "full_attention"] * 2)),
}

# mixture-of-experts families: 8 experts of 32, 2 per token (tests/models/test_moe.py)
_MOE = dict(num_experts_per_tok=2)
MOE_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("qwen3_moe", dict(_MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                    mlp_only_layers=[1])),  # layer 1 a dense MLP
    "qwen2_moe": ("qwen2_moe", dict(_MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                    shared_expert_intermediate_size=64)),
    "mixtral": ("mixtral", dict(_MOE, num_local_experts=8, intermediate_size=32, sliding_window=WINDOW)),
    "olmoe": ("olmoe", dict(_MOE, num_experts=8, intermediate_size=32, norm_topk_prob=False)),
    "gpt_oss": ("gpt_oss", dict(_MOE, num_local_experts=8, intermediate_size=32, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 1.5e5, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})),
}
# hybrid families: recurrent layers beside attention (tests/models/test_hybrid.py)
HYBRID_CONFIGS: dict[str, tuple[str, dict]] = {
    # LFM2: ff size adjusted as LFM2's own (2/3 of 144, rounded up to 32: 96); convolutions of 3 taps with biases
    "lfm2": ("lfm2", dict(intermediate_size=144, block_multiple_of=32, conv_L_cache=3, conv_bias=True,
                          norm_eps=1e-5, layer_types=["conv", "full_attention", "conv", "conv"])),
    # Qwen3.5: three delta-net layers, then attention; 2 key heads serving 4 value heads
    "qwen3_5": ("qwen3_5_text", dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                     linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                      "partial_rotary_factor": 0.25})),
}
_ALL = {**FAMILY_CONFIGS, **MOE_CONFIGS, **HYBRID_CONFIGS}


def family_model(name: str, vocab: int, seed: int = 0, **overrides):
    """transformers' own model of family ``name`` with random weights (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = _ALL[name]
    kw = {**_COMMON, **extra, **overrides, "vocab_size": vocab, "pad_token_id": None, "bos_token_id": None,
          "eos_token_id": None}
    if "layer_types" in kw:  # as many as the layers (a shorter draft model keeps the first ones)
        kw["layer_types"] = kw["layer_types"][:kw["num_hidden_layers"]]
    if model_type == "granite":
        kw.pop("head_dim")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ("norm" in pname or pname.endswith("bias") or pname.endswith("sinks") or pname.endswith("A_log")
                    or pname.endswith("dt_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in pname or "lm_head" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def family_dir(root: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A saved Hugging Face directory (model + tokenizer) of family ``name``; made once per root."""
    out = root / f"{name}-{seed}"
    if (out / "config.json").is_file():
        return out
    tmp = root / f".{name}-{seed}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(tmp)
    family_model(name, vocab, seed, **overrides).save_pretrained(tmp)
    tmp.rename(out)
    return out


def family_config(name: str, vocab: int = 97, **overrides):
    """specdec's ModelConfig of family ``name`` (as read from transformers' config of it), no weights."""
    from transformers import AutoConfig

    from specdec.config import ModelConfig

    model_type, extra = _ALL[name]
    kw = {**_COMMON, **extra, **overrides, "vocab_size": vocab, "pad_token_id": None, "bos_token_id": None,
          "eos_token_id": None}
    if "layer_types" in kw:
        kw["layer_types"] = kw["layer_types"][:kw["num_hidden_layers"]]
    if model_type == "granite":
        kw.pop("head_dim")
    d = AutoConfig.for_model(model_type, **kw).to_dict()
    return ModelConfig.from_hf({**d, "model_type": model_type})


def reference(path):
    """transformers' own model of a saved directory, fp32, eager attention: the outside reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def teacher_forced_error(path, rows: int = 2, length: int = 40) -> float:
    """specdec's fp32 logits of ``rows`` x ``length`` random tokens against transformers', relative to
    their scale (the families' 1e-4 check)."""
    from specdec.formats.hf import load_model_config, load_state_dict
    from specdec.models.llama import build_model

    cfg = load_model_config(path)
    ours = build_model(cfg, load_state_dict(path, torch.float32), dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(path)(tokens).logits
        got = ours(tokens, torch.arange(length).expand(rows, length), ours.new_cache(rows, length + 24)).logits
    return ((got - ref).abs().max() / ref.abs().max()).item()


def assert_greedy_is_generate(path, prompts: list[str], n: int = 16) -> None:
    """specdec's fp32 greedy tokens (the LLM API, KV cache and all) equal transformers' ``generate`` for each
    prompt (each longer than the tests' windows)."""
    from specdec import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", progress=False)
    hf, tok = reference(path), llm.tokenizer
    for prompt in prompts:
        ids = tok.encode(prompt)
        assert len(ids) > WINDOW
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                               pad_token_id=0)[0, len(ids):].tolist()
        got = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert got[0].outputs[0].token_ids == want, prompt
