"""The engine thread, load-aware draft lengths, Engine.cancel and request validation, without HTTP."""
from __future__ import annotations

import asyncio

import pytest

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, SpeculativeOptions,
                                     parse_request, sampling_params, speculative_cap)
from specdec.server.scheduler import LoadAwareK, Scheduler
from specdec.spec.adaptive import FixedK


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                   "num_speculative_tokens": 4})


def test_load_aware_k_shrinks_with_the_batch_and_switches_off(llm):
    policy = LoadAwareK(FixedK(5), spec_max_batch=4, rows_budget=16)
    assert [policy.cap(b) for b in (1, 2, 3, 4, 5, 16)] == [15, 7, 4, 3, 0, 0]
    seq = llm._sequence("Hello", SamplingParams(max_tokens=4))
    assert [policy.k_for(seq, b) for b in (1, 2, 4, 5)] == [5, 5, 3, 0]
    seq.num_speculative_tokens = 1
    assert policy.k_for(seq, 1) == 1


def test_engine_cancel_frees_the_row_and_the_proposer_state(llm):
    cache = llm.runner.ensure_cache(2, 64)
    llm.proposer.prepare(cache.rows, cache.max_len)
    engine = Engine(llm.runner, llm.proposer, FixedK(4))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    a, b = llm._sequence("Hello", params), llm._sequence("def fibonacci(n):", params)
    engine.add(a)
    engine.add(b)
    engine.step()
    engine.cancel(a)
    assert a.finish_reason == "abort" and engine.running == [b] and a.row not in llm.proposer.valid
    assert engine.free_rows() == [a.row]
    c = llm._sequence("Hello", params)
    engine.add(c)  # takes the freed row
    while engine.running:
        engine.step()
    alone = llm.generate("Hello", params)[0].outputs[0].token_ids
    assert c.output_ids == alone and b.finish_reason == "length"


def test_scheduler_streams_and_cancels(llm):
    metrics = ServerMetrics()
    sched = Scheduler(llm, metrics, max_batch_size=2, spec_max_batch=1)
    sched.start()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=("never",))

    async def run() -> tuple[list[str], list[str], str | None]:
        loop = asyncio.get_running_loop()
        seqs = [llm._sequence(p, params) for p in ("Hello", "The quick", "import os")]
        handle = sched.submit(seqs, loop)  # three choices, two rows: one waits
        texts = ["", "", ""]
        async for ev in handle.events():
            texts[ev.index] += ev.text
        long = sched.submit([llm._sequence("Hello", params.replace(max_tokens=200))], loop)
        async for _ in long.events():
            sched.cancel(long)  # after its first tokens
        return texts, [s.text for s in seqs], long.seqs[0].finish_reason

    try:
        texts, full, reason = asyncio.run(run())
    finally:
        sched.stop()
    assert texts == full and reason == "abort"
    assert [llm.generate(p, params)[0].outputs[0].text for p in ("Hello", "The quick", "import os")] == full
    assert metrics.registry.get_sample_value("specdec:num_requests_running") == 0 and not sched.engine.running


def test_parse_request_and_sampling_limits():
    req = parse_request(CompletionRequest, b'{"model": "m", "prompt": "hi", "max_tokens": 5, "stop": "x"}')
    sp = sampling_params(req, prompt_len=10, max_model_len=64, seed=3)
    assert (sp.max_tokens, sp.stop, sp.seed, sp.temperature) == (5, ("x",), 3, 1.0)
    chat = parse_request(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert sampling_params(chat, prompt_len=10, max_model_len=64, seed=None).max_tokens == 54
    for body, word in ((b'{"model": "m", "prompt": "hi", "x": 1, "y": 2}', "x, y"),
                       (b'{"model": "m", "prompt": "hi", "max_tokens": true}', "max_tokens"),
                       (b'{"model": "m", "prompt": "hi", "logprobs": 2}', "logprobs")):
        with pytest.raises(APIError, match=word):
            parse_request(CompletionRequest, body)
    with pytest.raises(APIError, match="context length"):
        sampling_params(req, prompt_len=60, max_model_len=64, seed=None)


def test_speculative_cap():
    assert speculative_cap(None, "draft_model", 4) is None
    assert speculative_cap(SpeculativeOptions(enabled=False), "draft_model", 4) == 0
    assert speculative_cap(SpeculativeOptions(num_speculative_tokens=2), "draft_model", 4) == 2
    assert speculative_cap(SpeculativeOptions(num_speculative_tokens=9), "draft_model", 4) is None
    assert speculative_cap(SpeculativeOptions(enabled=True, method="draft_model"), "draft_model", 4) is None
    with pytest.raises(APIError, match="ngram"):
        speculative_cap(SpeculativeOptions(method="ngram"), "draft_model", 4)
    assert speculative_cap(SpeculativeOptions(enabled=True), None, 0) == 0
