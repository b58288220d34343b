"""GLM-4.5 (``glm4_moe``) against transformers' own implementation, on a tiny random model built by its
class (tests/glm_util.py: partial RoPE, per-head q/k norms, q/k/v biases, a dense first layer, then experts
behind the grouped sigmoid router with a correction bias, two ungated shared experts, a routed scale), and
its multi-token-prediction layers kept out of the decoder; on the native path too. (The MTP drafter:
tests/proposers/test_mtp.py; GLM-4.5's GGUF files: tests/formats/test_gguf_moe.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import CORPUS
from family_util import assert_greedy_is_generate, teacher_forced_error
from glm_util import GLM_CONFIG, glm_dir
from specdec import LLM, SamplingParams
from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.families import FAMILIES, hf_config
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.models.llama import build_model
from specdec.models.moe import MoE, route

transformers = pytest.importorskip("transformers")
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # 40+ tokens each


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return glm_dir(tmp_path_factory.mktemp("glm4_moe"))


def test_config_reads_glm45s_switches_and_writes_them_back(path):
    """config.json -> ModelConfig (every switch GLM-4.5 sets) -> to_hf -> transformers' Glm4MoeConfig ->
    the same ModelConfig."""
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.router, cfg.n_group, cfg.topk_group, cfg.routed_scale) == (
        "glm4_moe", "sigmoid_group", 4, 2, 2.5)
    assert (cfg.num_experts, cfg.experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 32, True)
    assert (cfg.shared_expert_size, cfg.shared_expert_gate, cfg.moe_layers) == (64, False, (0, 1, 1))
    assert (cfg.qk_norm, cfg.attention_bias, cfg.o_bias, cfg.rotary_dim, cfg.mtp_layers) == ("head", True, False, 8, 1)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    tc = hf_config("glm4_moe", cfg.to_hf())
    assert (tc.first_k_dense_replace, tc.n_shared_experts, tc.num_mtp_layers, tc.use_qk_norm) == (1, 2, 1, True)
    assert tc.rope_parameters["partial_rotary_factor"] == 0.5


def test_teacher_forced_logits_match_transformers(path):
    """fp32 logits of 40 positions (two rows) within 1e-4 of transformers', relative to their scale."""
    assert teacher_forced_error(path) < 1e-4


def test_greedy_tokens_match_transformers_generate(path):
    """specdec's fp32 greedy tokens (LLM API, KV cache and all) equal transformers' generate."""
    assert_greedy_is_generate(path, PROMPTS)


def _their_router(seed: int, **overrides):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    kw = {**GLM_CONFIG, "n_routed_experts": 16, "num_experts_per_tok": 4, **overrides, "vocab_size": 97}
    tc = transformers.AutoConfig.for_model("glm4_moe", **kw)
    theirs = Glm4MoeTopkRouter(tc)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=gen))
        theirs.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.5)
    cfg = ModelConfig.from_hf({**tc.to_dict(), "model_type": "glm4_moe"})
    return theirs, cfg


@pytest.mark.parametrize("groups", [(4, 2), (1, 1), (8, 3)], ids=["4-groups-2-compete", "one-group", "8-groups-3"])
def test_router_matches_transformers_own(groups):
    """Sigmoid scores, the correction bias for choosing only, group-limited top-k, weights from the unbiased
    scores renormalised and scaled: transformers' Glm4MoeTopkRouter's experts and weights on the same logits.
    The bias and the group limit both change some rows' choices (so both are really tested)."""
    theirs, cfg = _their_router(0, n_group=groups[0], topk_group=groups[1])
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    _, w_ref, idx_ref = theirs(x)
    logits = x @ theirs.weight.t()
    idx, w = route(cfg, logits, theirs.e_score_correction_bias)
    order, order_ref = idx.argsort(-1), idx_ref.argsort(-1)  # transformers' top-k is unsorted
    assert torch.equal(idx.gather(1, order), idx_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=1e-6)
    assert torch.all((w.sum(-1) - cfg.routed_scale).abs() < 1e-5)  # renormalised, then scaled
    unbiased = route(cfg, logits)[0].sort(-1).values
    assert not torch.equal(unbiased, idx.sort(-1).values)  # the correction bias moves choices
    if groups[1] < groups[0]:
        ungrouped = route(dataclasses.replace(cfg, n_group=1, topk_group=1), logits, theirs.e_score_correction_bias)[0]
        assert not torch.equal(ungrouped.sort(-1).values, idx.sort(-1).values)  # so does the group limit


def test_router_ties_go_to_the_lower_group_and_expert():
    """Equal scores: the lower group, then the lower expert wins (a stable sort, as the other routers)."""
    _, cfg = _their_router(0, n_group=4, topk_group=2)
    idx, w = route(cfg, torch.zeros(2, 16))
    assert idx.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), cfg.routed_scale / 4))


