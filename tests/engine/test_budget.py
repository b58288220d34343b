"""The tree node budget from measured verification costs: the choice on synthetic timings (a pure
function), the policy's per-batch-size cache and cap, and `"tree_budget": "auto"` end to end (the
measurement replaced by synthetic costs: no timing in tests)."""
import pytest

from conftest import make_pair, spec_method_config
from specdec import LLM, SamplingParams
from specdec.engine import budget
from specdec.engine.budget import MeasuredBudget, budget_from_costs
from specdec.engine.budget import verify_costs as measured_costs  # the real one (conftest stands a curve in)
from specdec.engine.policies import make_policy
from specdec.errors import SpecdecError

# bf16 on this CPU, roughly (issue 15): 8 tokens cost 1.2x one token, 16 cost 1.55x
BF16 = {1: 1.0, 2: 1.01, 4: 1.05, 8: 1.2, 16: 1.55, 32: 2.6}
INT4 = {1: 1.0, 2: 1.03, 4: 1.08, 8: 1.65, 16: 2.9}


def test_the_largest_t_within_the_tolerance_of_one_token():
    assert budget_from_costs(BF16) == 7  # T = 8 rows: the pending token + 7 nodes
    assert budget_from_costs(INT4) == 3
    assert budget_from_costs(BF16, tolerance=1.6) == 15
    assert budget_from_costs({1: 1.0, 2: 3.0}) == 0  # nothing is free: no tree


def test_the_t_maximizing_expected_tokens_per_second():
    def saturating(n):  # tokens per step with n nodes: diminishing returns
        return 1 + 2.0 * (1 - 0.7 ** n)
    assert budget_from_costs(BF16, expected=saturating) == 7
    assert budget_from_costs(BF16, expected=lambda n: 1 + n) == 31  # every node accepted: the most rows
    assert budget_from_costs(BF16, expected=lambda n: 1.0) == 0  # nothing accepted: plain decoding


class FakeSeq:
    request_id, num_speculative_tokens, num_tokens = "r", None, 10


def test_the_policy_measures_once_per_batch_size_and_caps_k():
    calls = []
    pol = MeasuredBudget(make_policy(10), lambda b: calls.append(b) or (BF16 if b == 1 else INT4))
    assert [pol.k_for(FakeSeq(), 1) for _ in range(3)] == [7, 7, 7]
    assert pol.k_for(FakeSeq(), 4) == 3 and calls == [1, 4] and pol.max_k == 10
    assert MeasuredBudget(make_policy(2), lambda b: BF16).k_for(FakeSeq(), 1) == 2  # K stays the ceiling


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("budget"))


@pytest.mark.parametrize("method", ["medusa", "draft_model-tree"])
def test_auto_budget_drafts_the_measured_nodes_losslessly(dirs, method, monkeypatch):
    seen = []
    monkeypatch.setattr(budget, "verify_costs", lambda model, b: seen.append(b) or INT4)
    cfg = spec_method_config(method, dirs[1]) | {"num_speculative_tokens": 8, "tree_budget": "auto",
                                                 "cost_aware": False}  # the tree budget's measurement alone
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["def fibonacci(n): fibonacci(n):", "Hello"]
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(0 < o.metrics.num_draft_tokens <= 3 * o.metrics.num_steps for o in outs)  # 3 nodes a step at most
    llm.generate(prompts, params)
    assert seen and len(seen) == len(set(seen))  # once per batch size


def test_auto_is_the_only_tree_budget_and_only_for_tree_methods():
    from specdec.proposers.registry import parse_config
    with pytest.raises(SpecdecError, match="tree_budget"):
        parse_config({"method": "medusa", "tree_budget": "fast"})
    with pytest.raises(SpecdecError, match="unknown option"):
        parse_config({"method": "ngram", "tree_budget": "auto"})


# a mixture of experts (Qwen3-30B-A3B-like, 8 of 128 experts a token): a block of T rows reads the
# attention and the experts its rows touch, which grow with T (verification costs, per T)
MOE = {1: 1.0, 2: 1.45, 4: 2.1, 8: 3.0, 16: 4.2, 32: 5.5}


def test_expected_tokens_and_the_k_of_most_tokens_per_second():
    assert budget.expected_tokens(0.5, 0) == 1 and budget.expected_tokens(0.5, 2) == 1.75
    assert budget.expected_tokens(1.0, 3) == 4
    assert budget.interpolate(MOE, 3) == pytest.approx(1.775) and budget.interpolate(BF16, 64) == pytest.approx(4.7)
    assert budget.best_k(BF16, 0.8, 8) >= 5  # a dense curve: nearly free rows, long drafts pay
    assert budget.best_k(BF16, 0.8, 8) == 8 and budget.best_k(MOE, 0.8, 8) == 5  # on an MoE curve: shorter
    assert budget.best_k(MOE, 0.3, 8) == 0  # poor drafts on an MoE: plain decoding
    assert budget.best_k(BF16, 0.3, 8) > 0  # ... which still pay on a dense model
    assert budget.best_k(MOE, 0.95, 8, draft_seconds=2.0) == 0  # a drafter as slow as two steps never pays


