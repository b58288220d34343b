"""The medusa proposer: the greedy sparse tree on tiny accuracies; the heads read the target's final
hidden state at the position before the pending token (whose own LM head gave the pending token) and
head k drafts depth k; clear errors for missing or mismatched heads. (Losslessness: the shared
suites, tests/proposers/test_lossless_suite.py and test_distribution.py.)"""
from __future__ import annotations

import pytest
import torch

from conftest import make_medusa_head_dir, make_model_dir
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.heads.medusa import load_heads, prior_accuracies
from specdec.proposers.medusa import MedusaProposer, sparse_tree, tree_layout


def test_the_sparse_tree_adds_the_best_expected_node_whose_parent_is_in():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    # contributions: (0,) .6, (0,0) .3, (1,) .2, (1,0) .1, (0,1) .06, (1,1) .02
    assert sparse_tree(acc, 6) == [(0,), (0, 0), (1,), (1, 0), (0, 1), (1, 1)]
    assert sparse_tree(acc, 3) == [(0,), (0, 0), (1,)]
    assert sparse_tree(acc, 99) == sparse_tree(acc, 6) and sparse_tree(acc, 0) == []
    parents, depth, rank = tree_layout(((0.6, 0.2), (0.5, 0.1)), 4)
    assert (parents, depth, rank) == ([-1, 0, -1, 2], [0, 1, 0, 1], [0, 0, 1, 0])


def test_a_deep_accurate_head_grows_a_chain_and_a_flat_one_a_bush():
    assert sparse_tree([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]], 3) == [(0,), (0, 0), (0, 0, 0)]
    assert sparse_tree([[0.3, 0.3, 0.3], [0.1, 0.1, 0.1]], 3) == [(0,), (1,), (2,)]
    tree = sparse_tree(prior_accuracies(4), 20)
    assert len(tree) == 20 and all(n[:-1] in tree[:i] for i, n in enumerate(tree) if len(n) > 1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    target = make_model_dir(root / "t", layers=4, hidden=64, seed=0)
    return target, make_medusa_head_dir(root / "head", target)


class Recording(MedusaProposer):
    """Snapshots each row's tokens, state and draft at every propose call."""

    def __init__(self, inner: MedusaProposer) -> None:
        super().__init__(inner.heads, inner.lm_head, inner.row_ids)
        self.seen: list[tuple[list[int], int, torch.Tensor, list[int], list[int]]] = []

    def propose(self, seqs, ks):
        draft = super().propose(seqs, ks)
        for i, s in enumerate(seqs):
            if int(draft.num_tokens[i]):
                pos, h = self.last[s.row]
                n = int(draft.num_tokens[i])
                self.seen.append((list(s.tokens), pos, h.clone(), draft.tokens[i, :n].tolist(),
                                  draft.parents[i, :n].tolist()))
        return draft


@pytest.mark.parametrize("chunk", [512, 4], ids=["one-chunk", "chunked-prefill"])
def test_head_k_drafts_the_token_k_after_the_pending_one_from_the_state_before_it(dirs, chunk):
    target, head = dirs
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "medusa", "model": str(head), "num_speculative_tokens": 6})
    llm.runner.prefill_chunk = chunk
    rec = Recording(llm.proposer)
    llm.proposer = rec
    prompt = "def fibonacci(n): return fibonacci(n - 1)"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert out == llm.generate(prompt, params, num_speculative_tokens=0)[0].outputs[0].token_ids
    n_prompt = len(llm.tokenizer.encode(prompt))
    tokens = llm.tokenizer.encode(prompt) + out
    model = llm.target.model
    with torch.inference_mode():
        ref = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)),
                    hidden_layers=(-1,)).hidden[-1][0]  # (N, C)
    parents6, depth, rank = tree_layout(rec.acc, 6)
    assert len(rec.seen) >= 3
    for seq, pos, h, draft, parents in rec.seen:
        t = len(seq) - 2
        assert pos == t and parents == parents6[:len(draft)] and seq == tokens[:t + 2]
        torch.testing.assert_close(h, ref[t], rtol=1e-4, atol=1e-4)
        with torch.inference_mode():
            if t + 1 >= n_prompt:  # a generated pending token: the target's own head on h_t gave it
                assert int(model.lm_head(h).argmax()) == seq[t + 1]
            for j, (d, r) in enumerate(zip(depth[:len(draft)], rank)):  # node j: head d+1's (r+1)-th choice
                want = model.lm_head(rec.heads.heads[d](h)).topk(r + 1).indices[r]
                assert draft[j] == int(want), (j, d, r)


def test_untrained_heads_start_as_the_next_token_head(dirs, tmp_path):
    """Medusa's initialization (W = 0, b = 0): every head is the identity, the LM head's input unchanged."""
    from specdec.heads.medusa import MedusaHeads, init_heads

    heads = init_heads(MedusaHeads(load_heads(dirs[1]).config))
    h = torch.randn(5, 64)
    assert torch.equal(heads(h), h[:, None].expand(5, 3, 64))


