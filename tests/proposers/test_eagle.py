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


def test_prefix_caching_keeps_the_heads_keys_and_reads_every_position_it_lacks(dirs):
    """A prompt whose prefix an earlier request left in the target's and the head's prefix caches: the
    target skips that prefill, the head reads the hidden states of the rest only, and drafts (and
    accepts) exactly as on the first run. A prefix only the target holds (left by plain decoding) is
    prefilled again, so the head reads every position."""
    target, head = dirs
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    llm.runner.prefill_chunk = 32
    rec = Recording(llm.proposer)
    llm.proposer = rec
    ids = list(range(3, 140))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate([ids + [7]], params, num_speculative_tokens=0)[0].outputs[0].token_ids

    def run(prompt):
        rec.seen.clear()
        out = llm.generate([prompt], params)[0]
        return out.outputs[0].token_ids, out.metrics.num_accepted_tokens, rec.seen[0][0]

    hits = llm.runner.cache.hits
    first = run(ids + [7])  # the target's cache holds the prompt (plain run), the head's nothing
    assert first[0] == want and first[2] == 0 and llm.runner.cache.hits == hits
    again = run(ids + [7])
    assert again[0] == want and again[2] == 128  # 4 chunks of 32 from both caches
    assert again[1] == first[1]
    assert llm.runner.cache.hits == hits + 128 and rec.cache.hits >= 128
    other = run(ids[:100] + [9, 9, 9])  # shares 96 positions with the first prompt
    assert other[2] == 96
    assert other[0] == llm.generate([ids[:100] + [9, 9, 9]], params, num_speculative_tokens=0)[0].outputs[0].token_ids
