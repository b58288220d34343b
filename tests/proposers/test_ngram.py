"""The n-gram matcher on small arrays, and the n-gram proposer's exactness on a tiny model."""
from __future__ import annotations


import numpy as np
import pytest

from conftest import make_model_dir
from specdec import LLM, SamplingParams, SpecdecError
from specdec.proposers.ngram import ngram_lookup


def a(*xs):
    return np.array(xs, dtype=np.int64)


def test_longest_suffix_wins_and_latest_occurrence_is_used():
    #              0  1  2  3  4  5  6  7  8  9 10
    toks = a(1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3)
    # suffix (2, 3) occurs at 1 and 5: the latest (5) is followed by 7, 5
    assert ngram_lookup(toks, 1, 4, 2).tolist() == [7, 5]
    # min_n = max_n = 1: suffix (3,) latest earlier at 6 -> 7, 5, 2
    assert ngram_lookup(toks, 1, 1, 3).tolist() == [7, 5, 2]
    # a 3-gram (1, 2, 3) in the middle: suffix 'x 1 2 3' style
    toks = a(1, 2, 3, 4, 8, 8, 2, 3, 5, 1, 2, 3)
    assert ngram_lookup(toks, 1, 3, 2).tolist() == [4, 8]  # (1,2,3) beats the later (2,3)->5


def test_no_match_gives_empty_and_k_caps_length():
    assert ngram_lookup(a(1, 2, 3, 4), 1, 3, 5).tolist() == []
    assert ngram_lookup(a(5, 6, 5), 1, 3, 5).tolist() == [6, 5]
    assert ngram_lookup(a(5, 6, 5), 1, 3, 1).tolist() == [6]
    assert ngram_lookup(a(5, 6, 5), 2, 3, 4).tolist() == []  # needs a 2-gram match
    assert ngram_lookup(a(5), 1, 3, 4).tolist() == []
    assert ngram_lookup(a(5, 5), 1, 3, 0).tolist() == []
    # the match may run up to the end of the array, proposing fewer than k
    assert ngram_lookup(a(7, 7, 7, 7), 1, 2, 5).tolist() == [7]


def test_repeated_text_proposes_its_continuation():
    toks = np.arange(50) % 10  # 0..9 repeated
    assert ngram_lookup(toks, 2, 4, 6).tolist() == [0, 1, 2, 3, 4, 5]


def test_long_contexts_without_matches_propose_nothing():
    # its speed is measured by `python -m specdec.tools.bench.runtime` (ngram_lookup_16k_seconds)
    toks = np.arange(16_000) * 7 % 150_001  # no repeated token
    assert ngram_lookup(toks, 1, 4, 5).size == 0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("ng") / "t", layers=2, hidden=64)


PROMPTS = ["def fibonacci(n): fibonacci(n): fibonacci(n):", "The quick brown fox The quick brown", "Hello"]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_greedy_equals_plain(target, k, batch):
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:batch], p, num_speculative_tokens=0)]
    outs = llm.generate(PROMPTS[:batch], p)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # random models repeat themselves


@pytest.mark.parametrize("opts,match", [
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"lookahead": 2}, r"unknown option\(s\) for speculative method 'ngram': lookahead"),
    ({"model": "x"}, r"unknown option\(s\) for speculative method 'ngram': model"),
])
def test_bad_ngram_config(target, opts, match):
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(target), dtype="float32", progress=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, **opts})
