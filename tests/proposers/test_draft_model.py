"""Draft-model speculation on tiny models: exact greedy equality, edge cases, metrics."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model_dir
from specdec import LLM, SamplingParams, SpecdecError

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nfor i in range(10):", "Hello"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_model_dir(root / "target", layers=2, hidden=64, seed=0)
    other = make_model_dir(root / "other", layers=1, hidden=32, seed=7)  # unrelated: low acceptance
    return target, other


@pytest.fixture(scope="module")
def plain(dirs):
    return LLM(model=str(dirs[0]), dtype="float32", progress=False)


def spec_llm(target, draft, k, **kw) -> LLM:
    return LLM(model=str(target), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}, **kw)


def greedy(n=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_kind", ["self", "other"])
def test_greedy_output_equals_plain_greedy(dirs, plain, k, batch, draft_kind):
    target, other = dirs
    llm = spec_llm(target, target if draft_kind == "self" else other, k)
    prompts = PROMPTS[:batch]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy())]
    outs = llm.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outs] == want
    m = outs[0].metrics
    assert m.num_draft_tokens > 0
    if draft_kind == "self":  # a draft identical to the target: everything accepted
        assert m.num_accepted_tokens == m.num_draft_tokens and m.acceptance_rate == 1.0
        assert m.mean_accepted_length > 1.0
    else:
        assert m.acceptance_rate < 0.5  # random weights rarely agree


def test_high_but_partial_acceptance_stays_exact(tmp_path, dirs, plain):
    """A draft that is the target with noise: accepts often but not always (ragged rows)."""
    from safetensors.torch import load_file, save_file
    import shutil
    noisy = tmp_path / "noisy"
    shutil.copytree(dirs[0], noisy)
    sd = load_file(str(noisy / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in sd.items()}
    save_file(sd, str(noisy / "model.safetensors"))
    llm = spec_llm(dirs[0], noisy, 4)
    outs = llm.generate(PROMPTS, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(40))]
    rates = [o.metrics.acceptance_rate for o in outs]
    assert 0.05 < sum(rates) / len(rates) < 0.98, rates
    pos = outs[0].metrics.acceptance_by_position
    assert len(pos) == 4 and all(0.0 <= r <= 1.0 for r in pos)


def test_k_longer_than_tokens_left(dirs, plain):
    llm = spec_llm(dirs[0], dirs[0], 8)
    for n in (1, 2, 3, 9):
        out = llm.generate(PROMPTS, greedy(n))
        assert [len(o.outputs[0].token_ids) for o in out] == [n] * 4
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(n))]


def test_eos_inside_an_accepted_block(dirs, plain):
    llm = spec_llm(dirs[0], dirs[0], 8)
    free = plain.generate("Hello", greedy(20))[0].outputs[0].token_ids
    eos = free[5]
    for model in (plain, llm):
        model.tokenizer.eos_token_ids.add(eos)
    try:
        p = SamplingParams(temperature=0.0, max_tokens=20)
        want = plain.generate("Hello", p)[0].outputs[0]
        got = llm.generate("Hello", p)[0].outputs[0]
        assert got.token_ids == want.token_ids == free[:free.index(eos) + 1]
        assert got.finish_reason == "stop" and got.stop_reason == eos
    finally:
        for model in (plain, llm):
            model.tokenizer.eos_token_ids.discard(eos)


def test_stop_string_inside_an_accepted_block(dirs, plain):
    llm = spec_llm(dirs[0], dirs[0], 8)
    text = plain.generate("The quick brown fox", greedy(30))[0].outputs[0].text
    stop = text[8:11]
    p = greedy(30, stop=[stop])
    want, got = plain.generate("The quick brown fox", p)[0].outputs[0], llm.generate("The quick brown fox", p)[0].outputs[0]
    assert got.text == want.text == text[:text.index(stop)]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


def test_context_limit_reached_mid_draft(dirs):
    plain = LLM(model=str(dirs[0]), dtype="float32", max_model_len=24, progress=False)
    llm = spec_llm(dirs[0], dirs[0], 8, max_model_len=24)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(100))]
    got = llm.generate(PROMPTS, greedy(100))
    assert [o.outputs[0].token_ids for o in got] == want
    for p, o in zip(PROMPTS, got):
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 24
        assert o.outputs[0].finish_reason == "length"


def test_more_requests_than_rows_with_speculation(dirs, plain):
    llm = spec_llm(dirs[0], dirs[1], 3, max_num_seqs=2)
    prompts = PROMPTS * 2
    params = [greedy(n) for n in (5, 17, 9, 30, 2, 11, 23, 7)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want


def test_metrics_and_timing_split(dirs):
    llm = spec_llm(dirs[0], dirs[0], 4)
    m = llm.generate("Hello", greedy(20))[0].metrics
    assert m.num_generated_tokens == 20
    assert m.num_accepted_tokens + m.num_steps >= 20
    assert m.draft_seconds > 0 and m.verify_seconds > 0 and m.other_seconds >= 0
    assert m.num_drafted_by_position[0] == m.num_steps or m.num_drafted_by_position[0] == m.num_steps - 1


@pytest.mark.parametrize("cfg,match", [
    ({"method": "draft_model"}, "needs 'model': the draft model"),
    ({"method": "medusa2", "model": "x"}, "unknown speculative method"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "draft_model", "model": "no-such-model"}, "unknown model"),
    ({"method": "draft_model", "model": "x", "bogus": 1}, r"unknown option\(s\) for speculative method 'draft_model': bogus"),
])
def test_bad_speculative_config(dirs, cfg, match):
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)


def test_draft_with_another_numbering_of_the_vocabulary_drafts_across_tokenizers(tmp_path, dirs, plain):
    """Two ids swapped in the draft's tokenizer: no longer the target's ids, so it drafts through the
    cross-vocabulary proposer (it was refused before), exactly."""
    import json
    odd = make_model_dir(tmp_path / "odd", layers=1, hidden=32)
    tj = json.loads((odd / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (odd / "tokenizer.json").write_text(json.dumps(tj))
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(20))]
    outs = spec_llm(dirs[0], odd, 3).generate(PROMPTS, greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_draft_stays_exact(dirs, plain, quant):
    llm = LLM(model=str(dirs[0]), dtype="bfloat16", progress=False,
              speculative_config={"model": str(dirs[0]), "num_speculative_tokens": 4, "quantization": quant})
    bf16_plain = LLM(model=str(dirs[0]), dtype="bfloat16", progress=False)
    want = [o.outputs[0].token_ids for o in bf16_plain.generate(PROMPTS, greedy(30))]
    outs = llm.generate(PROMPTS, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].metrics.num_draft_tokens > 0


def test_quantized_target_greedy_is_exact_against_its_own_plain_decoding(dirs):
    spec = LLM(model=str(dirs[0]), dtype="bfloat16", quantization="int8", progress=False,
               speculative_config={"model": str(dirs[1]), "num_speculative_tokens": 3})
    want = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(20), num_speculative_tokens=0)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(20))] == want


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_confidence_stop_stays_exact_and_drafts_less(tmp_path, dirs, plain, method):
    base = {"method": method, "num_speculative_tokens": 6}
    target = dirs[0]
    if method == "draft_model":
        base["model"] = str(dirs[1])
    else:  # layer skipping needs a deeper target
        target = make_model_dir(tmp_path / "deep", layers=4, hidden=64, seed=2)
        plain = LLM(model=str(target), dtype="float32", progress=False)
        base |= {"skip_ratio": 0.5, "search_steps": 0}
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    drafted = {}
    for thr in (0.0, 0.9):
        llm = LLM(model=str(target), dtype="float32", progress=False,
                  speculative_config=base | {"draft_confidence_threshold": thr})
        outs = llm.generate(PROMPTS, greedy(30))
        assert [o.outputs[0].token_ids for o in outs] == want
        drafted[thr] = sum(o.metrics.num_draft_tokens for o in outs)
    assert 0 < drafted[0.9] < drafted[0.0]


def test_draft_context_window_stays_exact(dirs, plain):
    """A draft that reads only the last tokens of the prompt: other drafts, same output."""
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    for context in (1, 3):
        llm = LLM(model=str(dirs[0]), dtype="float32", progress=False,
                  speculative_config={"method": "draft_model", "model": str(dirs[1]), "num_speculative_tokens": 4,
                                      "draft_context": context})
        for batch in (1, len(PROMPTS)):
            outs = llm.generate(PROMPTS[:batch], greedy(30))
            assert [o.outputs[0].token_ids for o in outs] == want[:batch]
            assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_draft_context_is_one_line(dirs, bad):
    with pytest.raises(SpecdecError, match="draft_context"):
        LLM(model=str(dirs[0]), dtype="float32", progress=False,
            speculative_config={"method": "draft_model", "model": str(dirs[1]), "draft_context": bad})


def test_a_row_joining_beside_long_paused_rows_stays_inside_the_cache(dirs):
    """Rows that did not draft for many steps lag in the draft's cache; a request joining then with
    a prompt near the context limit must not be padded past the cache while they catch up."""
    from specdec.engine.core import EngineCore
    from specdec.engine.policies import FixedK

    class Paused(FixedK):
        drafting = False

        def k_for(self, seq, batch_size):
            return self.k if self.drafting else 0

    llm = spec_llm(dirs[0], dirs[0], 3, max_model_len=64)
    policy = Paused(3)
    engine = EngineCore(llm.runner, llm.proposer, policy, max_num_seqs=2)
    engine.reserve(2, engine.slots_for(64))
    cache = llm.runner.cache
    first = llm.make_sequence("Hello", greedy(55))
    engine.add(first)
    for _ in range(45):  # plain steps: the draft model sees none of them
        engine.step()
    ids = llm.tokenizer.encode(llm.tokenizer.decode(list(range(5, 80))))[:62]
    seq = llm.make_sequence(ids, greedy(2))
    engine.add(seq)
    engine.step()
    assert seq.num_tokens - 1 + (first.num_tokens - llm.proposer.valid[first.row]) > cache.max_len
    policy.drafting = True
    while engine.has_work():
        engine.step()
    want = LLM(model=str(dirs[0]), dtype="float32", progress=False, max_model_len=64).generate(
        [ids, "Hello"], [greedy(2), greedy(55)])
    assert [seq.output_ids, first.output_ids] == [o.outputs[0].token_ids for o in want]


def test_a_hybrid_draft_model_takes_a_call_asking_a_longer_k_than_configured(tmp_path, dirs, plain):
    """Catches a hybrid draft model's state rings sized once for the configured K: a call asking K = 10 of
    an LFM2 draft configured for K = 2 drafted past its rings ("the state of row 0 at position .. is not
    kept"). Its rings are refit like the target's, and the output stays plain greedy's."""
    from family_util import family_dir

    draft = family_dir(tmp_path, "lfm2", seed=3, num_hidden_layers=2)  # the suites' tokenizer: the same ids
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    llm = spec_llm(dirs[0], draft, 2)
    assert llm.proposer.runner.model.config.layer_mixers  # a hybrid drafter, sharing the target's vocabulary
    outs = llm.generate(PROMPTS, greedy(30), num_speculative_tokens=10)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(o.metrics.num_draft_tokens > 2 * o.metrics.num_steps for o in outs)  # drafts longer than 2
