"""A GGUF file runs in its own quantization by default, read in place: nothing written to the cache, the same
model (and greedy tokens) as ``quantization="gguf"`` made of the converted directory, bf16 when a dtype is asked."""
from __future__ import annotations

import os
import shutil

from unittest import mock

import numpy as np
import pytest
import torch

from conftest import assert_same_tokenizer, logits_of
from test_loading import fake_entry, home, make_hf_weights, write_gguf  # noqa: F401  (home: a fresh SPECDEC_HOME)
from specdec import LLM, SamplingParams
from specdec.kernels import hugepages, qmm
from specdec.formats import hf, hub, loader, registry
from specdec.formats.gguf_model import BlockEmbedding, linear_of
from specdec.quant.linear import Linear
from specdec.formats.loader import LoadedModel, model_quantization
from specdec.quant.qlinear import QEmbedding, QLinear, RowLookup

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def quantized_file(tmp_path, arch: str, tied: bool):
    """A tiny GGUF file whose linears are blocks (Q4_0 attention, Q8_0 MLP, a Q5_0 part in one fused q|k|v), its
    norms and biases F32, its embedding table Q8_0 (also the head's rows where tied)."""
    w = make_hf_weights(arch, tied=tied)
    types = {n: "Q4_0" if ".self_attn." in n else "Q8_0" for n in w if n.endswith("proj.weight")}
    types["model.layers.0.self_attn.v_proj.weight"] = "Q5_0"
    if not tied:
        types["lm_head.weight"] = "Q4_0"
    return write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, w, types=types)


def converted_with_gguf_blocks(path, monkeypatch) -> LoadedModel:
    """The model of before: the file converted into the cache, loaded bf16, its linears' blocks read again."""
    with monkeypatch.context() as m:
        m.setattr(loader, "is_gguf", lambda name: False)
        return LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")


def check_in_place_is_the_conversions(path) -> None:
    """The model read in place is the one ``quantization="gguf"`` made of the converted directory: every weight
    and every quantized linear equal, the same logits (the families' GGUF files: test_gguf_families.py)."""
    ours = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    with mock.patch.object(loader, "is_gguf", lambda name: False):
        before = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    assert ours.gguf is not None and before.gguf is None and ours.config == before.config
    a, b = ours.model.state_dict(), before.model.state_dict()
    if isinstance(ours.model.embed_tokens, RowLookup):  # a quantized table: its rows looked up in its blocks
        table = b.pop("embed_tokens.weight")
        assert torch.equal(ours.model.embed_tokens(torch.arange(table.shape[0])), table)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
    qa = {n: m.qweight for n, m in ours.model.named_modules() if isinstance(m, QLinear)}
    qb = {n: m.qweight for n, m in before.model.named_modules() if isinstance(m, QLinear)}
    assert sorted(qa) == sorted(qb) and qa
    for n, w in qa.items():
        assert torch.equal(qmm.dequantize(w), qmm.dequantize(qb[n])), n
        assert (w.bias is None) == (qb[n].bias is None) and (w.bias is None or torch.equal(w.bias, qb[n].bias)), n
    ids = before.tokenizer.encode("def fibonacci(n):\n    return n")
    assert ours.tokenizer.encode("def fibonacci(n):\n    return n") == ids
    assert torch.equal(logits_of(ours.model, ids), logits_of(before.model, ids))


def test_default_load_reads_the_file_in_place_and_says_so(tmp_path, home, capsys):
    path = quantized_file(tmp_path, "qwen2", tied=False)
    llm = LLM(str(path))
    err = capsys.readouterr().err
    assert f"{path}: the file's own blocks (Q4_0 x 8, Q8_0 x 7, Q5_0 x 1; F32 x 11 as bf16) (loaded in " in err
    assert llm.target.quantization == "gguf" and llm.target.gguf == llm.target.path == path.resolve()
    assert not (home / "models").exists()  # no conversion, no gguf-* directory
    model = llm.target.model
    linears = [m for m in model.modules() if isinstance(m, (Linear, QLinear))]
    assert linears and all(isinstance(m, QLinear) for m in linears)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.bfloat16
    assert isinstance(model.embed_tokens, BlockEmbedding)  # the untied Q8_0 table: rows read from the file's map