def test_a_rows_experts_do_not_depend_on_the_other_rows():
    """Batch invariance of the GLM-4.5 MoE layer in bf16 (router, correction bias in fp32, ungated shared
    expert): each row of a block of 9 bit-identical to that row alone."""
    _, cfg = _their_router(0)
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
    moe = moe.to(torch.bfloat16)
    moe.e_score_correction_bias.data = moe.e_score_correction_bias.data.float()
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        block = moe(x)
        for i in range(9):
            assert torch.equal(moe(x[i:i + 1]), block[i:i + 1]), i


def test_the_mtp_layers_are_left_out_of_the_decoder_and_the_bias_stays_fp32(path):
    """The checkpoint's layer 3 (its MTP layer) is not the decoder's: left unread, or read alone with
    extra_layers; the router's correction bias loads in fp32 in a bf16 model."""
    decoder = load_state_dict(path, torch.bfloat16)
    assert not any(k.startswith("layers.3.") for k in decoder)
    assert decoder["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert decoder["layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    extra = load_state_dict(path, torch.float32, extra_layers=True)
    assert extra and all(k.startswith("layers.3.") for k in extra) and "layers.3.eh_proj.weight" in extra
    model = build_model(load_model_config(path), decoder, dtype=torch.bfloat16)
    assert model.layers[1].mlp.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_bf16_runs_natively_and_speculation_is_exact(tmp_path_factory, native_kernels, method):
    """bf16 on the CPU with heads of 32 (16 rotary dimensions): the native forward runs GLM-4.5 (its grouped
    sigmoid router, correction bias and ungated shared experts: kernels/csrc/moe.c); n-gram speculation and
    the model's own MTP layer give plain greedy's tokens, batch 2. (Heads of 16 rotate 8 dimensions, which the
    native forward lacks: said at load, the PyTorch path runs.)"""
    path = glm_dir(tmp_path_factory.mktemp("glm4_moe-native"), mtp_layers=1, predictive=method == "mtp", head_dim=32)
    spec = {"ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4},
            "mtp": {"method": "mtp", "num_speculative_tokens": 2}}[method]
    llm = LLM(model=str(path), dtype="bfloat16", progress=False, speculative_config=spec)
    assert llm.target.model.native is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, num_speculative_tokens=0)]
    outs = llm.generate(PROMPTS, greedy)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_heads_of_16_run_on_the_reference_path_said(path):
    with pytest.warns(UserWarning, match="8 rotary dimensions"):
        llm = LLM(model=str(path), dtype="bfloat16", progress=False)
    assert llm.target.model.native is None


class _Meta:
    """What ``Family.gguf_switches`` reads of a GGUF file (``gguf_file.GGUFMeta``): ``glm4moe.*`` keys, tensors."""

    def __init__(self, layers: int = 3, tensors=("blk.0.attn_norm.weight",), **keys) -> None:
        self.layers, self.tensors, self.keys = layers, set(tensors), keys

    def get(self, key, default=None):
        return self.keys.get(key, default)

    def f32(self, key, default=None):
        return float(self.keys[key]) if key in self.keys else default


def test_glm45_gguf_switches_are_llamacpps_builders():
    """llama.cpp's glm4moe builder, from the metadata (a converted file: tests/formats/test_gguf_moe.py): the
    sigmoid router, its groups (none stated: one), norm and scale (0 or none: 1), the shared experts ungated;
    the MTP layers where the file holds their tensors; another gating function, or a file of the MTP layers
    alone (the converter's --mtp): one clear error each."""
    switches = FAMILIES["glm4_moe"].gguf_switches
    got = switches(_Meta(expert_group_count=4, expert_group_used_count=2, expert_weights_scale=2.5,
                         expert_weights_norm=True, expert_gating_func=2))
    assert got == {"router": "sigmoid_group", "norm_topk_prob": True, "routed_scale": 2.5, "n_group": 4,
                   "topk_group": 2, "shared_expert_gate": False, "mtp_layers": 0}
    got = switches(_Meta(nextn_predict_layers=1, expert_weights_scale=0.0,
                         tensors=("blk.0.attn_norm.weight", "blk.3.nextn.eh_proj.weight")))
    assert (got["n_group"], got["topk_group"], got["routed_scale"], got["norm_topk_prob"], got["mtp_layers"]) == (
        1, 1, 1.0, False, 1)
    with pytest.raises(SpecdecError, match="expert_gating_func 1"):
        switches(_Meta(expert_gating_func=1))
    with pytest.raises(SpecdecError, match="--mtp"):
        switches(_Meta(nextn_predict_layers=1, tensors=("blk.3.nextn.eh_proj.weight",)))
