"""EAGLE-3 heads in vLLM speculators' format: a round trip, and clear errors for broken heads."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.errors import SpecdecError
from specdec.heads.eagle import EagleConfig, EagleHead, init_head
from specdec.heads.speculators import load_head, save_head

VERIFIER = {"name_or_path": "smollm2-135m", "architectures": ["LlamaForCausalLM"]}


def make_head() -> EagleHead:
    c = EagleConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=50, draft_vocab_size=20, aux_layer_ids=(2, 3, 5), target_hidden_size=32,
                    rope_theta=5000.0)
    head = init_head(EagleHead(c), seed=1)
    head.set_vocab(torch.arange(30, 50))
    return head


def test_round_trip(tmp_path):
    head = make_head()
    save_head(tmp_path, head, VERIFIER, dtype=torch.float32, num_speculative_tokens=4)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["speculators_model_type"] == "eagle3" and d["draft_vocab_size"] == 20
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert d["transformer_layer_config"]["vocab_size"] == 50 and d["transformer_layer_config"]["num_hidden_layers"] == 1
    assert d["speculators_config"]["verifier"] == VERIFIER
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "lm_head.weight",
            "d2t", "t2d", "norm.weight", "layers.0.mlp.down_proj.weight"} <= set(sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    back = load_head(tmp_path)
    assert back.config == head.config
    for (k, a), (k2, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert back.config.target_layers == (1, 2, 4)


def test_a_head_with_fc_bias_and_an_embedding_loads(tmp_path):
    head = make_head()
    save_head(tmp_path, head, VERIFIER, dtype=torch.float32)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["fc.bias"] = torch.ones(32)
    sd["embed_tokens.weight"] = torch.zeros(50, 32)
    from safetensors.torch import save_file
    save_file(sd, str(tmp_path / "model.safetensors"))
    back = load_head(tmp_path)
    assert back.fc.bias is not None and torch.equal(back.fc.bias, torch.ones(32))


def test_broken_heads_give_one_clear_error(tmp_path):
    with pytest.raises(SpecdecError, match="not an EAGLE-3 head directory"):
        load_head(tmp_path)
    save_head(tmp_path, make_head(), VERIFIER)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(d | {"speculators_model_type": "eagle"}))
    with pytest.raises(SpecdecError, match="not an EAGLE-3 head"):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecdecError, match="damaged"):
        load_head(tmp_path)