@pytest.mark.parametrize("where, match", [(None, "no trained Medusa heads ship"),
                                          ("other", "made for another model"),
                                          ("empty", "not a Medusa head directory")])
def test_missing_or_mismatched_heads_are_one_clear_error(dirs, tmp_path, where, match):
    target = dirs[0] if where is None else make_model_dir(tmp_path / "other", layers=2, hidden=32, seed=1)
    cfg = {"method": "medusa"} | ({"model": str(dirs[1] if where == "other" else tmp_path)} if where else {})
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(target), dtype="float32", progress=False, speculative_config=cfg)


def test_heads_with_a_draft_vocabulary_draft_its_rows_only(dirs, tmp_path):
    """Heads saved with ``vocab`` (a training vocabulary) rank only those rows of the LM head: each node
    is the (r+1)-th best of head d+1 among them, mapped back to target ids; still lossless."""
    from specdec.heads.medusa import save_heads
    target, head = dirs
    heads = load_heads(head)
    ids = torch.arange(3, 200, 2)  # odd ids only
    heads.set_vocab(ids)
    vdir = save_heads(tmp_path / "vocab-head", heads, dtype=torch.float32)
    assert torch.equal(load_heads(vdir).vocab, ids)
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "medusa", "model": str(vdir), "num_speculative_tokens": 6})
    rec = Recording(llm.proposer)
    llm.proposer = rec
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = "def fibonacci(n): return fibonacci(n - 1)"
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == \
        llm.generate(prompt, params, num_speculative_tokens=0)[0].outputs[0].token_ids
    _, depth, rank = tree_layout(rec.acc, 6)
    lm = llm.target.model.lm_head.weight[ids]
    assert rec.seen
    for _, _, h, draft, _ in rec.seen:
        assert all(t in set(ids.tolist()) for t in draft)
        with torch.inference_mode():
            for j, (d, r) in enumerate(zip(depth[:len(draft)], rank)):
                assert draft[j] == int(ids[(rec.heads.heads[d](h) @ lm.T).topk(r + 1).indices[r]])


def test_heads_with_a_draft_vocabulary_on_a_target_without_safetensors_draft_over_its_whole_head(dirs, tmp_path,
                                                                                                  monkeypatch):
    """No rows to copy (a GGUF target): the target's own head, whose row i is token i, not the vocabulary's."""
    from specdec.heads.medusa import save_heads
    target, head = dirs
    heads = load_heads(head)
    heads.set_vocab(torch.arange(3, 200, 2))
    vdir = save_heads(tmp_path / "vocab-head", heads, dtype=torch.float32)

    def no_rows(*a):
        raise SpecdecError("no safetensors")
    from specdec.formats.loader import LoadedModel
    monkeypatch.setattr(LoadedModel, "weight", no_rows)
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "medusa", "model": str(vdir), "num_speculative_tokens": 6})
    assert llm.proposer.row_ids is None and llm.proposer.lm_head is llm.target.model.lm_head
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate("def f(x):", params)[0]
    assert out.outputs[0].token_ids == llm.generate("def f(x):", params, num_speculative_tokens=0)[0].outputs[0].token_ids


def test_a_damaged_draft_vocabulary_is_one_clear_error(dirs, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(dirs[1], bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["vocab"] = torch.tensor([1, 10 ** 9])
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(SpecdecError, match="not a list of target token ids"):
        load_heads(bad)


def test_a_constrained_rows_tree_holds_only_tokens_legal_after_their_parents(dirs):
    """Under ``[0-9]{1,30}`` every node is a digit (or EOS once a digit is kept), each the (r+1)-th best
    legal token of its head; unconstrained, the same untrained heads draft other tokens too. Greedy
    output stays plain constrained decoding's."""
    target, head = dirs
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "medusa", "model": str(head), "num_speculative_tokens": 8,
                                  "grammar_draft": False})
    rec = Recording(llm.proposer)
    llm.proposer = rec
    tok = llm.tokenizer
    prompt = "def fibonacci(n): return fibonacci(n - 1)"
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(prompt, free)
    digit = lambda t: tok.decode([t]).isdigit()  # noqa: E731
    assert any(not digit(t) for *_, draft, _ in rec.seen for t in draft)
    rec.seen.clear()
    p = SamplingParams(temperature=0.0, max_tokens=16, structured_output={"regex": "[0-9]{1,30}"})
    out = llm.generate(prompt, p)[0].outputs[0].token_ids
    assert out == llm.generate(prompt, p, num_speculative_tokens=0)[0].outputs[0].token_ids
    assert rec.seen
    eos = set(tok.eos_token_ids)
    for *_, draft, _ in rec.seen:
        assert all(digit(t) or t in eos for t in draft), [tok.decode([t]) for t in draft]
