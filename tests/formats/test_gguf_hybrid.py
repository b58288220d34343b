"""GGUF files of the hybrid families (LFM2's short convolutions, Qwen3.5's gated delta-nets), written by
llama.cpp's own converter, load in specdec as the Hugging Face directories they came from
(tests/formats/test_gguf_families.py does the same for the dense families; its checks are used here as they are).

The tiny models are transformers' own (``family_util.HYBRID_CONFIGS``), converted to f32 and q8_0 in one
converter process. What the converter writes differently from the directory is undone on load, and checked
here through the directory's weights, logits and tokens: LFM2's per-layer ``head_count_kv`` (0: a convolution
layer) and squeezed convolution; Qwen3.5's layer kinds (``attention.recurrent_layers``), its value heads
reordered (``_LinearAttentionVReorderBase``: 2 key heads serving 4 value heads here, so they move),
``ssm_a = -exp(A_log)``, the +1 folded into every norm but the delta-net's own, the squeezed convolution.

What the converter cannot take, the tiny models leave out: LFM2's convolution biases (it squeezes every
``conv.conv`` tensor at dimension 1, which a bias has not; LFM2's checkpoints have none, nor has llama.cpp's
lfm2), and for Qwen3.5 the MTP layers transformers' model lacks (``--no-mtp``; a file with one, the
converter's default for a real checkpoint, is made from a copy of the directory with an MTP layer added).
Qwen3.5's heads are 32 wide here so that its ``out_proj``, whose input columns the converter reorders by
value head, keeps its q8_0 blocks (whole blocks of 32 inputs move).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import test_gguf_families as dense
from family_util import HYBRID_CONFIGS, family_dir
from llamacpp_util import convert, llamacpp_source
from specdec.config import ModelConfig
from specdec.formats import gguf_file, hub
from specdec.formats.gguf_blocks import gguf_weights
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.models.llama import build_model
from test_gguf_families import home  # noqa: F401  (home: converted models in a throwaway cache)

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("gguf-hybrid")  # one worker: the module's conversions run once
HYBRIDS = list(HYBRID_CONFIGS)
GGUF_OVERRIDES = {  # what llama.cpp's converter cannot take, and heads whose reorder moves whole q8_0 blocks
    "lfm2": dict(conv_bias=False),
    "qwen3_5": dict(linear_key_head_dim=32, linear_value_head_dim=32),
}
CONVERTER_ARGS = {"qwen3_5": ["--no-mtp"]}  # else: "assert self.opt_num_mtp_layers != 0" (no MTP layer to find)
MTP = "qwen3_5+mtp"  # the converter's default file of a checkpoint with an MTP layer: block_count 5, nextn 1


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> {"dir": the HF directory, "f32": its f32 GGUF, "q8_0": its q8_0 GGUF}, all converted at once;
    MTP -> {"dir": Qwen3.5's directory, "f32": the f32 file of its copy with an MTP layer}."""
    src = llamacpp_source()
    root = tmp_path_factory.mktemp("gguf-hybrid")
    out, jobs = {}, []
    # the MTP file first: the converter's --no-mtp sets a flag on its model class, which stays for what follows
    out[MTP] = {"dir": family_dir(root, "qwen3_5", **GGUF_OVERRIDES["qwen3_5"]), "f32": root / "qwen3_5-mtp.f32.gguf"}
    jobs.append((with_mtp_layer(out[MTP]["dir"], root / "qwen3_5-mtp"), "f32", out[MTP]["f32"]))
    for name in HYBRIDS:
        d = family_dir(root, name, **GGUF_OVERRIDES.get(name, {}))
        out[name] = {"dir": d}
        for kind in ("f32", "q8_0"):
            out[name][kind] = root / f"{name}.{kind}.gguf"
            jobs.append((d, kind, out[name][kind], CONVERTER_ARGS.get(name, [])))
    convert(src, jobs, root / "convert.log")
    return out


