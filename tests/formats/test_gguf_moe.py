"""GGUF files of the mixture-of-experts families, written by llama.cpp's own converter, load in specdec and
give the tokens of the Hugging Face directory they came from (tests/formats/test_gguf_families.py does the
same for the dense families; its helpers and checks are used here as they are).

The tiny models are transformers' own (``family_util.MOE_CONFIGS``: 8 experts, 2 per token), converted to
f32 (and Qwen2-MoE, experts and shared expert, to q8_0) in one converter process. What a GGUF file cannot
state differently from llama.cpp's builder, the tiny models take from it: every Qwen3-MoE layer with experts
(the converter refuses a dense layer in a qwen3moe file: "Can not map tensor
'model.layers.1.mlp.down_proj.weight'"), and no window for Mixtral (written as arch ``llama``, which has
none). gpt-oss's MXFP4 experts: the converter writes them only from an MXFP4 checkpoint, so the f32 file's
experts are re-coded to MXFP4 with gguf-py's own quantizer.

GLM-4.5 (tests/glm_util.py: 8 experts in 4 groups of which 2 compete, a correction bias, a routed scale, two
ungated shared experts, a dense first layer, and one MTP layer past the decoder's): llama.cpp's converter writes
arch ``glm4moe`` with the groups, norm and scale in its metadata and the MTP layer as one more block; it is
converted with and without it (``--no-mtp``), and to q8_0. The converter takes GLM's special tokens from its tokenizer, which
the tiny one lacks: tests/llamacpp_convert.py gives it the BPE vocabulary the other families get.

The checks run in fp32 (the PyTorch path) and on the q8_0 blocks, so nothing here depends on SPECDEC_NATIVE.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import test_gguf_families as dense
from family_util import MOE_CONFIGS, family_dir
from glm_util import glm_dir
from glm_util import reference as glm_reference
from llamacpp_util import convert, llamacpp_source
from specdec.kernels import qmm
from specdec import LLM
from specdec.errors import SpecdecError
from specdec.formats import gguf_file, hub
from specdec.formats import gguf_blocks
from specdec.formats.gguf_blocks import gguf_weights
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.heads.mtp import load_mtp
from test_gguf_families import home  # noqa: F401  (home: converted models in a throwaway cache)

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("gguf-moe")  # one worker: the module's conversions run once
FAMILIES = list(MOE_CONFIGS)
GGUF_OVERRIDES = {  # what llama.cpp's converter and builders fix and the files do not carry
    "qwen3_moe": dict(mlp_only_layers=[]),
    "mixtral": dict(sliding_window=None),
}
Q8_0 = "qwen2_moe"  # routed experts, a shared expert and its gate, biases on q/k/v
GLM = "glm4_moe"


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
    glm = glm_dir(root)  # with its MTP layer
    out[GLM] = {"dir": glm, "f32": root / f"{GLM}.f32.gguf", "no-mtp": root / f"{GLM}-no-mtp.f32.gguf",
                "q8_0": root / f"{GLM}.q8_0.gguf"}
    jobs += [(glm, "f32", out[GLM]["f32"]), (glm, "f32", out[GLM]["no-mtp"], ["--no-mtp"]),
             (glm, "q8_0", out[GLM]["q8_0"])]
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
    exact = gguf_blocks.decode_mxfp4(np.stack([block(120), block(255, np.zeros(16, np.uint8))]), 2, 32)
    assert exact is not None
    f, bits = exact
    c, s, o = f["codes"], f["scale"], f["offset"]
    assert bits == 8 and s[0, 0] == 2.0 ** -8 and o[0, 0] == -12 * 2.0 ** -8
    assert (c[0, :8] == [12, 13, 14, 15, 16, 18, 20, 24]).all() and (c[1] == 12).all()
    for e in (103, 141):  # 2^-25 is below fp16's subnormals; 12 * 2^13 above its largest value
        assert gguf_blocks.decode_mxfp4(block(e)[None], 1, 32) is None


def test_a_llama_file_with_experts_is_mixtrals_and_keeps_a_stated_window(models, tmp_path):
    """llama.cpp writes Mixtral as arch llama with ``llama.expert_count``: that is Mixtral; a window the file
    states (``llama.attention.sliding_window``) is every layer's, as for Mistral."""
    import gguf

    path = dense.with_metadata(models["mixtral"]["f32"], tmp_path / "windowed.gguf",
                               {"llama.attention.sliding_window": (16, gguf.GGUFValueType.UINT32)})
    cfg = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert cfg.architecture == "mixtral" and cfg.layer_windows == (16,) * cfg.num_hidden_layers
    assert cfg.num_experts == 8 and cfg.norm_topk_prob


