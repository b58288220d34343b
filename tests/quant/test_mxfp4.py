"""gpt-oss's MXFP4 safetensors checkpoints (specdec/quant/mxfp4.py): a tiny gpt-oss built by transformers'
own class has its experts coded to MXFP4 blocks in transformers' on-disk layout (``*_blocks`` / ``*_scales``,
``quantization_config: mxfp4``) by this file's encoder, checked against transformers' own dequantizer; the
reference is transformers' fp32 model with its experts set to that dequantizer's values.

Loaded in fp32, the experts are those values exactly and the logits and greedy tokens are the reference's;
by default (bf16 on the CPU) they stay one byte a weight, as exact 8-bit codes (the GGUF path's form of
MXFP4), and speculation on them is plain greedy; int8 re-quantizes from the exact values; a block beyond
fp16's scales leaves its expert exact in bf16; damaged blocks or scales are a clear error.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import CORPUS
from family_util import family_dir, reference
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.quant.linear import Linear
from specdec.formats.loader import LoadedModel
from specdec.quant.qlinear import QLinear

transformers = pytest.importorskip("transformers")
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # past the 16-position windows
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CPU = torch.device("cpu")


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w (..., N, K)`` -> MXFP4 blocks ``(..., N, K/32, 16)``, scales ``(..., N, K/32)`` (uint8) and the values
    they stand for: per 32 inputs a power-of-two scale ``2^(s-127)`` putting the largest within e2m1's 6, each
    value the nearest e2m1 one; element 2j in the low nibble of byte j, 2j+1 in the high."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.zeros_like(amax))
    x = g / torch.exp2(exp)[..., None]
    idx = (x.abs()[..., None] - E2M1).abs().argmin(-1)  # the nearest magnitude
    nib = (idx + 8 * (x < 0)).to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    values = (torch.where(x < 0, -E2M1[idx], E2M1[idx]) * torch.exp2(exp)[..., None]).reshape(w.shape)
    return blocks, (exp + 127).to(torch.uint8), values


def transformers_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own dequantization (fp32, ``GptOssExperts``' (E, K, N) layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def write_mxfp4_dir(src, dst, edit=None) -> dict:
    """A copy of gpt-oss directory ``src`` with its experts as MXFP4 blocks and scales; ``edit(tensors)`` may
    damage them. Returns {stacked tensor name: (blocks, scales)}."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    coded = {}
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(key).transpose(1, 2).contiguous()  # (E, K, N) -> the file's (E, N, K)
        blocks, scales, _ = encode(w)
        sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
        coded[key] = (blocks, scales)
    if edit is not None:
        edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return coded


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the MXFP4 directory, its blocks by stacked tensor name, transformers' fp32 model on their values)."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = family_dir(root, "gpt_oss")
    coded = write_mxfp4_dir(src, root / "gpt_oss-mxfp4")
    ref = reference(src)
    with torch.no_grad():
        for key, (blocks, scales) in coded.items():
            layer, proj = key.split(".")[2], key.rsplit(".", 1)[1]
            getattr(ref.model.layers[int(layer)].mlp.experts, proj).copy_(transformers_dequant(blocks, scales))
    return root / "gpt_oss-mxfp4", coded, ref


def expert_values(coded: dict, layer: int, proj: str) -> torch.Tensor:
    """transformers' values of a layer's experts as our per-expert weights (E, N, K), gate rows first."""
    blocks, scales = coded[f"model.layers.{layer}.mlp.experts.{proj}"]
    w = transformers_dequant(blocks, scales).transpose(1, 2)  # (E, N, K), rows as in the file
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1) if proj == "gate_up_proj" else w


def logits(model, rows: int = 2, length: int = 40, vocab: int = 400) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens, torch.arange(length).expand(rows, length), model.new_cache(rows, length + 24)).logits


def test_the_encoder_round_trips_through_transformers_dequantizer():
    """The test's encoder is MXFP4 as transformers reads it: its dequantizer gives the values the encoder
    meant, bit for bit (nibble order, scale bias, layout), and those are close to the weights coded."""
    w = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, 0, :32] = 0  # a block of zeros
    blocks, scales, values = encode(w)
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2)
    assert torch.equal(transformers_dequant(blocks, scales), values.transpose(1, 2))
    assert ((values - w).abs() <= w.reshape(3, 48, 2, 32).abs().amax(-1).repeat_interleave(32, -1) / 3).all()
    assert (blocks & 15 != blocks >> 4).any()  # the two nibbles of a byte differ: their order is tested


