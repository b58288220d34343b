"""The KV cache metrics: gauges of the pool, prefix-cache and preemption counters by difference."""
from specdec.server.metrics import ServerMetrics


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
