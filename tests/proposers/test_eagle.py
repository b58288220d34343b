"""The eagle proposer: it reads exactly the target's hidden states, position by position, with the
token that follows each; clear errors for a missing or mismatched head. (Losslessness: the shared
suites, tests/proposers/test_lossless_suite.py and test_distribution.py.)"""
from __future__ import annotations

import pytest
import torch

from conftest import make_eagle_head_dir, make_model_dir
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.proposers.eagle import EagleProposer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_model_dir(root / "t", layers=4, hidden=64, seed=0)
    return target, make_eagle_head_dir(root / "head", target)


class Recording(EagleProposer):
    """Snapshots what the head is about to read at each propose call."""

    def __init__(self, inner: EagleProposer) -> None:
        super().__init__(inner.head, inner.embed, inner.confidence_threshold)
        self.seen: list[tuple[int, torch.Tensor, list[int]]] = []

    def propose(self, seqs, ks):
        for s in seqs:
            p = self.pending[s.row]
            if p.tokens:
                self.seen.append((p.start, torch.cat(p.feats).clone(), list(p.tokens)))
        return super().propose(seqs, ks)


@pytest.mark.parametrize("chunk", [512, 4], ids=["one-chunk", "chunked-prefill"])
def test_the_head_reads_the_targets_hidden_states_in_order(dirs, chunk):
    target, head = dirs
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    llm.runner.prefill_chunk = chunk
    rec = Recording(llm.proposer)
    llm.proposer = rec
    prompt = "def fibonacci(n): return fibonacci(n - 1)"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                    ignore_eos=True), num_speculative_tokens=0)[0].outputs[0].token_ids
    tokens = llm.tokenizer.encode(prompt) + out.outputs[0].token_ids
    model = llm.target.model
    with torch.inference_mode():
        ref = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)),
                    hidden_layers=rec.hidden_layers)
    want = torch.cat([ref.hidden[i] for i in rec.layers], dim=-1)[0]  # (N, 3C)
    assert rec.seen and rec.seen[0][0] == 0
    covered = 0
    for start, feats, toks in rec.seen:
        n = len(toks)
        assert start == covered  # every position read once, in order
        assert toks == tokens[start + 1:start + 1 + n]
        torch.testing.assert_close(feats, want[start:start + n], rtol=1e-4, atol=1e-4)
        covered = start + n
    assert covered >= len(tokens) - 4


def test_no_head_for_the_model_is_one_clear_error(dirs):
    with pytest.raises(SpecdecError, match="no trained EAGLE head ships"):
        LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config={"method": "eagle"})


def test_a_head_for_another_model_is_one_clear_error(dirs, tmp_path):
    other = make_model_dir(tmp_path / "other", layers=2, hidden=32, seed=1)
    with pytest.raises(SpecdecError, match="made for another model"):
        LLM(model=str(other), dtype="float32", progress=False,
            speculative_config={"method": "eagle", "model": str(dirs[1])})
    with pytest.raises(SpecdecError, match="not an EAGLE-3 head directory"):
        LLM(model=str(other), dtype="float32", progress=False,
            speculative_config={"method": "eagle", "model": str(tmp_path)})
