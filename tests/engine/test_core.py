"""The engine core: admission, abort, cache sizing from the proposer's lookahead, state lifetimes."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.core import EngineCore
from specdec.engine.policies import AdaptiveK, FixedK, make_policy
from fault_util import FaultyProposer


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4})


def test_abort_frees_the_row_and_the_proposer_state(llm):
    core = llm.engine(max_num_seqs=2)
    a, b = llm.make_sequence("Hello", greedy(30)), llm.make_sequence("def fibonacci(n):", greedy(30))
    core.add(a)
    core.add(b)
    core.step()
    core.abort(a)
    assert a.finish_reason == "abort" and core.running == [b] and a.row not in llm.proposer.valid
    c = llm.make_sequence("Hello", greedy(30))
    core.add(c)
    core.step()
    assert c.row == a.row  # the freed row
    while core.has_work():
        core.step()
    alone = llm.generate("Hello", greedy(30))[0].outputs[0].token_ids
    assert c.output_ids == alone and b.finish_reason == "length"


def test_a_step_admitting_many_requests_sums_the_held_blocks_once(llm, monkeypatch):
    """Admitting n waiting requests asks for each held request's blocks O(n) times in all: summing them
    again before every admission made a step over thousands of waiting requests quadratic (seconds of
    Python per step in the sampling tests)."""
    from specdec.runtime.kv_cache import KVCache
    n, calls = 120, []
    core = llm.engine(max_num_seqs=n)
    seqs = [llm.make_sequence("Hello", greedy(40)) for _ in range(n)]
    for s in seqs:
        core.add(s)
    real = KVCache.blocks_needed
    monkeypatch.setattr(KVCache, "blocks_needed", lambda self, row, *a: calls.append(row) or real(self, row, *a))
    core.step()
    assert not core.waiting and len(core.running) == n
    assert len(calls) < 4 * n, f"{len(calls)} block counts for {n} admissions"
    while core.has_work():
        core.step()
    alone = llm.generate("Hello", greedy(40))[0].outputs[0].token_ids
    assert all(s.output_ids == alone for s in seqs)


def test_abort_of_a_waiting_request_never_admits_it(llm):
    core = llm.engine(max_num_seqs=1)
    a, b = llm.make_sequence("Hello", greedy(3)), llm.make_sequence("Hello", greedy(3))
    core.add(a)
    core.add(b)
    core.abort(b)
    while core.has_work():
        core.step()
    assert b.finish_reason == "abort" and b.output_ids == [] and a.finish_reason == "length"


def test_caches_are_sized_from_each_request_and_grow_keeping_running_rows(llm):
    """A request needing more slots than the cache holds joins while another runs: the caches of the
    target and of the draft grow, and the running request's output is unchanged."""
    llm.runner.cache = None
    llm.proposer.runner.cache = None
    core = llm.engine(max_num_seqs=2)
    short, long = llm.make_sequence("Hello", greedy(6)), llm.make_sequence("The quick brown", greedy(60))
    core.add(short)
    core.step()
    first = llm.runner.cache.max_len
    assert first >= core.slots_needed(short) and first < core.slots_needed(long)
    core.add(long)
    while core.has_work():
        core.step()
    assert llm.runner.cache.max_len >= core.slots_needed(long)
    assert llm.proposer.runner.cache.max_len >= core.slots_needed(long)
    want = [o.outputs[0].token_ids for o in llm.generate(["Hello", "The quick brown"], [greedy(6), greedy(60)],
                                                         num_speculative_tokens=0)]
    assert [short.output_ids, long.output_ids] == want


