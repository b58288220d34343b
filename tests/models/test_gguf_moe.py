"""GGUF files of the mixture-of-experts families, written by llama.cpp's own converter, load in specdec and
give the tokens of the Hugging Face directory they came from (tests/models/test_gguf_families.py does the
same for the dense families; its helpers and checks are used here as they are).

The tiny models are transformers' own (``family_util.MOE_CONFIGS``: 8 experts, 2 per token), converted to
f32 (and Qwen2-MoE, experts and shared expert, to q8_0) in one converter process. What a GGUF file cannot
state differently from llama.cpp's builder, the tiny models take from it: every Qwen3-MoE layer with experts
(the converter refuses a dense layer in a qwen3moe file: "Can not map tensor
'model.layers.1.mlp.down_proj.weight'"), and no window for Mixtral (written as arch ``llama``, which has
none). gpt-oss's MXFP4 experts: the converter writes them only from an MXFP4 checkpoint, so the f32 file's
experts are re-coded to MXFP4 with gguf-py's own quantizer.

The MoE families run on the PyTorch path (the native forward refuses them at load), so nothing here
depends on SPECDEC_NATIVE.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import test_gguf_families as dense
from family_util import MOE_CONFIGS, family_dir
from llamacpp_util import convert, llamacpp_source
from specdec.kernels import qmm
from specdec.models import gguf_file, gguf_quant, hub
from specdec.models.gguf_quant import gguf_weights
from specdec.models.hf import load_model_config, load_state_dict
from test_gguf_families import home  # noqa: F401  (home: converted models in a throwaway cache)

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("gguf-moe")  # one worker: the module's conversions run once
FAMILIES = list(MOE_CONFIGS)
GGUF_OVERRIDES = {  # what llama.cpp's converter and builders fix and the files do not carry
    "qwen3_moe": dict(mlp_only_layers=[]),
    "mixtral": dict(sliding_window=None),
}
Q8_0 = "qwen2_moe"  # routed experts, a shared expert and its gate, biases on q/k/v


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> {"dir": the HF directory, "f32": its f32 GGUF[, "q8_0": its q8_0 GGUF]}, converted at once;
    "gpt_oss-mxfp4": gpt-oss's f32 file with MXFP4 experts."""
    src = llamacpp_source()
    root = tmp_path_factory.mktemp("gguf-moe")
    out, jobs = {}, []
    for name in FAMILIES:
        d = family_dir(root, name, **GGUF_OVERRIDES.get(name, {}))
        out[name] = {"dir": d, "f32": root / f"{name}.f32.gguf"}
        jobs.append((d, "f32", out[name]["f32"]))
    out[Q8_0]["q8_0"] = root / f"{Q8_0}.q8_0.gguf"
    jobs.append((out[Q8_0]["dir"], "q8_0", out[Q8_0]["q8_0"]))
    convert(src, jobs, root / "convert.log")
    out["gpt_oss-mxfp4"] = {"dir": out["gpt_oss"]["dir"],
                            "f32": with_mxfp4_experts(out["gpt_oss"]["f32"], root / "gpt_oss.mxfp4.gguf")}
    return out


def with_mxfp4_experts(src, dst):
    """A copy of GGUF file ``src`` with its stacked expert weights (``*_exps.weight``) in MXFP4 blocks."""
    import gguf

    mxfp4 = gguf.GGMLQuantizationType.MXFP4

    def recode(t):
        if t.name.endswith("_exps.weight"):
            return gguf.quants.quantize(np.asarray(t.data), mxfp4), mxfp4
        return np.asarray(t.data), t.tensor_type
    return dense.with_metadata(src, dst, {}, recode)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_is_the_directorys_and_round_trips(models, name):
    """The config read from the f32 file's metadata and tensors is the directory's (special token ids aside:
    the file names the tokenizer's eos), experts included, and its config.json reads back as itself
    (test_gguf_families' check); so does the converted directory's."""
    dense.test_config_is_the_directorys_and_round_trips(models, name)
    path = models[name]["f32"]
    got = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert got.architecture == name and (got.num_experts, got.experts_per_tok) == (8, 2)
    assert load_model_config(hub.resolve_model(str(path), progress=False)) == got


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_gguf_gives_the_directorys_tokens_and_logits(models, name):
    """fp32: teacher-forced logits within 1e-4 of transformers' on the directory, and greedy tokens through
    ``LLM(model=<gguf>)`` equal to its ``generate`` (test_gguf_families' check)."""
    dense.test_f32_gguf_gives_the_directorys_tokens_and_logits(models, name)