def test_an_untied_embedding_reads_only_the_rows_it_looks_up_from_the_files_map(tmp_path):
    """No table and no tiles of an untied embedding: its rows dequantized from the file's blocks when looked up,
    the converted table's values (check_in_place_is_the_conversions compares every row)."""
    path = quantized_file(tmp_path, "qwen2", tied=False)
    model = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf").model
    emb = model.embed_tokens
    assert isinstance(emb, BlockEmbedding) and emb.blocks.base is not None and not emb.blocks.flags.writeable
    ids = torch.tensor([[1, 2, 1]])
    got = emb(ids)
    assert got.shape == (1, 3, model.config.hidden_size) and torch.equal(got[0, 0], got[0, 2])
    with pytest.raises(IndexError, match="token ids must lie in"):
        emb(torch.tensor([-1]))


def test_a_tied_embedding_is_looked_up_in_the_heads_tiles(tmp_path):
    """One repacking of the tied table's blocks serves both the LM head and the embedding (no bf16 table)."""
    path = quantized_file(tmp_path, "llama", tied=True)
    model = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf").model
    assert isinstance(model.embed_tokens, QEmbedding) and model.embed_tokens.tiles is model.lm_head.qweight
    with pytest.raises(IndexError, match="token ids must lie in"):
        model.embed_tokens(torch.tensor([model.config.vocab_size]))
    ids = torch.tensor([[3, 17, 3], [0, model.config.vocab_size - 1, 5]])
    got = model.embed_tokens(ids)
    assert got.shape == (2, 3, model.config.hidden_size) and got.dtype == torch.bfloat16
    assert torch.equal(got[0, 0], got[0, 2]) and torch.equal(got[1], model.embed_tokens(ids[1]))


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_in_place_is_the_explicit_quantization_of_the_converted_model(tmp_path, arch, tied):
    """Bit for bit: every weight, every quantized linear, the logits; config and tokenizer."""
    path = quantized_file(tmp_path, arch, tied)
    check_in_place_is_the_conversions(path)
    ours = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    converted = hub.resolve_model(str(path), progress=False)
    before = LoadedModel(str(converted), torch.bfloat16, CPU, progress=False)  # its tokenizer, from the directory
    assert ours.tokenizer.eos_token_ids == before.tokenizer.eos_token_ids
    assert ours.tokenizer.chat_template == before.tokenizer.chat_template
    assert isinstance(ours.model.lm_head, QLinear)


def test_greedy_tokens_equal_the_explicit_quantization_path(tmp_path, monkeypatch):
    path = quantized_file(tmp_path, "llama", tied=True)
    default = LLM(str(path), progress=False)
    with monkeypatch.context() as m:
        m.setattr(loader, "is_gguf", lambda name: False)
        before = LLM(str(path), progress=False, quantization="gguf")  # converted, then its blocks read again
    assert default.target.gguf is not None and before.target.gguf is None
    prompts = ["Hello world", "world Hello Hello"]
    assert ([o.outputs[0].token_ids for o in default.generate(prompts, GREEDY)]
            == [o.outputs[0].token_ids for o in before.generate(prompts, GREEDY)])


def test_a_dtype_or_another_quantization_loads_the_converted_model(tmp_path, home, capsys):
    path = quantized_file(tmp_path, "llama", tied=True)
    llm = LLM(str(path), dtype="bfloat16")
    assert "bf16, dequantized (loaded in " in capsys.readouterr().err
    assert llm.target.quantization is None and llm.target.gguf is None
    assert not any(isinstance(m, QLinear) for m in llm.target.model.modules())
    assert [p.name.startswith("gguf-tiny-llama-") for p in (home / "models").iterdir()] == [True]
    explicit = LLM(str(path), quantization="gguf", progress=False)  # the default's own name
    assert explicit.target.gguf is not None


def test_int4_and_int8_of_a_gguf_file_are_made_in_memory_with_the_converted_models_codes(tmp_path, home):
    """quantization int4/int8 of a GGUF file: no converted copy in the cache, and the same codes (hence the
    same tokens) as quantizing the converted bf16 model."""
    path = quantized_file(tmp_path, "llama", tied=True)
    mems = {kind: LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization=kind)
            for kind in ("int4", "int8")}
    assert not (home / "models").exists() or not any((home / "models").iterdir())  # nothing converted
    for kind, mem in mems.items():
        assert mem.runs_as == f"{kind}, quantized from the file's weights in memory" and mem.gguf is not None
        conv = object.__new__(LoadedModel)  # the converted directory's way (writes the cache)
        conv._load_directory(str(path), torch.bfloat16, CPU, False, kind)
        ours = {n: m.qweight for n, m in mem.model.named_modules() if isinstance(m, QLinear)}
        theirs = {n: m.qweight for n, m in conv.model.named_modules() if isinstance(m, QLinear)}
        assert ours.keys() == theirs.keys() and ours
        for n in ours:
            assert torch.equal(ours[n].data, theirs[n].data) and torch.equal(ours[n].scales, theirs[n].scales), n


