"""ModelRunner's prefill: a prompt identical to one in flight maps that row's blocks instead of being
computed again, bit for bit what its own prefill writes, and never from a row that moved on."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.runtime.runner import ModelRunner
from kv_util import row_kv

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # ~40 tokens: a full block and a partial one


def counting(monkeypatch, runner: ModelRunner) -> list[int]:
    """Rows whose prefill ``runner`` computes (not shares)."""
    rows, real = [], runner._prefill
    monkeypatch.setattr(runner, "_prefill", lambda row, *a: rows.append(row) or real(row, *a))
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_identical_prompt_in_flight_shares_the_blocks_its_own_prefill_would_write(tiny_model_dir, monkeypatch, dtype):
    llm = LLM(model=str(tiny_model_dir), dtype=dtype, progress=False)
    runner = llm.runner
    ids = llm.tokenizer.encode(PROMPT)[:-1]
    runner.ensure_cache(4, 128)
    computed = counting(monkeypatch, runner)
    runner.prefill(0, ids)
    runner.prefill(1, ids)  # shared
    runner.prefill(2, ids[:-1])  # another prompt (a prefix of it): computed
    assert computed == [0, 2]
    assert runner.cache.blocks[1] == runner.cache.blocks[0][:len(runner.cache.blocks[1])]
    alone = LLM(model=str(tiny_model_dir), dtype=dtype, progress=False).runner
    alone.ensure_cache(1, 128)
    alone.prefill(0, ids)
    assert torch.equal(row_kv(runner.cache, 1, len(ids)), row_kv(alone.cache, 0, len(ids)))
    # either row writing past the prompt (its pending token, drafts) copies the shared block first
    before = row_kv(runner.cache, 1, len(ids)).clone()
    runner.forward(torch.tensor([[5, 6, 7]]), torch.arange(len(ids), len(ids) + 3)[None], torch.tensor([0]))
    assert torch.equal(row_kv(runner.cache, 1, len(ids)), before)
    assert runner.cache.blocks[0][-1] != runner.cache.blocks[1][-1]


def test_a_row_freed_or_rewritten_is_never_shared(tiny_model_dir, monkeypatch):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False)
    runner = llm.runner
    ids = llm.tokenizer.encode(PROMPT)[:-1]
    other = llm.tokenizer.encode("import os\nimport sys\n" * 4)[:-1]
    runner.ensure_cache(3, 128)
    computed = counting(monkeypatch, runner)
    runner.prefill(0, ids)
    runner.cache.free(0)
    runner.prefill(0, other)  # row 0 now holds another prompt
    runner.prefill(1, ids)  # computed: its source row moved on
    runner.prefill(2, other)  # shared with row 0
    assert computed == [0, 0, 1]
    assert torch.equal(row_kv(runner.cache, 2, len(other)), row_kv(runner.cache, 0, len(other)))


def test_requests_of_one_prompt_decode_as_each_alone_and_prefill_once(tiny_model_dir, monkeypatch):
    """Greedy and seeded sampled requests of one prompt in one batch, with a draft model: the target and
    the draft each prefill the prompt once, and every output is what the request gives alone."""
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False, speculative_config=spec)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(6)]
    want = [llm.generate(PROMPT, p)[0].outputs[0].token_ids for p in params]
    target, draft = counting(monkeypatch, llm.runner), counting(monkeypatch, llm.proposer.runner)
    got = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 6, params)]
    assert got == want
    assert len(target) == 1 and len(draft) == 1


def test_without_prefix_caching_every_prompt_is_prefilled(tiny_model_dir, monkeypatch):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False, enable_prefix_caching=False)
    computed = counting(monkeypatch, llm.runner)
    llm.generate([PROMPT] * 3, SamplingParams(temperature=0.0, max_tokens=2))
    assert len(computed) == 3