def test_slots_count_the_draft_block_and_the_proposers_lookahead(tiny_model_dir):
    cfg = {"method": "cascade", "model": str(tiny_model_dir), "stage_tokens": 2, "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False, speculative_config=cfg)
    seq = llm.make_sequence("Hello", greedy(10))
    n = len(seq.prompt_ids) + 10
    assert llm.engine().slots_needed(seq) == n + 3 + 1 + (2 + 1)  # K + 1, then the n-gram stage's K + 1
    assert llm.engine(num_speculative_tokens=0).slots_needed(seq) == n + 1


def test_policy_state_lives_as_long_as_the_request(llm):
    core = EngineCore(llm.runner, llm.proposer, make_policy(4, adaptive=True), max_num_seqs=2)
    a, b = llm.make_sequence("Hello", greedy(4)), llm.make_sequence("import os", greedy(40))
    core.add(a)
    core.add(b)
    seen_a = False
    while core.has_work():
        core.step()
        seen_a |= a.request_id in core.policy.rows
        if a.finished:
            assert a.request_id not in core.policy.rows  # forgotten when it finished...
        if not b.finished:
            assert b.request_id in core.policy.rows or b.num_steps == 0  # ...never earlier
    assert seen_a and core.policy.rows == {}


def test_plain_core_needs_no_proposer(llm):
    core = EngineCore(llm.runner, None, FixedK(0))
    s = llm.make_sequence("Hello", greedy(5))
    core.add(s)
    while core.has_work():
        core.step()
    assert s.output_ids == llm.generate("Hello", greedy(5), num_speculative_tokens=0)[0].outputs[0].token_ids
    assert s.num_draft == 0 and isinstance(make_policy(2, True), AdaptiveK)


def long_context_model(root) -> str:
    """The tiny model with a 4096-token context (its config raised after it is written)."""
    import json

    from conftest import make_model_dir
    d = make_model_dir(root)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
    return str(d)


def test_chunked_prefill_interleaves_decode_steps_and_keeps_outputs_identical(tmp_path):
    """Head of line: 4 short streams decode while a 3000-token prompt arrives; with a prefill budget of
    one 512-token chunk per step, every short stream gains tokens on every step of that prefill, and
    every output equals the one of a whole-prompt prefill (and of plain decoding)."""
    model = long_context_model(tmp_path / "long")
    llm = LLM(model=model, dtype="float32", progress=False, max_num_seqs=5,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    long_ids = [(7 * i + 3) % 390 + 3 for i in range(3000)]
    shorts = ["Hello", "The quick", "import os", "def fibonacci(n):"]
    core = llm.engine(max_prefill_tokens=512)
    seqs = [llm.make_sequence(p, greedy(60)) for p in shorts]
    for s in seqs:
        core.add(s)
    core.step()
    core.step()
    long = llm.make_sequence(long_ids, greedy(8))
    core.add(long)
    prefill_steps = 0
    while not long.output_ids:
        before = [len(s.output_ids) for s in seqs]
        core.step()
        prefill_steps += 1
        assert all(len(s.output_ids) > b or s.finished for s, b in zip(seqs, before))  # nobody stalls
    assert prefill_steps == -(-2999 // 512)  # one chunk per step, the last chunk's step also decodes
    while core.has_work():
        core.step()
    want = [o.outputs[0].token_ids for o in llm.generate(shorts + [long_ids], [greedy(60)] * 4 + [greedy(8)],
                                                         num_speculative_tokens=0)]
    assert [s.output_ids for s in seqs + [long]] == want


@pytest.mark.parametrize("where", ["add", "propose"])
def test_one_failing_request_is_dropped_alone(llm, where):
    """A proposer raising on one request's rows: the step reports it failed (admission), or the batched
    step's error comes back and ``step_each`` finds it; the others keep their rows and their exact outputs."""
    faulty = FaultyProposer(llm.proposer, where)
    core = EngineCore(llm.runner, faulty, FixedK(3), max_num_seqs=3)
    prompts = ["Hello", "The quick", "import os"]
    seqs = [llm.make_sequence(p, greedy(12)) for p in prompts]
    faulty.bad.add(seqs[1].request_id)
    for s in seqs:
        core.add(s)
    failed = []
    while core.has_work():
        result = core.step()
        failed += [s for s, _ in result.failed]
        if result.error is not None:
            stepped, bad = core.step_each()
            failed += [s for s, _ in bad]
    assert failed == [seqs[1]] and seqs[1].finish_reason == "abort"
    want = llm.generate([prompts[0], prompts[2]], greedy(12), num_speculative_tokens=0)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [o.outputs[0].token_ids for o in want]
    assert not core.prefilling and not core.running and core.num_free() == 3


def test_short_prompt_chunks_ride_the_decode_step_and_change_no_output(tmp_path):
    """Mixed batches: with chunks of at most 32 tokens (bf16), two long prompts are prefilled inside
    the running batch's decode forwards (no prefill call of their own), every short stream gains
    tokens on every step, and every output equals the one of a one-shot prefill in the same chunks."""
    model = long_context_model(tmp_path / "long")
    llm = LLM(model=model, dtype="bfloat16", progress=False, max_num_seqs=6,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.runner.prefill_chunk = 32
    longs = [[(7 * i + 3) % 390 + 3 for i in range(300)], [(5 * i + 1) % 380 + 7 for i in range(200)]]
    shorts = ["Hello", "The quick", "import os", "def fibonacci(n):"]
    core = llm.engine(max_prefill_tokens=64)  # two 32-token chunks per step
    calls = []
    prefill = llm.runner.prefill
    llm.runner.prefill = lambda *a, **k: calls.append(a) or prefill(*a, **k)
    seqs = [llm.make_sequence(p, greedy(40)) for p in shorts]
    for s in seqs:
        core.add(s)
    core.step()
    n_short = len(calls)
    core.step()
    long = [llm.make_sequence(ids, greedy(8)) for ids in longs]
    for s in long:
        core.add(s)
    steps = 0
    while not all(s.output_ids for s in long):
        before = [len(s.output_ids) for s in seqs]
        core.step()
        steps += 1
        assert all(len(s.output_ids) > b or s.finished for s, b in zip(seqs, before))  # nobody stalls
    assert len(calls) == n_short == 4  # the short prompts were prefilled alone (nothing running yet)
    # oldest first, 64 tokens a step (the native path cuts prompts anywhere: the second prompt's first 21
    # tokens ride beside the first one's last 43); a prompt done decodes from the next step
    assert steps == -(-(299 + 199) // 64) + 1
    while core.has_work():
        core.step()
    llm.runner.prefill = prefill
    want = [o.outputs[0].token_ids for o in llm.generate(shorts + longs, [greedy(40)] * 4 + [greedy(8)] * 2,
                                                         num_speculative_tokens=0)]
    assert [s.output_ids for s in seqs + long] == want


@pytest.mark.parametrize("chunk", [32, 48])
def test_a_prefix_hit_gives_the_output_of_a_whole_prefill(tiny_model_dir, chunk):
    """bf16: a prompt whose cached prefix is not prefilled again decodes exactly as with no prefix
    cache (the reused blocks and the rest's chunks are those of a whole prefill); two requests
    sharing prefix blocks and diverging each write their own copies."""
    ids = list(range(3, 140))
    prompts = [ids + [200, 201], ids + [300], ids[:70] + [5, 6, 7]]

    def run(prefix_caching):
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", progress=False, enable_prefix_caching=prefix_caching)
        llm.runner.prefill_chunk = chunk
        first = llm.generate([ids], greedy(12))  # fills the prefix cache
        out = llm.generate(prompts, greedy(12))  # in one batch: shared blocks, then diverging writes
        return [o.outputs[0].token_ids for o in first + out], llm.runner.cache

    (got, cache), (want, plain) = run(True), run(False)
    assert got == want
    # the first run offered its whole chunks (128 / 96 positions); the prompts reuse them, cut to chunks
    assert cache.hits == {32: 128 + 128 + 64, 48: 96 + 96 + 48}[chunk]
    assert plain.hits == 0


def test_a_small_pool_preempts_by_recompute_and_every_request_finishes(tiny_model_dir):
    """A pool of 12 blocks for 3 requests that need 5 each at the end: the youngest is preempted
    (its blocks freed, its tokens kept and prefilled again) instead of any request failing; greedy
    outputs are those of a pool with room for all (fp32: prefilled or decoded, the same keys)."""
    prompts = ["Hello", "The quick brown", "import os"]
    params = greedy(120).replace(prompt_logprobs=1)  # a re-prefill must not add them twice
    want = LLM(model=str(tiny_model_dir), dtype="float32", progress=False).generate(prompts, params)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False, kv_cache_memory=str(12 * 16384))  # 16 kB blocks
    assert llm.runner.num_blocks == 12
    core = llm.engine(num_speculative_tokens=0)
    seqs = [llm.make_sequence(p, params) for p in prompts]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    assert core.num_preemptions > 0
    assert [s.output_ids for s in seqs] == [o.outputs[0].token_ids for o in want]
    assert [len(s.prompt_logprobs) for s in seqs] == [len(s.prompt_ids) - 1 for s in seqs]


def test_prompts_that_copy_a_shared_prefix_block_are_budgeted_and_never_fail(tiny_model_dir):
    """Would have caught copy-on-write missing from the block budget (issue 47, item 1): five prompts
    share 64 tokens with a running one, cut by 48-token chunks inside its second block, so each
    prefill copies that block first. On a pool of 12 blocks the engine counted no copy, admitted all
    five, and one request's prefill failed with NoFreeBlocks (dropped: finish reason "abort"); now the
    copies are counted, the requests wait their turn and every output is the ample pool's."""
    ids = list(range(3, 70))
    prompts = [ids + list(range(100, 150))] + [ids[:64] + [200 + 10 * i + j for j in range(5)] for i in range(5)]

    def run(num_blocks):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
                  kv_cache_memory=None if num_blocks is None else str(num_blocks * 16384))  # 16 kB blocks
        llm.runner.prefill_chunk = 48
        core = llm.engine(num_speculative_tokens=0, max_num_seqs=8)
        seqs = [llm.make_sequence(p, greedy(20)) for p in prompts]
        core.add(seqs[0])
        core.step()  # the first one runs, its prompt's blocks offered to the others
        for s in seqs[1:]:
            core.add(s)
        failed = []
        while core.has_work():
            result = core.step()
            assert result.error is None
            failed += result.failed
        return [s.output_ids for s in seqs], failed, llm.runner.cache

    want, _, _ = run(None)
    got, failed, cache = run(12)
    assert failed == [] and got == want
    assert cache.hits >= 2 * 48  # prompts did map the cut block (the others' hits may be evicted by then)