def test_glm45_config_is_the_directorys_and_round_trips(models):
    """GLM-4.5's file (llama.cpp's glm4moe): the grouped sigmoid router with its groups, norm and scale, the
    ungated shared experts, the dense first layer, partial RoPE, q/k norms and biases, and the MTP layer: the
    directory's config (test_gguf_families' check); the --no-mtp file's states no MTP layer."""
    dense.test_config_is_the_directorys_and_round_trips(models, GLM)
    path = models[GLM]["f32"]
    got = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert (got.router, got.n_group, got.topk_group, got.routed_scale, got.norm_topk_prob) == (
        "sigmoid_group", 4, 2, 2.5, True)
    assert (got.shared_expert_size, got.shared_expert_gate, got.moe_layers, got.mtp_layers) == (64, False, (0, 1, 1), 1)
    path = models[GLM]["no-mtp"]
    assert gguf_file.config_from_gguf(gguf_file.open_gguf(path), path).mtp_layers == 0


def test_glm45_f32_gguf_gives_the_directorys_tokens_and_logits(models, monkeypatch):
    """fp32: teacher-forced logits within 1e-4 of transformers' on the directory (the router's correction bias
    from the file's ``exp_probs_b``), greedy tokens through ``LLM(model=<gguf>)`` equal to its ``generate``."""
    monkeypatch.setattr(dense, "reference", lambda path: glm_reference(path, monkeypatch))
    dense.test_f32_gguf_gives_the_directorys_tokens_and_logits(models, GLM)


def test_glm45_mtp_layer_loads_from_the_gguf_file(models):
    """The file's MTP block (``blk.3``: a decoder layer with experts, and ``nextn.*``) is the directory's
    ``model.layers.3``: method mtp reads the same weights from either, and its greedy speculation on the file
    gives plain greedy's tokens. A file converted with --no-mtp: one clear error naming the option."""
    path, d = models[GLM]["f32"], models[GLM]["dir"]
    converted = hub.resolve_model(str(path), progress=False)
    ours, theirs = (load_mtp(p, load_model_config(p), torch.float32).state_dict() for p in (converted, d))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    llm = LLM(model=str(path), dtype="float32", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts = [dense.PROMPTS[0]]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, dense.GREEDY, num_speculative_tokens=0)]
    outs = llm.generate(prompts, dense.GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    with pytest.raises(SpecdecError, match="no multi-token-prediction layers.*--no-mtp"):
        LLM(model=str(models[GLM]["no-mtp"]), dtype="float32", progress=False, speculative_config={"method": "mtp"})
    # the default (the file read in place, its own tensors): method mtp reads its layers from the file's conversion
    default = LLM(model=str(path), progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert default.target.gguf is not None
    plain = [o.outputs[0].token_ids for o in default.generate(prompts, dense.GREEDY, num_speculative_tokens=0)]
    assert [o.outputs[0].token_ids for o in default.generate(prompts, dense.GREEDY)] == plain


def test_glm45_q8_0_expert_blocks_are_the_files(models):
    """GLM-4.5's q8_0 file: each expert's gate|up and down and the shared experts' take the file's blocks, and
    every linear's blocks decode to the conversion's weights. (The tokens on them are not run here: heads of 16
    run on the PyTorch path, half a minute; Qwen2-MoE's q8_0 test runs its.)"""
    path = models[GLM]["q8_0"]
    expert_blocks(path)
    dense.check_blocks_are_the_files(path)
