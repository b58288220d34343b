"""The mixture-of-experts layer (specdec/models/moe.py): its routers against transformers' own, the
grouping of rows by expert, and the batch invariance exact speculation rests on. (Whole models of each
MoE family against transformers: tests/models/test_families.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from family_util import MOE_CONFIGS, family_config
from specdec.models.moe import MoE, route

transformers = pytest.importorskip("transformers")


def test_routers_match_transformers_own():
    """Each family's router (softmax + top-k renormalised or not; gpt-oss's top-k then softmax with a
    bias) picks transformers' experts with transformers' weights, on the same logits."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for name, cls in (("qwen3_moe", Qwen3MoeTopKRouter), ("olmoe", OlmoeTopKRouter), ("gpt_oss", GptOssTopKRouter)):
        cfg = family_config(name)
        tc = transformers.AutoConfig.for_model(MOE_CONFIGS[name][0], **cfg_kwargs(name))
        theirs = cls(tc)
        torch.nn.init.normal_(theirs.weight, generator=torch.Generator().manual_seed(1))
        if getattr(theirs, "bias", None) is not None:
            torch.nn.init.normal_(theirs.bias, generator=torch.Generator().manual_seed(2))
        _, weights, idx = theirs(x)
        logits = x @ theirs.weight.t() + (theirs.bias if getattr(theirs, "bias", None) is not None else 0)
        got_idx, got_w = route(cfg, logits)
        assert torch.equal(got_idx, idx), name
        torch.testing.assert_close(got_w, weights.float(), rtol=1e-6, atol=1e-7)


def cfg_kwargs(name: str) -> dict:
    from family_util import _COMMON  # noqa: PLC2701

    return {**_COMMON, **MOE_CONFIGS[name][1], "vocab_size": 97}


def test_ties_go_to_the_lower_expert():
    """Equal scores: the lower expert index wins (the rule the native kernel follows too)."""
    cfg = family_config("qwen3_moe")
    logits = torch.zeros(3, cfg.num_experts)
    logits[1, 5] = logits[1, 6] = 1.0
    idx, w = route(cfg, logits)
    assert idx[0].tolist() == [0, 1] and idx[1].tolist() == [5, 6]
    assert torch.allclose(w.sum(-1), torch.ones(3))  # Qwen3-MoE renormalises


def layer(name: str, dtype=torch.bfloat16) -> MoE:
    cfg = family_config(name)
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
    return moe.to(dtype)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_a_rows_result_does_not_depend_on_the_other_rows(name):
    """Batch invariance: each row of a block of 9 bit-identical to that row alone, though the block
    routes to many more experts than one row does (exact speculation rests on it)."""
    moe = layer(name)
    x = torch.randn(9, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        block = moe(x)
        for i in range(9):
            assert torch.equal(moe(x[i:i + 1]), block[i:i + 1]), i
    assert moe.experts_touched(x) > moe.experts_touched(x[:1]) == moe.cfg.experts_per_tok


def test_each_chosen_expert_runs_once_over_the_rows_that_chose_it():
    """The products are grouped by expert: a forward of 9 rows calls each chosen expert once (its
    weights read once), with exactly the rows that chose it, and no other expert."""
    moe = layer("olmoe")
    x = torch.randn(9, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    calls: dict[int, int] = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda mod, inp, out, e=e: calls.__setitem__(e, calls.get(e, 0) + inp[0].shape[0]))
    with torch.inference_mode():
        idx, _ = moe.select(x)
        moe(x)
    want = {e: int((idx == e).sum()) for e in torch.unique(idx).tolist()}
    assert calls == want


def test_the_shared_expert_is_added_with_its_gate():
    """Qwen2-MoE: out = experts(x) + sigmoid(g . x) * shared(x), checked against the layer without it."""
    moe = layer("qwen2_moe", torch.float32)
    x = torch.randn(4, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = moe(x)
        shared = torch.sigmoid(x @ moe.shared_expert_gate.weight.t()) * moe.shared_expert(x)
        plain = MoE(dataclasses.replace(moe.cfg, shared_expert_size=0))
        plain.load_state_dict({k: v for k, v in moe.state_dict().items() if "shared" not in k})
        torch.testing.assert_close(full, plain(x) + shared)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_the_config_survives_a_round_trip_through_config_json(name):
    """``to_hf`` writes every expert field back (a GGUF file's converted directory depends on it)."""
    import json

    from specdec.config import ModelConfig

    cfg = family_config(name)
    assert cfg.num_experts == 8 and cfg.experts_per_tok == 2
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_a_dense_draft_of_its_family_and_suffix_lookup_draft_for_an_moe_target(tmp_path):
    """Qwen3-MoE drafted for by a dense Qwen3 (the way Qwen3-0.6B drafts for Qwen3-30B-A3B) and by
    suffix lookup: plain greedy's tokens, batch 2."""
    from family_util import family_dir
    from specdec import LLM, SamplingParams

    target, dense = family_dir(tmp_path, "qwen3_moe"), family_dir(tmp_path, "qwen3", seed=3, num_hidden_layers=1)
    prompts = ["the cat sat on the mat and the cat sat on the", "Hello world, hello"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=str(target), dtype="bfloat16", progress=False)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    for cfg in ({"method": "draft_model", "model": str(dense)}, {"method": "suffix"}):
        spec = LLM(model=str(target), dtype="bfloat16", progress=False,
                   speculative_config=cfg | {"num_speculative_tokens": 3})
        outs = spec.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outs] == plain, cfg["method"]
        if cfg["method"] == "draft_model":
            assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_undecoded_mxfp4_blocks_are_a_clear_error():
    """gpt-oss's MXFP4 experts load through hf.load_state_dict, which decodes them (tests/quant/test_mxfp4.py);
    blocks handed to the layer's renaming undecoded are a clear error naming that, not a KeyError."""
    from specdec.errors import SpecdecError
    from specdec.models.moe import hf_moe_weights

    sd = {"layers.0.mlp.router.weight": torch.zeros(8, 64), "layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1),
          "layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(1)}
    with pytest.raises(SpecdecError, match="MXFP4.*undecoded.*load_state_dict"):
        hf_moe_weights(sd, "layers.0.", family_config("gpt_oss"))
