"""Schemathesis fuzzes the server from its own OpenAPI schema (/openapi.json): 0 server errors.

Every operation gets up to ``MAX_EXAMPLES`` generated requests per mode (schemathesis'
positive mode: bodies valid per the request schemas; negative: bodies violating them) per the request schemas of ``specdec/server/openapi.py``); any 5xx fails. The cases tried are counted
and printed (``-s``) for BENCHMARKS.md.
"""
from __future__ import annotations

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("fuzz") / "model")
    srv = ServerProcess(model, "--speculative-method", "ngram", "--max-batch-size", "4", "--max-model-len", "128",
                        "--served-model-name", "tiny")
    yield srv
    srv.stop()


def operations(server) -> list:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


def test_fuzzed_requests_never_get_a_server_error(server):
    cases = 0
    for op, mode in [(op, mode) for op in operations(server) for mode in schemathesis.GenerationMode
                     if op.method.upper() == "POST" or mode == schemathesis.GenerationMode.POSITIVE]:

        @hypothesis.given(case=op.as_strategy(mode))
        @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def check(case) -> None:
            nonlocal cases
            response = case.call(timeout=60)
            cases += 1
            assert response.status_code < 500, (op.label, case.body, response.text)

        check()
    print(f"schemathesis: {cases} cases, 0 server errors")
    assert cases >= MAX_EXAMPLES


def test_schema_describes_the_request_bodies(server):
    status, doc = server.request("GET", "/openapi.json")
    assert status == 200
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest") and "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