def test_fp32_load_is_transformers_dequantization_logits_and_greedy_tokens(mxfp4):
    """fp32: each expert's weights are transformers' dequantized values exactly (gate rows first), the
    teacher-forced logits within 1e-4 of its model's, and greedy tokens equal to its ``generate``."""
    from specdec import LLM, SamplingParams

    path, coded, ref = mxfp4
    lm = LoadedModel(str(path), torch.float32, CPU, progress=False)
    for layer in range(4):
        for proj in ("gate_up_proj", "down_proj"):
            want = expert_values(coded, layer, proj)
            for e, expert in enumerate(lm.model.layers[layer].mlp.experts):
                lin = getattr(expert, proj)
                assert isinstance(lin, Linear) and torch.equal(lin.weight, want[e]), (layer, proj, e)
    tokens = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = ref(tokens).logits
    ours = logits(lm.model)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4

    llm = LLM(model=str(path), dtype="float32", progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
        assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == want, prompt


def test_default_load_keeps_the_experts_as_exact_one_byte_codes(mxfp4):
    """bf16 on the CPU (the default): every expert product is 8-bit codes (one byte a weight plus an fp16
    scale and offset per 32) that stand for transformers' values exactly, no float expert weight is kept,
    and the logits are as far from the fp32 load's as bf16 puts a load of the exact float experts (this
    tiny random model amplifies bf16's rounding to ~20% of its largest logit); the same codes run in fp32
    are the fp32 load's within the kernel's int8 activation codes."""
    from specdec.quant import mxfp4_codes as mxc
    from specdec.formats.hf import load_model_config, load_state_dict
    from specdec.models.llama import build_model

    path, coded, _ = mxfp4
    lm = LoadedModel(str(path), torch.bfloat16, CPU, progress=False)
    assert not [n for n, _ in lm.model.named_parameters() if ".experts." in n]
    for layer in range(4):
        for proj in ("gate_up_proj", "down_proj"):
            want = expert_values(coded, layer, proj)
            for e, expert in enumerate(lm.model.layers[layer].mlp.experts):
                lin = getattr(expert, proj)
                assert isinstance(lin, QLinear) and lin.qweight.bits == 8, (layer, proj, e)
                n, k = want[e].shape
                qw = lin.qweight
                assert qw.data.dtype == torch.uint8 and qw.data.numel() == n * k  # n: a multiple of 16 here
                assert qw.scales.dtype == torch.float16 and qw.scales.numel() == 2 * n * k // 32
                assert torch.equal(qmm.dequantize(qw), want[e]), (layer, proj, e)
                assert qw.bias is not None and qw.bias.dtype == torch.float32
    cfg = load_model_config(path)
    floats = {dtype: build_model(cfg, load_state_dict(path, dtype), dtype=dtype)
              for dtype in (torch.float32, torch.bfloat16)}
    codes: dict = {}
    fp32_codes = build_model(cfg, load_state_dict(path, torch.float32, expert_codes=codes, pack=mxc.packed),
                             dtype=torch.float32)
    assert mxc.attach(fp32_codes, codes) == 4 * 8 * 2
    ref = logits(floats[torch.float32])

    def error(model) -> float:
        return ((logits(model).float() - ref).abs().max() / ref.abs().max()).item()

    assert error(lm.model) <= 1.5 * error(floats[torch.bfloat16]) + 1e-3
    assert error(fp32_codes) < 2e-3


def test_speculation_on_the_default_load_is_plain_greedy(mxfp4):
    """The default load (the native forward where the kernels run: the codes are its experts' int8
    products) decodes speculatively to plain greedy's tokens, batch 2."""
    from specdec import LLM, SamplingParams

    path, _, _ = mxfp4
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(path), progress=False).generate(PROMPTS, greedy)]
    spec = LLM(model=str(path), progress=False, speculative_config={
        "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy)] == plain


def test_codes_are_the_gguf_paths_own():
    """The codes of an HF block are those the GGUF path keeps the same MXFP4 block in
    (``gguf_blocks.decode_mxfp4``: its own nibble order, element i < 16 low, i >= 16 high)."""
    import numpy as np

    from specdec.formats import gguf_blocks
    from specdec.quant import mxfp4 as mx

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (5, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 135, (5, 3), generator=gen, dtype=torch.uint8)
    blocks[1, 2] = 0x88  # a block of -0s, with a scale beyond fp16's
    scales[1, 2] = 250
    nib = torch.stack([blocks & 15, blocks >> 4], -1).reshape(5, 3, 32)  # element 2j low, 2j+1 high
    raw = torch.cat([scales[..., None], nib[..., :16] | (nib[..., 16:] << 4)], -1).reshape(5, 3 * 17)
    want = gguf_blocks.decode_mxfp4(raw.numpy(), 5, 96)
    got = mx.codes(blocks, scales)
    assert want is not None and got is not None
    f, _ = want
    for g, w in zip(got, (f["codes"], f["scale"], f["offset"])):
        assert np.array_equal(g.float().numpy(), w.astype(np.float16).astype(np.float32))
    assert torch.equal(mx.floats(blocks, scales), qmm.dequantize(qmm.pack(*got, 8)))
    assert mx.codes(blocks[1:2], torch.full((1, 3), 250, dtype=torch.uint8)) is None  # nonzero blocks, 2^122


def test_every_code_and_scale_byte_decodes_as_transformers_does():
    """All 256 block bytes under every scale byte (255, E8M0's NaN, aside): our floats are transformers'
    values; the codes' tile layout, written straight from the blocks, is ``qmm.pack``'s."""
    from specdec.quant import mxfp4 as mx
    from specdec.quant import mxfp4_codes as mxc

    scales = torch.arange(255, dtype=torch.uint8).repeat_interleave(16)[:, None].repeat(1, 16)  # (4080, 16)
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).repeat(4080, 1, 1)  # each row: every byte
    theirs = transformers_dequant(blocks[None], scales[None])[0].t()
    assert torch.equal(mx.floats(blocks, scales), theirs)
    fit = slice(16 * 104, 16 * 141)  # scale bytes 104..140
    qw = mxc.packed(blocks[fit].contiguous(), scales[fit].contiguous())
    assert torch.equal(qw.data, qmm.pack(*mx.codes(blocks[fit], scales[fit]), 8).data)
    assert torch.equal(qmm.dequantize(qw), theirs[fit])
    assert mxc.packed(blocks[:5], scales[:5]) is None  # 2^-128: not fp16
    odd = mxc.packed(blocks[fit][:5].contiguous(), scales[fit][:5].contiguous())  # rows not a multiple of 16
    assert odd.out_features == 5 and torch.equal(qmm.dequantize(odd), theirs[fit][:5])


def test_biases_follow_their_rows(mxfp4):
    """The gate|up biases are de-interleaved as the weights' rows are (fp32 load against the file's)."""
    from safetensors.torch import load_file

    path, _, _ = mxfp4
    sd = load_file(str(path / "model.safetensors"))
    lm = LoadedModel(str(path), torch.float32, CPU, progress=False)
    b = sd["model.layers.1.mlp.experts.gate_up_proj_bias"]
    for e, expert in enumerate(lm.model.layers[1].mlp.experts):
        assert torch.equal(expert.gate_up_proj.bias, torch.cat([b[e, 0::2], b[e, 1::2]]))
        assert torch.equal(expert.down_proj.bias, sd["model.layers.1.mlp.experts.down_proj_bias"][e])


def test_int8_starts_from_the_exact_values(mxfp4):
    """``quantization="int8"`` re-quantizes the experts from their exact (bf16) values, as for a bf16
    checkpoint."""
    path, coded, _ = mxfp4
    lm = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="int8")
    want = expert_values(coded, 2, "down_proj")[5]
    got = lm.model.layers[2].mlp.experts[5].down_proj.qweight
    assert torch.equal(got.data, qmm.from_float(want.to(torch.bfloat16), 8).data)