def test_the_cost_aware_policy_turns_drafting_off_and_probes():
    """Drafts that all fail: the cap falls to 0 (plain decoding, with the reason said), and after
    ``probe_every`` plain steps one row drafts a token again, after a failed probe twice as many; drafts
    that succeed bring K back."""
    pol = budget.CostAwareK(make_policy(6), lambda b: MOE, probe_every=4)
    seq = FakeSeq()
    assert pol.k_for(seq, 1) == 1 and pol.reason is None  # alpha 1/2 before any draft: K = 1 pays on this curve
    for _ in range(20):
        pol.update(seq, 3, 0, 0.01, 1)
    assert pol.k_for(seq, 1) == 0 and "acceptance 0.0" in pol.reason
    for _ in range(3):
        pol.observe_plain(1, 1.0)
    assert pol.k_for(seq, 1) == 0
    pol.observe_plain(1, 1.0)
    assert pol.k_for(seq, 1) == 1  # the probe
    pol.update(seq, 1, 0, 0.01, 1)  # fails: the next one waits 8 plain steps, not 4
    for _ in range(7):
        pol.observe_plain(1, 1.0)
        assert pol.k_for(seq, 1) == 0
    pol.observe_plain(1, 1.0)
    assert pol.k_for(seq, 1) == 1  # the next probe
    for _ in range(40):
        pol.update(seq, 4, 4, 0.01, 1)
    assert pol.k_for(seq, 1) >= 3 and pol.reason is None


def test_an_moe_target_drafts_under_the_cost_aware_policy_losslessly(tmp_path, monkeypatch):
    """The engine wraps an MoE target's policy in CostAwareK; greedy output stays plain decoding's,
    whether the cost curve lets it draft or turns drafting off."""
    from family_util import family_dir

    path = family_dir(tmp_path, "olmoe", num_hidden_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["the cat sat on the mat the cat sat on the", "Hello"]
    # the target as its own draft: every draft accepted, so only the cost curve decides
    cfg = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    curve = {}
    monkeypatch.setattr(budget, "verify_costs", lambda model, b, *a, **k: curve)
    llm = LLM(model=str(path), dtype="float32", progress=False, speculative_config=cfg)
    assert isinstance(llm.engine().policy, budget.CostAwareK)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, num_speculative_tokens=0)]
    for costs, drafts in ((BF16, True), ({1: 1.0, 2: 5.0, 4: 9.0, 8: 17.0, 16: 33.0, 32: 65.0}, False)):
        curve.clear()
        curve.update(costs)
        llm._costs.clear()  # measured again: the new curve
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == plain
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        assert drafted >= 16 if drafts else drafted == 0, drafted


def test_the_measurement_times_each_block_size_it_is_asked_for(dirs):
    """``verify_costs`` (the real timing, which the other tests replace by curves): one positive time per
    block size asked for, in a cache of its own (no request's rows touched)."""
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False)
    costs = measured_costs(llm.target.model, 2, sizes=(1, 3), repeats=1)
    assert set(costs) == {1, 3} and all(c > 0 for c in costs.values())


def test_off_for_load_is_not_reported_as_off_for_cost():
    """Inside the server's load cap: past --spec-max-batch the cap is 0 for the load, and the cost
    reason of an earlier step must not stick to it (the metrics and the playground would say "cost")."""
    from specdec.engine.policies import LoadAwareK

    pol = budget.CostAwareK(LoadAwareK(make_policy(6), spec_max_batch=2), lambda b: MOE)
    seq = FakeSeq()
    for _ in range(20):
        pol.update(seq, 3, 0, 0.01, 1)
    assert pol.cap(1) == 0 and pol.reason is not None  # off for cost at batch 1
    assert pol.cap(4) == 0 and pol.reason is None  # off for load at batch 4