def test_the_rule():
    gguf, cuda = "smollm2-135m", torch.device("cuda")  # (a registry name: nothing is downloaded to decide)
    assert model_quantization(gguf, None, False, CPU) == "gguf"
    assert model_quantization(gguf, None, True, CPU) is None  # a dtype asked for
    assert model_quantization(gguf, "int4", False, CPU) == "int4"
    assert model_quantization(gguf, None, False, cuda) is None  # the quantized kernels are CPU only
    assert model_quantization("/no/such/dir", None, False, CPU) is None


def test_a_registry_name_runs_its_file_in_place(tmp_path, monkeypatch, home):
    data = quantized_file(tmp_path, "llama", tied=True).read_bytes()
    entry = fake_entry(tmp_path, home, data, parts=2)
    monkeypatch.setattr(registry, "embedded_models", lambda: {entry.name: entry})
    llm = LLM("tiny-test", progress=False)
    assert llm.target.gguf == home / "gguf" / "tiny-test.gguf"
    assert isinstance(llm.target.model.lm_head, QLinear)
    assert not (home / "models").exists()


def test_draft_models_by_name_follow_the_rule_and_speculation_stays_exact(tmp_path):
    path = quantized_file(tmp_path, "llama", tied=True)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), progress=False, speculative_config=spec)
    draft = llm.models.draft_model(str(path), None)
    assert draft is llm.models.draft_model(str(path), "gguf") and draft.gguf is not None  # one load for both names
    assert isinstance(draft.model.lm_head, QLinear)
    plain = [o.outputs[0].token_ids for o in llm.generate(["Hello world"], GREEDY, num_speculative_tokens=0)]
    assert [o.outputs[0].token_ids for o in llm.generate(["Hello world"], GREEDY)] == plain
    bf16 = LLM(str(path), dtype="bfloat16", progress=False, speculative_config=spec)
    assert bf16.models.draft_model(str(path), None).gguf is None
    assert not isinstance(bf16.models.draft_model(str(path), None).model.lm_head, QLinear)


def test_weights_read_from_the_file_as_the_converted_directory_stores_them(tmp_path):
    path = quantized_file(tmp_path, "qwen2", tied=False)
    target = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    converted = hub.resolve_model(str(path), progress=False)
    for names in (("model.embed_tokens.weight",), ("lm_head.weight",), ("x", "model.norm.weight")):
        got, want = target.weight(names), hf.read_weight(converted, names)
        assert got.dtype == want.dtype and torch.equal(got, want), names
    assert target.hf_dir() == converted


def test_linear_of_names_the_fused_linear_holding_a_weights_rows():
    assert linear_of("model.layers.3.self_attn.k_proj.weight") == "layers.3.self_attn.qkv_proj"
    assert linear_of("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.gate_up_proj"
    assert linear_of("model.layers.1.mlp.experts.7.gate_proj.weight") == "layers.1.mlp.experts.7.gate_up_proj"
    assert linear_of("model.layers.2.linear_attn.in_proj_z.weight") == "layers.2.linear_attn.in_proj"
    assert linear_of("model.layers.0.self_attn.o_proj.weight") == "layers.0.self_attn.o_proj"
    assert linear_of("lm_head.weight") == "lm_head"
    assert linear_of("model.embed_tokens.weight") is None and linear_of("model.layers.0.self_attn.q_proj.bias") is None


def test_server_tokenizer_copy_is_a_separate_equal_tokenizer(tmp_path):
    path = quantized_file(tmp_path, "llama", tied=True)
    tok = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf").tokenizer
    other = tok.copy()
    assert other.hf is not tok.hf and other.encode("Hello world") == tok.encode("Hello world")
    assert other.eos_token_ids == tok.eos_token_ids and other.chat_template == tok.chat_template
    np.testing.assert_array_equal(other.encode("<|im_start|>Hello"), tok.encode("<|im_start|>Hello"))


def test_the_cli_runs_a_gguf_files_own_blocks_unless_given_a_dtype(tmp_path, home, capsys):
    from specdec import cli
    path = quantized_file(tmp_path, "llama", tied=True)
    args = ["generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos"]
    assert cli.main(args) == 0
    assert f"{path}: the file's own blocks (Q8_0 x 7, Q4_0 x 7, Q5_0 x 1; F32 x 5 as bf16)" in capsys.readouterr().err
    assert not (home / "models").exists()
    assert cli.main([*args, "--dtype", "bfloat16"]) == 0
    assert f"{path}: bf16, dequantized (loaded in " in capsys.readouterr().err
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "--model", "m"]).dtype is None  # unset: the default, not an asked-for bf16


