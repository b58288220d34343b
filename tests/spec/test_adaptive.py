"""Draft-length policies: the heuristic schedule, the batch-size cap, pausing on hard text."""
from __future__ import annotations

from types import SimpleNamespace

from specdec.spec.adaptive import AdaptiveK, FixedK


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
