"""GGUF files of every family, written by llama.cpp's own converter (``convert_hf_to_gguf.py`` of the
llama.cpp that ``scripts/build_llamacpp.sh`` fetches), load in specdec and give the tokens of the
Hugging Face directory they came from.

The tiny random-weight models are transformers' own (tests/family_util.py), converted to f32 and to
q8_0 (``--outtype``) in one converter process. The f32 file gives exactly the directory's greedy tokens
in fp32 and its teacher-forced logits within 1e-4 (the same tokenizer, too); the q8_0 file's own blocks
(``quantization="gguf"``) give the plain path's tokens on that file, and so does speculation on them.
Q4_K (llama.cpp's ``llama-quantize``: a full build) runs in the slow stage.

What a GGUF file cannot state differently from llama.cpp's fixed defaults, the tiny models take from
them: Gemma 3's every 6th layer global (the converter writes no pattern), SmolLM3's every 4th layer
without RoPE, and no window for Mistral (llama.cpp's converter writes Mistral as arch ``llama``, which
has none).
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import CORPUS
from family_util import FAMILY_CONFIGS, family_dir
from llamacpp_util import convert, llamacpp_bin, llamacpp_source, quantize
from test_gguf_in_place import check_in_place_is_the_conversions
from specdec import LLM, SamplingParams
from specdec.config import ModelConfig
from specdec.errors import SpecdecError
from specdec.kernels import qmm
from specdec.formats import gguf_file, hub
from specdec.formats.gguf_blocks import gguf_weights
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.models.llama import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("gguf-families")  # one worker: the module's conversions run once
FAMILIES = list(FAMILY_CONFIGS)
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # 40+ tokens each: past every window
GGUF_OVERRIDES = {  # what llama.cpp fixes for the family and its files do not carry
    "gemma3": dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "smollm3": dict(no_rope_layer_interval=4),
    "mistral": dict(sliding_window=None),
}
FUSED = "llama3.2+fuse-qkv"  # llama.cpp's --fuse-qkv: one attn_qkv tensor, Q and K rows permuted inside it
VARIANTS = FAMILIES + [FUSED]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # within phi3's original context (64)


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # converted GGUF directories go to a throwaway cache
        mp.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> {"dir": the HF directory, "f32": its f32 GGUF, "q8_0": its q8_0 GGUF}, all converted at once."""
    src = llamacpp_source()
    root = tmp_path_factory.mktemp("gguf-families")
    out, jobs = {}, []
    for name in FAMILIES:
        d = family_dir(root, name, **GGUF_OVERRIDES.get(name, {}))
        out[name] = {"dir": d}
        for kind in ("f32", "q8_0"):
            out[name][kind] = root / f"{name}.{kind}.gguf"
            jobs.append((d, kind, out[name][kind]))
    out[FUSED] = {"dir": out["llama3.2"]["dir"], "f32": root / "llama3.2-fused.f32.gguf"}
    jobs.append((out[FUSED]["dir"], "f32", out[FUSED]["f32"], ["--fuse-qkv"]))
    windowed = family_dir(root / "windowed", "mistral")  # sliding_window 16: the converter drops it
    out["mistral-window"] = {"dir": windowed, "f32": root / "mistral-window.f32.gguf"}
    jobs.append((windowed, "f32", out["mistral-window"]["f32"]))
    spm_dir = sentencepiece_copy(out["gemma3"]["dir"], root / "gemma3-spm")
    out["gemma3-spm"] = {"dir": spm_dir, "f32": root / "gemma3-spm.f32.gguf"}
    jobs.append((spm_dir, "f32", out["gemma3-spm"]["f32"]))
    convert(src, jobs, root / "convert.log")
    return out


