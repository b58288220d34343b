"""Cascades: stage checks, and the quantized self-draft stage drafting in the target's own cache."""
from __future__ import annotations

import pytest

from conftest import make_model_dir
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
PROMPTS = ["def f(x): return x def f(x): return", "Hello Hello Hello", "a b c a b c a"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cascade")
    return make_model_dir(root / "t", layers=3, hidden=64, seed=1), make_model_dir(root / "d", layers=1, hidden=32, seed=4)


def test_self_draft_stage_shares_the_targets_cache_and_stays_exact(dirs):
    cfg = {"method": "cascade", "num_speculative_tokens": 5,
           "stages": [NGRAM, {"method": "layer_skip", "quantization": "int4"}]}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, num_speculative_tokens=0)]
    outs = llm.generate(PROMPTS, p)
    assert [o.outputs[0].token_ids for o in outs] == want
    prop = llm.proposer
    assert prop.runner.cache is llm.runner.cache  # no cache (and no prefill) of its own
    assert prop.runner.model.embed_tokens is llm.target.model.embed_tokens
    m = [o.metrics for o in outs]
    assert sum(x.num_accepted_tokens for x in m) > 0.5 * sum(x.num_draft_tokens for x in m) > 0
    llm.set_speculative_config({"method": "layer_skip", "quantization": "int4"})
    assert llm.proposer.model is prop.runner.model  # one quantized copy serves both methods


@pytest.mark.parametrize("stages,match", [
    ([NGRAM], "needs 'stages'"),
    ([NGRAM, {"method": "layer_skip"}], "quantized self-draft.*without quantization"),
    ([{"method": "draft_model", "model": "x"}, NGRAM], "must be an 'ngram' stage"),
    ([NGRAM, {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.2}],
     "the cascade's layer_skip stage takes no skip_ratio .its self-draft runs every layer"),
])
def test_bad_cascade_stages(dirs, stages, match):
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(dirs[0]), dtype="float32", progress=False,
            speculative_config={"method": "cascade", "stages": stages})


def test_adaptive_cascade_keeps_its_ngram_stages_state_across_steps(dirs):
    """The inner stage's adaptive state (K, acceptance, pauses) is one object per request, kept from
    one outer step to the next and dropped only when the request ends. The target drafts for itself
    (every outer draft kept), so the outer K grows and leaves the inner stage room to draft."""
    from specdec.engine.policies import AdaptiveK
    cfg = {"method": "cascade", "num_speculative_tokens": 4, "adaptive": True,
           "stages": [NGRAM, {"method": "draft_model", "model": str(dirs[0])}]}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = llm.generate(PROMPTS[:1], p, num_speculative_tokens=0)[0].outputs[0].token_ids
    policy = llm.proposer.policy
    assert isinstance(policy, AdaptiveK)
    core = llm.engine()
    seq = llm.make_sequence(PROMPTS[0], p)
    core.add(seq)
    states = []
    while core.has_work():
        core.step()
        if not seq.finished:
            states.append(policy.rows.get(f"{seq.request_id}/draft"))
    kept = [st for st in states[next(i for i, st in enumerate(states) if st is not None):]]
    assert len(kept) > 3 and all(st is kept[0] for st in kept)  # one state, never forgotten mid-request
    assert kept[-1].spec_steps > 3  # it has learnt from several inner steps, none forgotten
    assert seq.output_ids == want and policy.plain_seconds and policy.rows == {}  # forgotten at the end


def test_cascade_hands_the_target_its_drafters_real_q(dirs):
    """At temperature > 0 the draft carries the drafter's distribution of every drafted token (its
    q), not a one-hot: acceptance is then sum(min(p, q)) (the distribution test checks exactness)."""
    cfg = {"method": "cascade", "num_speculative_tokens": 4,
           "stages": [NGRAM, {"method": "draft_model", "model": str(dirs[1])}]}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    seqs = [llm.make_sequence(pr, SamplingParams(temperature=1.0, max_tokens=20, seed=i)) for i, pr in
            enumerate(PROMPTS)]
    core = llm.engine()
    for s in seqs:
        core.add(s)
    core.step()  # admits and runs one step
    draft = llm.proposer.propose(core.running, [4] * len(core.running))
    assert draft.probs is not None and draft.probs.shape[:2] == draft.tokens.shape
    for b, n in enumerate(draft.num_tokens.tolist()):
        for j in range(n):
            q = draft.probs[b, j]
            assert abs(float(q.sum()) - 1.0) < 1e-4 and float(q[draft.tokens[b, j]]) > 0
            assert float(q.max()) < 1.0  # a real distribution, not a one-hot
    for s in list(core.running):
        core.abort(s)


def test_a_drafter_one_token_behind_drafts_while_catching_up(dirs, monkeypatch):
    """The target as its own drafter: every draft is kept, so the drafter is one token behind at
    each step and folds that token into its first draft forward (no separate catch-up prefill)."""
    from specdec.proposers.cascade import CascadeProposer
    cfg = {"method": "cascade", "num_speculative_tokens": 3,
           "stages": [NGRAM, {"method": "draft_model", "model": str(dirs[0])}]}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, num_speculative_tokens=0)]
    calls = {"fold": 0, "prefill": 0}
    fold, prefill = CascadeProposer._catch_up_and_draft, llm.proposer.runner.prefill
    monkeypatch.setattr(CascadeProposer, "_catch_up_and_draft",
                        lambda self, *a: calls.__setitem__("fold", calls["fold"] + 1) or fold(self, *a))
    monkeypatch.setattr(llm.proposer.runner, "prefill",
                        lambda *a, **k: calls.__setitem__("prefill", calls["prefill"] + 1) or prefill(*a, **k))
    outs = llm.generate(PROMPTS, p)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs)
    assert calls["fold"] > 0 and calls["prefill"] == len(PROMPTS)  # the prompts' prefills only
