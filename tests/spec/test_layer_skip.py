"""Layer selection for self-speculation: the search and its scoring, on synthetic acceptance."""
from __future__ import annotations

from specdec.spec.layer_skip import LayerSearch, initial_skip_set


def test_initial_set_spreads_over_the_middle():
    s = initial_skip_set(28, 0.45)
    assert len(s) == 13 and min(s) >= 2 and max(s) <= 25
    assert initial_skip_set(6, 0.9) == frozenset({1, 2, 3, 4})
    assert initial_skip_set(3, 0.5) == frozenset({1})


def run_search(acceptance, n_layers=12, steps=400, seed=0):
    """Drive the search with a synthetic verifier: ``acceptance(skip)`` tokens accepted of 4 drafted."""
    s = LayerSearch(n_layers, ratio=0.4, trial_steps=4, search_steps=steps, seed=seed)
    for _ in range(steps + 8):
        acc = acceptance(s.skip_set())
        s.report([4, 4], [acc, acc])
    return s


def test_search_learns_to_keep_an_important_layer():
    # skipping layer 5 ruins the draft; every other skipped layer makes drafting cheaper
    important = 5
    s = run_search(lambda skip: 0 if important in skip else 4)
    assert important not in s.best.skip
    assert s.skip_set() == s.best.skip  # after the search the best set is used
    assert len(s.best.skip) >= 3


def test_search_trades_cost_against_acceptance():
    # acceptance falls as more layers are skipped: the optimum skips a middling number
    s = run_search(lambda skip: max(0, 4 - max(0, len(skip) - 3)), steps=600)
    assert 2 <= len(s.best.skip) <= 5, s.best.skip


def test_score_is_tokens_per_unit_cost():
    s = LayerSearch(10, ratio=0.5, trial_steps=100, search_steps=0)
    s.report([4], [3])  # 4 drafts with half the layers: cost 1 + 4 * 0.5 = 3, emitted 4
    assert abs(s.current.score() - 4 / 3) < 1e-9