def sentencepiece_copy(model_dir, out):
    """``model_dir`` with a sentencepiece ``tokenizer.model`` as its only tokenizer, trained on the tests'
    corpus the way Gemma's is made (BPE, byte fallback, digits split, no dummy prefix, no normalization,
    pad/eos/bos/unk at 0-3, the turn markers and runs of 2 to 8 spaces as user-defined pieces, as Gemma's 2 to
    31): llama.cpp's converter then writes Gemma's kind of vocabulary (``tokenizer.ggml.model`` llama, scores,
    no merges, the runs of spaces as real spaces)."""
    import io
    import shutil

    import sentencepiece as spm

    shutil.copytree(model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    user = ["<start_of_turn>", "<end_of_turn>"] + ["\u2581" * n for n in range(2, 9)]
    added = {str(i): {"content": t, "special": i < 6, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, t in enumerate(user, start=4)}
    (out / "tokenizer_config.json").write_text(json.dumps(  # as Gemma's own: the turn markers are special
        {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
         "added_tokens_decoder": added}))
    config = json.loads((out / "config.json").read_text())  # and the special ids in config.json, as Gemma's
    (out / "config.json").write_text(json.dumps(config | {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 8), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, add_dummy_prefix=False, split_digits=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        user_defined_symbols=user, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2)
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    return out


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def fields(cfg: ModelConfig, *skip: str) -> dict:
    """The config's fields, factor lists as float32 (as a GGUF file stores them: 1.0 + 0.05 * 3 reads back
    as 1.15, the decimal of its float32)."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    if out.get("rope_scaling"):
        out["rope_scaling"] = {k: [float(np.float32(x)) for x in v] if isinstance(v, list) else v
                               for k, v in out["rope_scaling"].items()}
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_config_is_the_directorys_and_round_trips(models, name):
    """The config read from the f32 file's metadata is the directory's (the ids of the special tokens
    aside: the file names the tokenizer's eos), and its config.json reads back as itself."""
    path = models[name]["f32"]
    got = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    want = load_model_config(models[name]["dir"])
    skip = ("eos_token_ids", "bos_token_id")
    if name.startswith("llama3.2"):  # original context 32: not Meta's llama3 settings, so the factors as given
        skip += ("rope_scaling",)
        factors = gguf_file._llama3_factors(want.rope_scaling, want.rope_theta, want.head_dim)
        assert got.rope_scaling["rope_type"] == "freqs"
        np.testing.assert_allclose(got.rope_scaling["factors"], factors, rtol=1e-6)
    if name == "mistral":  # written as llama's, and without the window (the directory's has none either)
        assert got.architecture == "llama"
        skip += ("architecture",)
    assert fields(got, *skip) == fields(want, *skip)
    assert ModelConfig.from_hf(got.to_hf()) == got


@pytest.mark.parametrize("name", VARIANTS)
def test_f32_gguf_gives_the_directorys_tokens_and_logits(models, name):
    """fp32: teacher-forced logits within 1e-4 of transformers' on the directory, and specdec's greedy
    tokens from the GGUF file (its own tokenizer) equal transformers' generate on the directory."""
    m = models[name]
    hf = reference(m["dir"])
    converted = hub.resolve_model(str(m["f32"]), progress=False)
    cfg = load_model_config(converted)
    ours = build_model(cfg, load_state_dict(converted, torch.float32), dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens, torch.arange(40).expand(2, 40), ours.new_cache(2, 64)).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    llm = LLM(model=str(m["f32"]), dtype="float32", progress=False)
    hf_tok = transformers.AutoTokenizer.from_pretrained(m["dir"])
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        assert ids == hf_tok.encode(prompt) and len(ids) > 16
        assert llm.tokenizer.decode(ids) == prompt
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == want


def check_blocks_are_the_files(gguf_path, exact: bool = True) -> None:
    """Every linear's GGUF blocks, named, fused and un-permuted by the block loader, decode to the bf16
    conversion's weights (rounded to bf16: the conversion's rounding), or within 2^-8 for Q4_K; and the file
    read in place (the default) is that model, bit for bit (``check_in_place_is_the_conversions``)."""
    check_in_place_is_the_conversions(gguf_path)
    model_dir = hub.resolve_model(str(gguf_path), progress=False)
    cfg = load_model_config(model_dir)
    sd = load_state_dict(model_dir, torch.float32)
    model = build_model(cfg, {k: v.clone() for k, v in sd.items()}, dtype=torch.float32)
    linears = [n for n, mod in model.named_modules() if type(mod).__name__ == "Linear"]
    weights = gguf_weights(gguf_path, cfg, linears)
    assert weights, "no linear kept the file's blocks"
    for qual, qw in weights.items():
        want = model.get_submodule(qual).weight
        got = qmm.dequantize(qw).float()
        if exact:
            assert torch.equal(got.to(torch.bfloat16).float(), want), qual
        else:
            assert ((got - want).abs().max() <= 2 ** -7 * want.abs().max()).item(), qual


def same_up_to_a_tie(plain, other, tol: float = 0.3) -> bool:
    """``other``'s greedy tokens are ``plain``'s up to their first difference, and there the two paths had a
    tie: each path's token among the other path's top ones, and the two gaps (plain's pick over other's pick
    in plain's logprobs, and the reverse in other's) together at most ``tol`` nats. A flip needs the two
    paths' logits to differ by at least half that sum. They compute different products of the same file:
    the plain one the bf16 copy of the dequantized weights against bf16 activations, the blocks one the
    file's exact blocks against activations quantized to int8 per row (as llama.cpp's own kernels do), and
    both round the logits to bf16, whose steps are 0.125 nats for logits of 16-32 as these tiny random
    models have. Measured on an Intel Xeon, 2026-12-07 (Q4_K files): phi3 0.125 + 0.125, olmo2 0.125 +
    0.108, mistral 0 (an exact tie) + 0.25. Past the first difference the two texts are different texts."""
    a, b = plain.token_ids, other.token_ids
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return len(a) == len(b)
    mine, theirs = dict(plain.logprobs[i].top), dict(other.logprobs[i].top)
    if b[i] not in mine or a[i] not in theirs:
        return False
    return (mine[a[i]] - mine[b[i]]) + (theirs[b[i]] - theirs[a[i]]) <= tol


def check_block_tokens(gguf_path) -> None:
    """bf16, batch 2: the file's own blocks (quantization='gguf') give the plain path's greedy tokens on
    the same file (up to a tie of its bf16 logits), and n-gram speculation on those blocks gives exactly
    the blocks' own plain tokens."""
    greedy = GREEDY.replace(logprobs=3)
    plain = LLM(model=str(gguf_path), dtype="bfloat16", progress=False)
    want = [o.outputs[0] for o in plain.generate(PROMPTS, greedy)]
    blocks = LLM(model=str(gguf_path), dtype="bfloat16", progress=False, quantization="gguf")
    got = [o.outputs[0] for o in blocks.generate(PROMPTS, greedy)]
    assert all(same_up_to_a_tie(w, g) for w, g in zip(want, got)), ([w.token_ids for w in want],
                                                                     [g.token_ids for g in got])
    spec = LLM(model=str(gguf_path), dtype="bfloat16", progress=False, quantization="gguf",
               speculative_config={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                   "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)] == [g.token_ids for g in got]


@pytest.mark.parametrize("name", FAMILIES)
def test_q8_0_blocks_give_the_plain_paths_tokens(models, name):
    check_blocks_are_the_files(models[name]["q8_0"])
    check_block_tokens(models[name]["q8_0"])


def with_metadata(src, dst, extra: dict, tensor=None):
    """A copy of GGUF file ``src`` with ``extra`` metadata ({key: (value, GGUFValueType)}) added, and each
    tensor as ``tensor(reader_tensor)`` gives it ((data, raw_dtype); default: as stored)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for key, (value, vtype) in extra.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data, raw = (np.asarray(t.data), t.tensor_type) if tensor is None else tensor(t)
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_llama_file_that_states_a_window_is_mistrals_with_it(models, tmp_path):
    """llama.cpp's converter writes Mistral as arch llama without its window (llama.cpp's llama has
    none); a file that states one (``llama.attention.sliding_window``) loads as Mistral with that window
    on every layer, and gives the windowed directory's tokens past the window."""
    import gguf

    m = models["mistral-window"]
    path = with_metadata(m["f32"], tmp_path / "windowed.gguf",
                         {"llama.attention.sliding_window": (16, gguf.GGUFValueType.UINT32)})
    cfg = gguf_file.config_from_gguf(gguf_file.open_gguf(path), path)
    assert cfg.architecture == "mistral" and cfg.layer_windows == (16,) * cfg.num_hidden_layers
    hf = reference(m["dir"])
    llm = LLM(model=str(path), dtype="float32", progress=False)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == want


def test_metas_llama3_factors_stay_a_llama3_config(tmp_path):
    """Llama 3.1/3.2's own RoPE settings (original context 8192) read back from the factors llama.cpp's
    converter writes as the rope_scaling transformers reads, not as bare factors."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = gguf_file._llama3_factors(scaling, 500000.0, 64).astype(np.float32)
    import gguf

    path = tmp_path / "l.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_rope_freq_base(500000.0)
    w.add_tensor("rope_freqs.weight", factors)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = gguf_file.GGUFMeta(gguf_file.open_gguf(path), "llama")
    assert gguf_file._rope_scaling(g, 500000.0, 64, path) == scaling


def test_a_gemma_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(models):
    """Gemma's GGUF files carry a sentencepiece vocabulary (pieces and scores, no merges): the tokenizer
    built from one cuts text as the sentencepiece model it came from does, and decodes it back. Runs of
    spaces longer than the longest user-defined run are cut longest first (8 + 8 + 4, not as merges would)."""
    import sentencepiece as spm

    m = models["gemma3-spm"]
    sp = spm.SentencePieceProcessor(model_file=str(m["dir"] / "tokenizer.model"))
    llm = LLM(model=str(m["f32"]), dtype="float32", progress=False)
    runs = ["x" + " " * 20 + "y", "def f():\n" + " " * 11 + "return  1", " " * 37, "a" + " " * 9 + "b" + " " * 17]
    for text in CORPUS + ["  two  spaces\n\n<start_of_turn>user\nhi 2024<end_of_turn>"] + runs:
        ids = llm.tokenizer.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text)  # BOS first, as Gemma's tokenizer adds it
        assert llm.tokenizer.decode(ids[1:], skip_special_tokens=False) == text
    assert len(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_an_unsupported_architecture_names_the_supported_ones(models, tmp_path):
    import gguf

    src = gguf.GGUFReader(str(models["qwen3"]["f32"]))
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    for t in src.tensors[:1]:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdecError) as e:
        LLM(model=str(path), progress=False)
    msg = str(e.value)
    assert "unsupported GGUF architecture 'mamba'" in msg and "\n" not in msg
    for arch in ("llama", "qwen2", "qwen3", "gemma3", "gemma2", "phi3", "smollm3", "olmo2", "granite"):
        assert arch in msg


# ---- Q4_K: llama.cpp's quantizer (a full build of llama.cpp: the slow stage) ----------------------------
K_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quants pack 256 inputs a block


@pytest.fixture(scope="module")
def q4_k_models(tmp_path_factory) -> dict:
    """name -> its Q4_K GGUF (``llama-quantize --pure``: every matrix Q4_K), from a tiny model of
    hidden size 256 converted to f32."""
    src = llamacpp_source()
    bin_dir = llamacpp_bin()
    root = tmp_path_factory.mktemp("gguf-q4k")
    dirs = {n: family_dir(root, n, **GGUF_OVERRIDES.get(n, {}), **K_SIZES)
            for n in FAMILIES}
    convert(src, [(d, "f32", root / f"{n}.f32.gguf") for n, d in dirs.items()], root / "convert.log")
    return {n: quantize(bin_dir, root / f"{n}.f32.gguf", root / f"{n}.q4_k.gguf", "Q4_K_M", "--pure")
            for n in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_q4_k_blocks_give_the_plain_paths_tokens(q4_k_models, name):
    import gguf

    path = q4_k_models[name]
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1}
    assert "Q4_K" in kinds, kinds
    check_blocks_are_the_files(path, exact=False)
    check_block_tokens(path)