def with_mtp_layer(model_dir, out):
    """A copy of Qwen3.5 directory ``model_dir`` with one MTP layer, as Qwen3.5's checkpoints hold it
    (``mtp.fc``, its norms, and a full-attention layer: the last layer's weights, under ``mtp.layers.0``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    sd = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    last, hidden = cfg["num_hidden_layers"] - 1, cfg["hidden_size"]
    gen = torch.Generator().manual_seed(7)
    for k in [k for k in sd if k.startswith(f"model.layers.{last}.")]:
        sd["mtp.layers.0." + k.split(".", 3)[3]] = sd[k].clone()
    sd["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{norm}.weight"] = 0.2 * torch.randn(hidden, generator=gen)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg | {"mtp_num_hidden_layers": 1}))
    return out


@pytest.mark.parametrize("name", HYBRIDS)
def test_config_is_the_directorys_and_round_trips(models, name):
    """The config read from the f32 file's metadata is the directory's (layer kinds, convolution width,
    delta-net heads and sizes, output gate, partial RoPE, eps; special token ids aside), and its config.json
    reads back as itself (test_gguf_families' check)."""
    dense.test_config_is_the_directorys_and_round_trips(models, name)
    path = models[name]["f32"]
    got = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert got.state_layers and got.attention_layers  # a hybrid indeed


@pytest.mark.parametrize("name", HYBRIDS)
def test_f32_gguf_gives_the_directorys_weights_tokens_and_logits(models, name):
    """Every weight loaded from the f32 file equals the directory's (to float32's rounding of
    ``log(exp(A_log))``: the rest bit for bit); fp32 teacher-forced logits within 1e-4 of transformers' on
    the directory, and greedy tokens through ``LLM(model=<gguf>)`` equal to its ``generate``
    (test_gguf_families' check)."""
    m = models[name]
    converted = hub.resolve_model(str(m["f32"]), progress=False)
    ours = build_model(load_model_config(converted), load_state_dict(converted, torch.float32), dtype=torch.float32)
    want = build_model(load_model_config(m["dir"]), load_state_dict(m["dir"], torch.float32), dtype=torch.float32)
    want = want.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        if k.endswith(".A_log"):
            torch.testing.assert_close(got[k], w, rtol=1e-6, atol=1e-6, msg=k)
        else:
            assert torch.equal(got[k], w), k
    dense.test_f32_gguf_gives_the_directorys_tokens_and_logits(models, name)


def test_a_qwen3_5_file_with_an_mtp_layer_loads_the_decoder(models):
    """llama.cpp's converter writes a checkpoint's MTP layer as one more block (``block_count`` 5,
    ``nextn_predict_layers`` 1): the file loads as the 4-layer decoder, with the MTP-less file's config and
    weights, bit for bit (the MTP block's tensors left out)."""
    import gguf

    path, plain = models[MTP]["f32"], models["qwen3_5"]["f32"]
    reader = gguf.GGUFReader(str(path))
    assert reader.get_field("qwen35.block_count").contents() == 5
    assert reader.get_field("qwen35.nextn_predict_layers").contents() == 1
    assert any(t.name.startswith("blk.4.nextn.") for t in reader.tensors)
    got = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert got == gguf_file.config_from_gguf(gguf_file.open_gguf(plain), plain)
    sd = load_state_dict(hub.resolve_model(str(path), progress=False), torch.float32)
    want = load_state_dict(hub.resolve_model(str(plain), progress=False), torch.float32)
    assert sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k]) for k in want)


@pytest.mark.parametrize("name", HYBRIDS)
def test_q8_0_blocks_give_the_plain_paths_tokens(models, name):
    """Every product of the q8_0 file keeps its blocks (the recurrent layers' in_proj, a delta-net's four
    input products fused in our order, its out_proj with the value heads' columns put back), bit-exact to
    the bf16 conversion's weights; ``quantization="gguf"`` gives the plain path's tokens on the file, and so
    does n-gram speculation on it (test_gguf_families' checks)."""
    path = models[name]["q8_0"]
    converted = hub.resolve_model(str(path), progress=False)
    cfg = load_model_config(converted)
    model = build_model(cfg, load_state_dict(converted, torch.float32), dtype=torch.float32)
    linears = [n for n, mod in model.named_modules() if type(mod).__name__ == "Linear"]
    kept = gguf_weights(path, cfg, linears)
    mixer = "conv" if name == "lfm2" else "linear_attn"
    for i in cfg.state_layers:
        assert {f"layers.{i}.{mixer}.in_proj", f"layers.{i}.{mixer}.out_proj"} <= set(kept)
    assert sorted(kept) == sorted(linears)
    dense.check_blocks_are_the_files(path)
    dense.check_block_tokens(path)


def test_the_value_head_order_is_the_converters_inverse():
    """``v_head_order`` undoes llama.cpp's ``_reorder_v_heads`` (grouped by key head -> tiled) for rows of
    heads of any size, Qwen3.5's real shape included (16 key heads, 32 value heads of 128)."""
    for k, v, d in ((2, 4, 16), (2, 6, 1), (16, 32, 128), (3, 3, 4)):
        cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=8, delta_k_heads=k, delta_v_heads=v)
        hf = torch.arange(v * d)
        tiled = hf.reshape(k, v // k, d).transpose(0, 1).reshape(-1)  # the converter's, on rows
        assert torch.equal(tiled[torch.from_numpy(gguf_file.v_head_order(v * d, cfg))], hf)
