"""The tuner's decision rule on synthetic measurements."""
from specdec.tools.tune.decide import Measured, batch_cutoff, decide, prior_max_batch


def m(name, speedup, k=5, acceptance=0.8, method="ngram", batch=1):
    return Measured(name=name, spec={"method": method}, k=k, speedup=speedup, acceptance=acceptance,
                    tokens_per_second=10 * speedup, tokens_per_step=1 + 3 * acceptance, mean_tokens=100, batch=batch)


def test_the_fastest_candidate_and_its_best_k_win():
    d = decide([m("ngram", 1.2), m("ngram", 1.4, k=3), m("draft:x", 1.3, method="draft_model")])
    assert d.name == "ngram" and d.spec == {"method": "ngram", "num_speculative_tokens": 3}
    assert "ngram at K=3: 1.40x" in d.reasons[0] and "next best: draft:x 1.30x" in d.reasons[1]


def test_no_candidate_worth_it_means_plain_decoding():
    d = decide([m("ngram", 1.02), m("suffix", 0.9)])
    assert d.spec is None and d.name is None and "speculation off" in d.reasons[0]
    assert decide([]).spec is None


def test_low_acceptance_of_a_draft_model_and_short_answers_are_named():
    runs = [m("draft:x", 1.5, acceptance=0.41, method="draft_model")]
    runs[0].mean_tokens = 20
    reasons = " ".join(decide(runs).reasons)
    assert "acceptance 41% < 60%" in reasons and "answers are short (mean 20 tokens)" in reasons


def test_the_batch_size_where_speculation_stops_paying():
    plain = {1: 10.0, 2: 18.0, 4: 30.0, 8: 50.0}
    spec = {1: 20.0, 2: 30.0, 4: 29.0, 8: 40.0}
    assert batch_cutoff(plain, spec) == 2
    d = decide([m("ngram", 2.0)], plain, spec, max_batch=8)
    assert d.spec_max_batch == 2 and any("at batch >= 4 plain decoding is faster" in r for r in d.reasons)
    assert batch_cutoff(plain, {b: v * 2 for b, v in plain.items()}) is None
    always = decide([m("ngram", 2.0)], plain, {b: v * 2 for b, v in plain.items()}, max_batch=8)
    assert always.spec_max_batch is None  # wins up to the largest size asked for
    assert batch_cutoff({1: 10.0}, {1: 9.0}) == 0
    assert decide([m("ngram", 1.5)], {1: 10.0}, {1: 9.0}).spec is None


def test_unmeasured_batches_fall_back_to_the_rule_of_thumb():
    d = decide([m("ngram", 1.5, k=3)])
    assert d.spec_max_batch == prior_max_batch(3) == 2 and "rule of thumb" in d.reasons[-1]
