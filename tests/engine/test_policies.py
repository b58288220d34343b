"""Draft-length policies: the heuristic schedule, the batch-size cap, pausing on hard text."""
from __future__ import annotations

from types import SimpleNamespace

from specdec.engine.policies import AdaptiveK, FixedK


def seq(rid="a", cap=None):
    return SimpleNamespace(request_id=rid, num_speculative_tokens=cap)


def test_fixed_k_and_request_cap():
    assert FixedK(5).k_for(seq(), 1) == 5
    assert FixedK(5).k_for(seq(cap=2), 1) == 2
    assert FixedK(5).k_for(seq(cap=0), 1) == 0


def test_schedule_grows_on_full_acceptance_and_shrinks_on_rejection():
    p, s = AdaptiveK(k_max=8), seq()
    assert p.k_for(s, 1) == 4
    p.update(s, 4, 4)
    assert p.k_for(s, 1) == 6
    p.update(s, 6, 6)
    assert p.k_for(s, 1) == 8  # capped at k_max
    p.update(s, 8, 3)
    assert p.k_for(s, 1) == 7


def test_batch_size_caps_k():
    p, s = AdaptiveK(k_max=8, rows_budget=16), seq()
    assert p.k_for(s, 1) == 4 and p.k_for(s, 4) == 3 and p.k_for(s, 8) == 1 and p.k_for(s, 32) == 1


def test_hard_text_pauses_drafting_then_probes_again():
    p, s = AdaptiveK(k_max=4, pause_steps=3), seq()
    ks = []
    for _ in range(12):  # nothing is ever accepted
        k = p.k_for(s, 1)
        ks.append(k)
        if k:
            p.update(s, k, 0)
    # K falls 2 -> 1, acceptance decays below 0.3, drafting pauses 3 steps, a K=1 probe fails, pause again
    assert ks == [2, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1]


def test_forget_drops_state():
    p, s = AdaptiveK(k_max=4), seq()
    p.k_for(s, 1)
    p.forget(s)
    assert "a" not in p.rows


def run_steps(p, s, n, accepted_of, seconds):
    ks = []
    for _ in range(n):
        k = p.k_for(s, 1)
        ks.append(k)
        if k:
            p.update(s, k, accepted_of(k), seconds(k), 1)
        else:
            p.observe_plain(1, 0.1)
    return ks