def test_the_server_serves_a_gguf_file_in_its_own_blocks(tmp_path, home):
    from fastapi.testclient import TestClient

    from specdec import cli
    from specdec.server.app import build_app
    path = quantized_file(tmp_path, "llama", tied=True)
    app, llm, _ = build_app(cli.build_parser().parse_args(["serve", "--model", str(path)]))
    assert llm.target.gguf is not None and not (home / "models").exists()
    want = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0].text
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": str(path), "prompt": "Hello", "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_the_tokenizer_files_are_written_once_per_file(tmp_path, home, monkeypatch):
    """Building the tokenizer from a GGUF file's metadata takes seconds (Qwen2.5's vocabulary: 2-4 s of a
    12 s load): the files are written once into $SPECDEC_HOME/gguf-files and read from there on the next
    load, the same tokenizer; a changed file (its modification time) gets them written again, and its old ones
    go (another file's stay)."""
    from specdec.formats import gguf_model

    path = quantized_file(tmp_path, "qwen2", tied=False)
    first = LLM(model=str(path), progress=False)
    dirs = list((home / "gguf-files").iterdir())
    assert len(dirs) == 1 and (dirs[0] / "tokenizer.json").is_file()
    calls = []
    real = gguf_model.write_model_files
    monkeypatch.setattr(gguf_model, "write_model_files", lambda *a: calls.append(a) or real(*a))
    again = LLM(model=str(path), progress=False)
    assert not calls and again.tokenizer.encode("hello world 2024") == first.tokenizer.encode("hello world 2024")
    other = tmp_path / "elsewhere" / path.name  # the same name in another directory: another file
    other.parent.mkdir()
    shutil.copy(path, other)
    LLM(model=str(other), progress=False)
    assert len(calls) == 1 and len(list((home / "gguf-files").iterdir())) == 2
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    LLM(model=str(path), progress=False)
    now = sorted((home / "gguf-files").iterdir())
    assert len(calls) == 2 and len(now) == 2 and dirs[0] not in now  # the changed file's old entry replaced
    assert sorted((d / "source").read_text() for d in now) == sorted([str(path.resolve()), str(other.resolve())])


@pytest.mark.skipif(not hugepages.available(), reason="transparent huge pages are off here")
@pytest.mark.usefixtures("native_kernels")
def test_the_files_blocks_are_laid_straight_onto_huge_pages(tmp_path, monkeypatch):
    """The tiles repacked from the file's map go straight into one huge-page arena (not into the heap, then
    copied there by rehome: 2.5 s of the 1.5B's load), and the model gives the same logits as the copied way."""
    path = quantized_file(tmp_path, "qwen2", tied=False)
    monkeypatch.setattr(hugepages, "HUGE", 4096)  # the tiny file's tiles are far below 2 MB
    moved, rehome = [], hugepages.rehome
    monkeypatch.setattr(hugepages, "rehome", lambda module: moved.append(rehome(module)) or moved[-1])
    ours = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    weights = [m.qweight for m in ours.model.modules() if isinstance(m, QLinear)]
    assert weights and all(hugepages.in_arena(w.data) and hugepages.in_arena(w.scales) for w in weights)
    assert moved == [0]  # every linear a block type: nothing left to copy
    monkeypatch.setattr(hugepages, "arena", lambda nbytes: None)  # the heap, then rehome's copy
    before = LoadedModel(str(path), torch.bfloat16, CPU, progress=False, quantization="gguf")
    assert moved[1] > 0
    assert torch.equal(logits_of(ours.model, [1, 5, 9, 2]), logits_of(before.model, [1, 5, 9, 2]))


def test_a_gguf_files_tokenizer_loads_as_written_and_equals_its_models_class(tmp_path, home):
    """A GGUF file's tokenizer files are loaded as written by transformers' generic fast backend, not rebuilt
    by the model's own class (AutoTokenizer: Qwen2's rebuilds its pipeline from the vocabulary and merges in
    Python, 2.3 s against 0.6 s for Qwen2.5's real file): the same ids with and without special tokens, the
    same texts back and the same chat template on every text tried."""
    import transformers

    path = quantized_file(tmp_path, "qwen2", tied=False)
    ours = LLM(model=str(path), progress=False).tokenizer
    files = next((home / "gguf-files").iterdir())
    assert type(ours.hf) is not type(transformers.AutoTokenizer.from_pretrained(str(files)))
    assert isinstance(ours.hf, transformers.PreTrainedTokenizerFast)
    assert_same_tokenizer(ours.hf, transformers.AutoTokenizer.from_pretrained(str(files)))

