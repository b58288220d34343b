"""docs/grafana/specdec.json: importable as is, and every metric its PromQL names is one a live server
(or the Ray Serve ingress) exports: names read from /metrics, not from a list kept by hand."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_model_dir
from server_util import KEY, ServerProcess, spec
from specdec.server.cluster.metrics import IngressMetrics, merge_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "specdec.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
# PromQL words that look like names: functions are told apart by the "(" after them, these are not
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads (Grafana variables and label matchers removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "1", e)  # $__rate_interval, ${datasource}
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b\d[\w.]*", " ", e)  # numbers and durations (5m)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(0), e[m.end():].lstrip()
        if word.lower() in KEYWORDS or rest.startswith("(") or re.fullmatch(r"[0-9eE]+", word):
            continue
        names.add(word)
    return names


def exported_names(text: str) -> set[str]:
    """Every sample name a Prometheus text can hold, including families with no sample yet (a labelled
    counter nothing has incremented)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in SUFFIXES.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", var["query"]["query"]))
    return exprs


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory) -> str:
    """/metrics of a tiny speculative server after one request, merged as the Ray Serve ingress merges
    replicas' texts (with the ingress's own counters)."""
    model = make_model_dir(tmp_path_factory.mktemp("graf") / "model")
    draft = make_model_dir(tmp_path_factory.mktemp("graf") / "draft", seed=3, layers=1)
    srv = ServerProcess(model, "--speculative-model", str(draft), "--num-speculative-tokens", "3", api_key=KEY)
    try:
        status, _ = srv.request("POST", "/v1/completions", {"model": srv.model, "prompt": "def f(x):",
                                                          "max_tokens": 8, "temperature": 0.0, **spec(True)})
        assert status == 200
        _, text = srv.request("GET", "/metrics")
    finally:
        srv.stop()
    return merge_metrics({"replica-0": text, "ingress": IngressMetrics().render()}).decode()


def test_the_expression_reader_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.9, sum by (le, replica) (rate(specdec:a_bucket{job=~"$job", replica=~"x|y"}'
            '[$__rate_interval]))) / on (replica) group_left sum without (le) (specdec:b) + 2 * max(c_d offset 5m)')
    assert metric_names(expr) == {"specdec:a_bucket", "specdec:b", "c_d"}


def test_the_dashboard_is_importable_with_a_prometheus_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30 and dash["id"] is None
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip(), p["title"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_every_metric_the_dashboard_reads_is_exported(metrics_text):
    exported = exported_names(metrics_text)
    dash = json.loads(DASHBOARD.read_text())
    read = {name for e in expressions(dash) for name in metric_names(e)}
    assert read, "no PromQL found in the dashboard"
    missing = sorted(read - exported)
    assert not missing, f"the dashboard reads metrics the server does not export: {missing}"
    for expr in expressions(dash):  # a quantile needs a histogram's buckets
        for m in re.finditer(r"histogram_quantile\([^,]+,.*?([\w:]+)\{", expr):
            assert m.group(1).endswith("_bucket"), expr
    # every panel named in the brief has its metric, and the replica label exists after the merge
    for needed in ("specdec:inter_token_latency_seconds_bucket", "specdec:spec_decode_num_steps_total",
                   "specdec:step_draft_seconds_sum", "specdec:step_verify_seconds_sum",
                   "specdec:engine_steps_by_batch_size_total", "specdec:prefix_cache_hits_total"):
        assert needed in read and needed in exported, needed
    assert 'replica="replica-0"' in metrics_text