def test_drafting_slower_than_plain_pauses_with_growing_pauses():
    """A step of K drafts costs 0.1 + 0.03 K s and gains 1 + K/4 tokens: below 10 tok/s for K <= 4."""
    p, s = AdaptiveK(k_max=4, pause_steps=2, max_pause=8), seq()
    assert p.needs_plain_step(1)
    p.observe_plain(1, 0.1)  # plain decoding: 10 tokens/s
    assert not p.needs_plain_step(1) and p.needs_plain_step(2)
    ks = run_steps(p, s, 30, lambda k: k // 4, lambda k: 0.1 + 0.03 * k)
    pauses = [len(run) for run in "".join("0" if k == 0 else "x" for k in ks).split("x") if run]
    assert pauses[:3] == [2, 4, 8] and all(n == 8 for n in pauses[3:-1])  # doubles up to max_pause
    assert sum(k == 0 for k in ks) >= 18  # mostly plain: a probe costs min_spec_steps steps


def test_drafting_that_pays_never_pauses():
    p, s = AdaptiveK(k_max=4), seq()
    p.observe_plain(1, 0.1)
    ks = run_steps(p, s, 30, lambda k: k, lambda k: 0.1 + 0.03 * k)  # all accepted: 5 tokens per 0.22 s
    assert 0 not in ks


def test_engine_measures_a_plain_step_for_the_policy(tiny_model_dir):
    from specdec import LLM, SamplingParams
    from specdec.engine import policies as adaptive
    seen = []
    orig = adaptive.AdaptiveK.observe_plain

    def spy(self, b, sec, **kw):
        seen.append((b, sec))
        orig(self, b, sec, **kw)
    import pytest
    mp = pytest.MonkeyPatch()
    mp.setattr(adaptive.AdaptiveK, "observe_plain", spy)
    try:
        llm = LLM(str(tiny_model_dir), dtype="float32", progress=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": True,
                                      "prompt_lookup_min": 1})
        out = llm.generate(["ab ab ab ab", "cd cd cd"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        mp.undo()
    assert seen and seen[0][0] == 2 and seen[0][1] > 0
    assert sum(o.metrics.num_draft_tokens for o in out) > 0


def test_load_aware_k_shrinks_with_the_batch_and_switches_off():
    from specdec.engine.policies import LoadAwareK, make_policy
    policy = LoadAwareK(FixedK(5), spec_max_batch=4, rows_budget=16)
    assert [policy.cap(b) for b in (1, 2, 3, 4, 5, 16)] == [15, 7, 4, 3, 0, 0]
    assert [policy.k_for(seq(), b) for b in (1, 2, 4, 5)] == [5, 5, 3, 0]
    assert policy.k_for(seq(cap=1), 1) == 1
    assert isinstance(make_policy(5, adaptive=True, spec_max_batch=4).base, AdaptiveK)
    assert make_policy(3).max_k == 3 and make_policy(6, adaptive=True).max_k == 6


def sampled(rid: str, seed: int | None = None, temperature: float = 0.8):
    """A request stub with sampling parameters (``own_history`` reads its seed and whether it is greedy)."""
    params = SimpleNamespace(seed=seed, greedy=temperature == 0)
    return SimpleNamespace(request_id=rid, num_speculative_tokens=None, params=params)


def test_only_a_seeded_sampled_row_under_rejection_sampling_follows_its_own_history():
    from specdec.engine.policies import own_history
    assert own_history(sampled("a", seed=1), "rejection")
    assert not own_history(sampled("a", seed=1), "gumbel")  # any K gives plain sampling's tokens
    assert not own_history(sampled("a", seed=1, temperature=0), "rejection")  # greedy: any K, the same tokens
    assert not own_history(sampled("a"), "rejection")  # no seed: nothing promised across batches


def test_a_seeded_rows_k_is_the_same_in_any_batch_and_any_run():
    """Would have caught adaptive K breaking the seed (issue 47, item 7): the K of a seeded row was
    capped by batch size, zeroed by the plain step timing a new batch size, and paused on measured
    seconds, so the same acceptances gave other K alone, in a batch of 4 or 9, or on a slower run."""
    from specdec.engine.policies import LoadAwareK, draft_lengths

    def schedule(batch: int, seconds: float, policy) -> list[int]:
        rows = [sampled("me", seed=7)] + [sampled(f"o{i}") for i in range(batch - 1)]
        ks = []
        for step in range(30):
            k = draft_lengths(policy, rows)
            ks.append(k[0])
            for s, n in zip(rows, k):
                accepted = n if step % 3 else n // 2  # a rejection every third step
                policy.update(s, n, accepted, seconds * (1 + n), batch)
            if not any(k):
                policy.observe_plain(batch, seconds)
        return ks

    def adaptive():
        return AdaptiveK(k_max=6, pause_steps=2)

    alone = schedule(1, 0.01, adaptive())
    assert max(alone) == 6 and alone[0] == 3  # drafted, grew to K max
    for batch in (1, 4, 9):
        for seconds in (0.01, 1.0):  # fast or slow drafting (slower than plain: the others pause)
            assert schedule(batch, seconds, adaptive()) == alone, (batch, seconds)
            assert schedule(batch, seconds, LoadAwareK(adaptive(), spec_max_batch=2)) == alone, (batch, seconds)
    # the unseeded rows keep the batch's cap and the timing
    p = AdaptiveK(k_max=6)
    assert draft_lengths(p, [sampled("x", seed=1), sampled("y")], "gumbel") == [0, 0]  # gumbel: a plain step is timed
    assert draft_lengths(p, [sampled("x", seed=1), sampled("y")]) == [3, 3]  # the seeded row drafts: no plain step
    assert draft_lengths(p, [sampled("x", seed=1)] + [sampled(f"y{i}") for i in range(8)])[:2] == [3, 1]  # 16 // 9 - 1
