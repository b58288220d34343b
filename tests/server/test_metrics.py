"""The KV cache metrics: gauges of the pool, prefix-cache and preemption counters by difference."""
from types import SimpleNamespace

from specdec.server.metrics import Reported, ServerMetrics


def value(m: ServerMetrics, name: str) -> float:
    line = next(x for x in m.render().decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_cache_metrics_count_differences_and_survive_an_engine_restart():
    m = ServerMetrics()
    m.observe_cache(queries=100, hits=64, preemptions=1, used=3, free=9)
    m.observe_cache(queries=300, hits=192, preemptions=1, used=6, free=6)
    assert value(m, "specdec:prefix_cache_queries_total") == 300
    assert value(m, "specdec:prefix_cache_hits_total") == 192
    assert value(m, "specdec:kv_cache_usage_perc") == 0.5
    assert value(m, "specdec:kv_cache_blocks_free") == 6
    m.observe_cache(queries=300, hits=192, preemptions=0, used=0, free=12)  # a new engine: its own count
    m.observe_cache(queries=300, hits=192, preemptions=2, used=0, free=12)
    assert value(m, "specdec:num_preemptions_total") == 3


def seq_state(out: int, steps: int, drafted: int = 0, accepted: int = 0) -> SimpleNamespace:
    """The counters of a Sequence that ``observe_step`` reads."""
    return SimpleNamespace(output_ids=[0] * out, num_steps=steps, num_draft=drafted, num_accepted=accepted,
                           drafted_at=[drafted], accepted_at=[accepted])


def test_inter_token_latency_spreads_a_steps_gap_over_its_tokens_and_steps_are_counted():
    m, rep = ServerMetrics(), Reported()
    m.observe_step(seq_state(1, 0), rep, now=10.0)  # prefill: the first token, no gap yet
    m.observe_step(seq_state(5, 1, drafted=4, accepted=3), rep, now=10.2)  # 4 tokens in one 0.2 s step
    m.observe_step(seq_state(6, 2, drafted=8, accepted=3), rep, now=10.3)  # 1 token after 0.1 s
    assert value(m, "specdec:inter_token_latency_seconds_count") == 5
    assert abs(value(m, "specdec:inter_token_latency_seconds_sum") - (4 * 0.05 + 0.1)) < 1e-9
    assert value(m, "specdec:spec_decode_num_steps_total") == 2
    assert value(m, "specdec:generation_tokens_total") == 6
    # tokens per step as the dashboard computes it: (accepted + steps) / steps
    assert (value(m, "specdec:spec_decode_num_accepted_tokens_total") + 2) / 2 == 2.5


def test_engine_steps_by_batch_size_and_per_step_draft_and_verify_time():
    m = ServerMetrics()
    times = SimpleNamespace(draft=0.01, verify=0.05)  # the engine's cumulative StepTimes
    m.observe_engine_step(1, 4, times)
    times.verify = 0.12
    m.observe_engine_step(6, 0, times)  # speculation off at batch 6
    m.observe_engine_step(1, 4, SimpleNamespace(draft=0.02, verify=0.03))  # a restarted engine: from 0
    reg = m.registry
    assert reg.get_sample_value("specdec:engine_steps_by_batch_size_total",
                                {"batch_size": "1", "speculation": "on"}) == 2
    assert reg.get_sample_value("specdec:engine_steps_by_batch_size_total",
                                {"batch_size": "6", "speculation": "off"}) == 1
    assert value(m, "specdec:engine_steps_total") == 3
    assert abs(value(m, "specdec:step_draft_seconds_sum") - 0.03) < 1e-9
    assert abs(value(m, "specdec:step_verify_seconds_sum") - (0.05 + 0.07 + 0.03)) < 1e-9
    assert value(m, "specdec:step_verify_seconds_count") == 3


def test_steps_without_speculation_say_why():
    """Off for load (past --spec-max-batch) or for cost (an MoE target whose blocks cost more than they
    save); a server without a drafter counts none."""
    m = ServerMetrics()
    times = SimpleNamespace(draft=0.0, verify=0.0)
    m.observe_engine_step(6, 0, times, "load")
    m.observe_engine_step(1, 0, times, "cost")
    m.observe_engine_step(1, 0, times, "cost")
    m.observe_engine_step(1, 3, times, None)
    m.observe_engine_step(1, 0, times, None)  # no drafter
    reg = m.registry
    assert reg.get_sample_value("specdec:spec_decode_off_steps_total", {"reason": "load"}) == 1
    assert reg.get_sample_value("specdec:spec_decode_off_steps_total", {"reason": "cost"}) == 2