def expert_blocks(path) -> dict:
    """The block loader's QWeights of every expert linear of the file's model (each expert's gate|up and
    down, the shared expert's), all of which it must find."""
    cfg = load_model_config(hub.resolve_model(str(path), progress=False))
    names = []
    for i in filter(cfg.is_moe, range(cfg.num_hidden_layers)):
        names += [f"layers.{i}.mlp.experts.{e}.{p}" for e in range(cfg.num_experts) for p in ("gate_up_proj", "down_proj")]
        if cfg.shared_expert_size:
            names += [f"layers.{i}.mlp.shared_expert.{p}" for p in ("gate_up_proj", "down_proj")]
    weights = gguf_weights(path, cfg, names)
    assert sorted(weights) == sorted(names)
    return weights


def test_q8_0_expert_blocks_give_the_plain_paths_tokens(models):
    """Each expert's gate|up and down (and the shared expert's) take the file's q8_0 blocks, bit-exact;
    ``quantization="gguf"`` gives the plain path's tokens on the file, and so does speculation on it."""
    path = models[Q8_0]["q8_0"]
    expert_blocks(path)
    dense.check_blocks_are_the_files(path)
    dense.check_block_tokens(path)


def test_mxfp4_experts_load_exactly(models):
    """gpt-oss's MXFP4 experts: the conversion holds their values exactly (bf16 holds every e2m1 value times
    a power of two), and ``quantization="gguf"`` keeps the blocks as exact 8-bit codes (so its tokens are
    those of test_q8_0_expert_blocks_give_the_plain_paths_tokens' path)."""
    import gguf

    path = models["gpt_oss-mxfp4"]["f32"]
    reader = gguf.GGUFReader(str(path))
    stacked = {t.name: t for t in reader.tensors}["blk.0.ffn_gate_exps.weight"]
    assert stacked.tensor_type.name == "MXFP4"
    values = torch.from_numpy(np.asarray(gguf.dequantize(stacked.data, stacked.tensor_type), dtype=np.float32))
    sd = load_state_dict(hub.resolve_model(str(path), progress=False), torch.float32)
    for e in range(values.shape[0]):
        assert torch.equal(sd[f"layers.0.mlp.experts.{e}.gate_proj.weight"], values[e])
    got = qmm.dequantize(expert_blocks(path)["layers.0.mlp.experts.3.gate_up_proj"]).float()
    assert torch.equal(got[:values.shape[1]], values[3])  # the gate rows, exactly the file's (not via bf16)
    dense.check_blocks_are_the_files(path)


def test_mxfp4_blocks_beyond_fp16_scales_stay_unquantized():
    """An MXFP4 block whose scale (or 12 times it) is no fp16 value cannot be held as codes: the tensor is
    left to the bf16 weights; a block of zeros may have any scale."""
    codes = np.arange(16, dtype=np.uint8) * 17  # both nibbles: e2m1 codes 0..15
    block = lambda e, qs=codes: np.concatenate([[e], qs]).astype(np.uint8)  # noqa: E731
    exact = gguf_quant.decode_mxfp4(np.stack([block(120), block(255, np.zeros(16, np.uint8))]), 2, 32)
    assert exact is not None
    c, s, o, bits = exact
    assert bits == 8 and s[0, 0] == 2.0 ** -8 and o[0, 0] == -12 * 2.0 ** -8
    assert (c[0, :8] == [12, 13, 14, 15, 16, 18, 20, 24]).all() and (c[1] == 12).all()
    for e in (103, 141):  # 2^-25 is below fp16's subnormals; 12 * 2^13 above its largest value
        assert gguf_quant.decode_mxfp4(block(e)[None], 1, 32) is None


def test_a_llama_file_with_experts_is_mixtrals_and_keeps_a_stated_window(models, tmp_path):
    """llama.cpp writes Mixtral as arch llama with ``llama.expert_count``: that is Mixtral; a window the file
    states (``llama.attention.sliding_window``) is every layer's, as for Mistral."""
    import gguf

    path = dense.with_metadata(models["mixtral"]["f32"], tmp_path / "windowed.gguf",
                               {"llama.attention.sliding_window": (16, gguf.GGUFValueType.UINT32)})
    cfg = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert cfg.architecture == "mixtral" and cfg.layer_windows == (16,) * cfg.num_hidden_layers
    assert cfg.num_experts == 8 and cfg.norm_topk_prob
