"""ModelRunner's prefill: a prompt identical to one in flight maps that row's blocks instead of being
computed again, bit for bit what its own prefill writes, and never from a row that moved on."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.runner import ModelRunner
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


@pytest.mark.parametrize("native", [True, False])
def test_a_grouped_prefill_of_a_long_windowed_prompt_frees_no_key_a_chunk_of_it_still_needs(tmp_path, native):
    """Issue 59 (1): a grouped prefill maps every chunk of a forward (up to 512 tokens) before any computes, and a
    later chunk's mapping freed the windowed blocks the earlier chunks of the same forward still wrote and read
    (their keys went to the null block, or to a block another chunk took). Gemma 3, window 16, a 400-token
    prompt in chunks of 32, natively and on the PyTorch path: the grouped prefill leaves the logits and cache a
    chunk-by-chunk prefill leaves, bit for bit, close to transformers' fp32, and the windowed null block zero."""
    from family_util import family_dir, reference
    from specdec.formats.hf import load_model_config, load_state_dict
    from specdec.models.llama import build_model

    if native:
        from native_util import require_native
        require_native()
    path = family_dir(tmp_path, "gemma3", max_position_embeddings=1024)
    cfg = load_model_config(path)
    ids = torch.randint(0, cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = reference(path)(torch.tensor([ids])).logits[0, -1]  # (V,)
    got = []
    for grouped in (True, False):
        model = build_model(cfg, load_state_dict(path, torch.bfloat16), dtype=torch.bfloat16)
        assert model.make_native() if native else model.native is None
        runner = ModelRunner(model, prefill_chunk=32)
        runner.ensure_cache(1, 448)
        if grouped:
            runner.prefill(0, ids[:-1])  # 399 tokens: a forward of 16 chunks, then one of the rest
        else:
            for lo in range(0, len(ids) - 1, 32):
                runner.prefill(0, ids[lo:min(lo + 32, len(ids) - 1)], start=lo)
        logits = runner.forward(torch.tensor([ids[-1:]]), torch.tensor([[len(ids) - 1]]), None).logits[0, -1]
        assert runner.cache.local.k[:, 0].eq(0).all() and runner.cache.local.v[:, 0].eq(0).all()  # the null block
        got.append((logits, row_kv(runner.cache.local, 0, len(ids))[..., len(ids) - 16 - 128:, :]))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert ((got[0][0].float() - want).abs().max() / want.abs().max()).item() < 0.02


def test_prefix_caching_keeps_the_windowed_keys_within_their_budget():
    """Issue 59 (5): the windowed group's pool was sized for every row's whole context, and its registered blocks
    were taken again only once every never-used block was, so under prefix caching the windowed layers' memory grew
    to the full context's (Gemma 3, a cache for 4,096 positions: 128 windowed blocks written against the 39 of
    ``Transformer.window_bytes``). 24 distinct 300-token prompts, half sharing their first 128 tokens: the windowed
    blocks written stay within the budget, prefixes are still reused, and each prompt's next logits are a fresh
    prefill's."""
    from family_util import family_config
    from specdec.models.llama import build_model

    cfg = family_config("gemma3", max_position_embeddings=4096)
    runners = []
    for _ in range(2):  # one reusing cached prefixes, one prefilling every prompt whole
        model = build_model(cfg, dtype=torch.bfloat16, seed=3)
        model.make_native()
        runners.append(ModelRunner(model, prefill_chunk=32))
        runners[-1].ensure_cache(1, 4096)
    cached, fresh = runners
    gen = torch.Generator().manual_seed(0)
    common = torch.randint(0, cfg.vocab_size, (128,), generator=gen).tolist()
    for i in range(24):
        ids = ((common if i % 2 else []) + torch.randint(0, cfg.vocab_size, (300,), generator=gen).tolist())[:300]
        logits = []
        for runner in runners:
            n = runner.reuse_prefix(0, ids[:-1]) if runner is cached else 0
            runner.prefill(0, ids[n:-1], start=n)
            runner.offer_prefix(0, ids[:-1])
            logits.append(runner.forward(torch.tensor([ids[-1:]]), torch.tensor([[299]]), None).logits)
            runner.cache.free(0)
        assert torch.equal(*logits), i
    local, model = cached.cache.local, cached.model
    budget = model.window_bytes(4096) // model.block_bytes(windowed=True)  # one row's windowed blocks
    written = local.k[:, 1:].ne(0).flatten(2).any(-1).any(0).sum().item()  # blocks ever written (block 0 is null)
    assert cached.cache.hits > 0 and 0 < written <= budget < 4096 // 32