def test_a_probe_that_drafts_nothing_is_a_failed_probe():
    """Issue 59, item 6: a probe whose drafter found nothing (an n-gram or suffix drafter with no match)
    left ``probing`` set (``update`` returns on 0 drafts) and the step was not counted as plain, so every
    later step probed again: the drafter was asked on 104 of 120 steps. Reported as the engine now
    reports a step whose drafter was asked and drafted nothing (a plain step, ``asked``), it is a failed
    probe: the wait doubles each time, up to ``probe_max``; a plain step it was not asked on is none."""
    pol = budget.CostAwareK(make_policy(6), lambda b: MOE, probe_every=4, probe_max=16)
    seq = FakeSeq()
    for _ in range(20):
        pol.update(seq, 3, 0, 0.01, 1)
    asked = []
    for step in range(120):
        if pol.k_for(seq, 1):
            asked.append(step)
        pol.observe_plain(1, 1.0, asked=bool(asked) and asked[-1] == step)  # nothing drafted: a plain step
        pol.update(seq, 0, 0, 1.0, 1)
    assert asked == [4, 13, 30, 47, 64, 81, 98, 115], asked  # waits of 4, 8, then 16 (probe_max) plain steps
    assert pol.record.probe_gap == 16 and not pol.probing
    for _ in range(12):
        pol.observe_plain(1, 1.0)
    assert pol.k_for(seq, 1) == 1  # a probe is due
    pol.observe_plain(1, 1.0)  # ... but the drafter was not asked (the row's own K was 0): no probe failed
    assert pol.k_for(seq, 1) == 1 and pol.record.probe_gap == 16


def test_a_drafter_that_never_matches_is_asked_rarely(tmp_path, monkeypatch):
    """Issue 59, item 6, end to end: an n-gram drafter that never matches, under an MoE target's
    cost-aware policy (with the adaptive base) where drafting does not pay at the prior acceptance: it is
    asked at the probes only (after 16, 32, 64 plain steps), not on every step after the first probe
    (104 of 120 before)."""
    from family_util import family_dir
    from specdec.proposers import ngram

    path = family_dir(tmp_path, "olmoe", num_hidden_layers=2)
    monkeypatch.setattr(budget, "verify_costs", lambda model, b, *a, **k: {1: 1.0, 2: 5.0, 4: 9.0, 8: 17.0})
    asked = []
    monkeypatch.setattr(ngram, "ngram_lookup", lambda tokens, *a: asked.append(len(tokens)) or tokens[:0])
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}
    llm = LLM(model=str(path), dtype="float32", progress=False, speculative_config=cfg)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 120 and out.metrics.num_draft_tokens == 0
    assert 1 <= len(asked) <= 4, len(asked)


# ---- the context length (issue 58, item 1) -------------------------------------------------------------
def _long_curve(calls=None, per_token=0.8):
    """The short-context curve BF16, and at any measured context bucket a row whose every token reads the
    whole context: ``per_token`` s more per token of the block (0.8: a 16k-token context's attention,
    roughly)."""
    def measure(b, context=0):
        if calls is not None:
            calls.append((b, context))
        return dict(BF16) if not context else {t: c + per_token * t for t, c in BF16.items()}
    return measure


def test_a_long_context_turns_its_own_row_plain_and_the_short_one_drafts():
    calls = []
    pol = budget.CostAwareK(make_policy(6), _long_curve(calls), probe_every=4)
    short, long_ = FakeSeq(), FakeSeq()
    long_.request_id, long_.num_tokens = "long", 20000
    assert pol.k_for(short, 2) >= 3 and pol.k_for(long_, 2) == 0  # alpha 1/2: pays at 10 tokens, not at 20k
    assert "20000 tokens of context" in pol.row_off["long"] and "short" not in pol.row_off
    assert pol.reason is None  # the batch drafts: off for the long row's length alone
    assert (1, 16384) in calls and calls.count((1, 16384)) == 1  # the bucket under 20k, measured once
    pol.k_for(long_, 2)
    assert calls.count((1, 16384)) == 1
    long_.num_tokens = 1500  # bucket 1k, its cost scaled to 1.5k: 1.17 s a token more, still too dear
    assert pol.k_for(long_, 2) == 0 and (1, 1024) in calls
    for _ in range(4):  # plain steps, then a probe for the row (its drafts may have become good)
        pol.observe_plain(2, 1.0)
    assert pol.k_for(long_, 2) == 1 and pol.probing
    pol.forget(long_)
    assert "long" not in pol.row_off


