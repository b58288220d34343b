"""Frequency-ranked draft heads: the kept rows' logits are the full head's, the rest FLOOR; the ranking."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import CORPUS, make_model_dir
from specdec.errors import SpecdecError
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.quant.linear import pack_linears
from specdec.models.llama import build_model
from specdec.quant.qlinear import quantize_model
from specdec.heads.reduced_head import FLOOR, ReducedHead, reduced_logits
from specdec.heads.token_freq import count_tokens, draft_vocab, ranking
from specdec.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("fr") / "m", layers=2, hidden=64, seed=0)


def load(model_dir, dtype=torch.float32, tie=False, quant=None, pack=False):
    cfg = load_model_config(model_dir)
    if tie:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    model = build_model(cfg, load_state_dict(model_dir, dtype), dtype=dtype)
    if quant:
        quantize_model(model, quant)
    if pack:
        assert pack_linears(model) > 0
    return model


@pytest.mark.parametrize("kind", ["fp32", "bf16-packed", "tied", "int4", "int8"])
def test_kept_rows_are_the_full_heads_logits(model_dir, kind):
    dtype = torch.bfloat16 if kind == "bf16-packed" else torch.float32
    model = load(model_dir, dtype, tie=kind == "tied", quant=kind if kind.startswith("int") else None,
                 pack=kind == "bf16-packed")
    if kind == "bf16-packed" and model.lm_head.weight.numel():
        pytest.skip("this PyTorch build packs no bf16 linears")
    ids = torch.tensor([0, 3, 17, 50, 51, 52, 199, 398])
    head = ReducedHead(model, ids)
    toks = torch.tensor([[5, 9, 40, 7]])
    pos = torch.arange(4)[None]
    full = model(toks, pos, model.new_cache(1, 8)).logits  # (1, 4, V)
    small = reduced_logits(model, head, toks, pos, model.new_cache(1, 8))
    assert small.shape == full.shape
    if kind.startswith("int"):  # the quantized rows are the head's own codes: bit for bit
        assert torch.equal(small[..., ids], full[..., ids].float())
    else:  # a float product of N rows may round its last bits unlike one of V rows (BLAS blocking)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(small[..., ids], full[..., ids].float(), rtol=tol, atol=tol)
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[ids] = False
    assert bool((small[..., rest] == FLOOR).all())
    last = reduced_logits(model, head, toks, pos, model.new_cache(1, 8), at="last")
    assert torch.equal(last[:, 0], small[:, -1])


def test_draft_vocab_keeps_the_most_frequent_tokens_and_eos(model_dir, tmp_path):
    hf = Tokenizer(model_dir).hf
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(CORPUS))
    counts = count_tokens(hf, ["\n".join(CORPUS)], len(hf))
    top = ranking(counts)
    assert counts[top[0]] == counts.max() and counts[top[0]] >= counts[top[1]] >= counts[top[2]]
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    ids = draft_vocab(hf, len(hf), 20, str(corpus), always={eos})
    assert len(ids) == 20 and eos in ids.tolist() and ids.tolist() == sorted(ids.tolist())
    assert set(top[:19].tolist()) <= set(ids.tolist())
    assert counts[eos] == 0  # kept only because it is an EOS


@pytest.mark.parametrize("n,corpus,match", [(400, "c", "not below the vocabulary"), (20, None, "no shipped token ranking"),
                                            (20, "missing", "neither a file nor a directory")])
def test_draft_vocab_errors(model_dir, tmp_path, n, corpus, match):
    hf = Tokenizer(model_dir).hf
    (tmp_path / "c").write_text("hello")
    with pytest.raises(SpecdecError, match=match):
        draft_vocab(hf, len(hf), n, None if corpus is None else str(tmp_path / corpus))


def test_draft_vocab_corpus_needs_a_size(model_dir, tmp_path):
    from specdec import LLM
    with pytest.raises(SpecdecError, match="set draft_vocab_size too"):
        LLM(model=str(model_dir), dtype="float32", progress=False,
            speculative_config={"method": "draft_model", "model": str(model_dir), "draft_vocab_corpus": str(tmp_path)})


@pytest.mark.real
def test_the_shipped_ranking_covers_the_qwen_tokenizer():
    from specdec.formats.hub import resolve_model
    from specdec.heads.token_freq import shipped_ranking
    hf = Tokenizer(resolve_model("qwen2.5-coder-0.5b", progress=False)).hf
    ranked = shipped_ranking(hf)
    assert ranked is not None and len(ranked) == 65536 and len(np.unique(ranked)) == 65536
    common = hf.encode(" the", add_special_tokens=False) + hf.encode("def", add_special_tokens=False)
    assert all(i in ranked[:1000] for i in common)