def test_a_block_beyond_fp16_scales_leaves_its_expert_exact_in_bf16(tmp_path, mxfp4):
    """A block whose scale 2^(s-128) fp16 cannot hold: that expert product stays a bf16 Linear (still
    exactly the file's values), the others codes."""
    path, _, _ = mxfp4
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(path, src)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.mlp.experts.gate_up_proj_scales"][3, 5, 1] = 128 - 30  # 2^-30: below fp16's subnormals
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    key = "model.layers.0.mlp.experts.gate_up_proj"
    blocks, scales = sd[key + "_blocks"], sd[key + "_scales"]
    assert (blocks[3, 5, 1] & 0x77).any()  # not a block of zeros
    lm = LoadedModel(str(src), torch.bfloat16, CPU, progress=False)
    experts = lm.model.layers[0].mlp.experts
    assert isinstance(experts[3].gate_up_proj, Linear) and isinstance(experts[3].down_proj, QLinear)
    assert all(isinstance(experts[e].gate_up_proj, QLinear) for e in range(8) if e != 3)
    w = transformers_dequant(blocks, scales).transpose(1, 2)[3]
    assert torch.equal(experts[3].gate_up_proj.dense_weight().float(), torch.cat([w[0::2], w[1::2]]))


@pytest.mark.parametrize("damage, match", [
    ("scales_shape", r"MXFP4 experts .*gate_up_proj_blocks / _scales: shapes"),
    ("no_scales", r"MXFP4 blocks .*down_proj_blocks but no .*down_proj_scales"),
    ("scales_dtype", r"must be uint8"),
])
def test_damaged_blocks_or_scales_are_a_clear_error(tmp_path, damage, match):
    """Scales of the wrong shape, missing or not uint8: a SpecdecError naming the tensor, at load."""
    src = family_dir(tmp_path, "gpt_oss")

    def edit(sd):
        key = "model.layers.1.mlp.experts."
        if damage == "scales_shape":
            sd[key + "gate_up_proj_scales"] = sd[key + "gate_up_proj_scales"][:, :, :1].contiguous()
        elif damage == "no_scales":
            del sd[key + "down_proj_scales"]
        else:
            sd[key + "gate_up_proj_scales"] = sd[key + "gate_up_proj_scales"].float()
    write_mxfp4_dir(src, tmp_path / "bad", edit)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(SpecdecError, match=match):
            LoadedModel(str(tmp_path / "bad"), dtype, CPU, progress=False)