def test_good_drafts_still_pay_at_a_long_context():
    """The same curve with drafts all accepted: at 20k tokens a block of 2 still beats plain decoding."""
    pol = budget.CostAwareK(make_policy(6), _long_curve())
    seq = FakeSeq()
    seq.num_tokens = 20000
    for _ in range(60):
        pol.update(seq, 1, 1, None, 1)
    assert pol.alpha > 0.95 and pol.k_for(seq, 1) >= 1 and not pol.row_off


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "lfm2"])
def test_the_cost_of_a_block_after_a_long_context_is_measured(tmp_path, family):
    """``verify_costs`` at a context (the real timing): the scratch row mapped to that length without a
    forward, then timed there, on a dense model, one with sliding-window layers (its windowed group frees
    behind the window as the slots are mapped) and a hybrid (its rings told the positions are written)."""
    from family_util import family_dir

    path = family_dir(tmp_path, family, max_position_embeddings=4096)
    llm = LLM(model=str(path), dtype="float32", progress=False)
    costs = measured_costs(llm.target.model, 1, sizes=(1, 3), repeats=1, context=2048)
    assert set(costs) == {1, 3} and all(c > 0 for c in costs.values())


def test_a_context_bucket_times_only_the_ends_of_the_blocks_it_may_choose(tmp_path, monkeypatch):
    """At a context bucket each forward is a long one: the cost-aware policy's measurement there times T = 1 and
    K + 1 only (what the context adds is linear in T; ``costs_at`` interpolates), the short curve every T."""
    from family_util import family_dir

    path = family_dir(tmp_path, "qwen3", max_position_embeddings=4096)
    asked = []
    monkeypatch.setattr(budget, "verify_costs", lambda model, b, sizes=(), repeats=3, context=0:
                        asked.append((b, tuple(sizes), context)) or {t: 1.0 + t * context / 4096 for t in sizes})
    cfg = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model=str(path), dtype="float32", progress=False, speculative_config=cfg, max_model_len=4096)
    policy = llm.engine().policy
    costs = policy.costs_at(1, 3000)
    assert asked == [(1, (1, 2, 3, 4, 5), 0), (1, (1, 5), 2048)]
    # a row at 3,000 tokens adds 3000 / 2048 of the bucket's extra (t / 2 s at T = t), interpolated between 1 and 5
    assert costs == pytest.approx({t: 1.0 + 3000 / 2048 * t / 2 for t in range(1, 6)})


def test_a_long_request_decodes_plainly_beside_a_drafting_short_one(tmp_path, monkeypatch):
    """End to end: a context past 1k tokens makes its block too dear (a stand-in curve: 20 plain steps a
    token, more than any acceptance saves), so that request drafts nothing while the short one beside it
    drafts (the target drafting for itself: every draft accepted); both give plain decoding's tokens."""
    from family_util import family_dir

    path = family_dir(tmp_path, "qwen3", max_position_embeddings=4096)
    monkeypatch.setattr(budget, "verify_costs",
                        lambda model, b, sizes=(), repeats=3, context=0: _long_curve(per_token=20.0)(b, context))
    cfg = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(model=str(path), dtype="float32", progress=False, speculative_config=cfg, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    long_prompt = [(7 * i) % 90 + 3 for i in range(1100)]
    prompts = [long_prompt, [5, 6, 7, 8]]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, num_speculative_tokens=0)]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert outs[0].metrics.num_draft_tokens == 0 and outs[1].metrics.num_draft_tokens > 0


def test_a_drafters_one_off_costs_are_not_its_time_per_token():
    """A draft model's first drafting step also prefills the prompt (seconds at 2k tokens): no sample of
    its time per draft token. Counted as one (before), a 3 s first step made the 0.5B draft look 1.5 s a
    token dear and turned it off for good. A later sample above the estimate (a probe's catching up, a
    busy machine) moves it a tenth of the way; one below sets it."""
    pol = budget.CostAwareK(make_policy(2), lambda b, context=0: dict(BF16))
    seq = FakeSeq()
    seq.num_draft = 2  # the row's first drafts, this step's (counted before the policy hears of them)
    assert pol.k_for(seq, 1) == 2
    pol.update(seq, 2, 2, 3.0, 1)  # 3 s: the draft's prefill of the prompt
    assert not pol.record.draft_seconds and pol.k_for(seq, 1) == 2
    seq.num_draft = 4
    pol.update(seq, 2, 2, 1.25, 1)  # a steady step: 1.25 s, of which 1.03 the verification of 3 tokens
    assert pol.record.draft_seconds[(1, 0)] == pytest.approx(0.11) and pol.k_for(seq, 1) == 2
    seq.num_draft = 6
    pol.update(seq, 2, 2, 3.0, 1)  # an outlier: 0.985 s a token
    assert pol.record.draft_seconds[(1, 0)] == pytest.approx(0.11 + 0.1 * 0.875) and pol.k_for(seq, 1) == 2
    seq.num_draft = 8
    pol.update(seq, 2, 2, 1.1, 1)
    assert pol.record.draft_seconds[(1, 0)] == pytest.approx(0.035)
