"""Schemathesis fuzzes the server from its own OpenAPI schema (/openapi.json): 0 server errors.

In the slow stage (``-m slow``), bounded in count and time: every operation gets up to
``MAX_EXAMPLES`` generated requests per mode (schemathesis' positive mode: bodies valid per the request
schemas of ``specdec/server/openapi.py``; negative: bodies violating them), then a property-based fuzz
of the sampling fields the schema types loosely (logit_bias keys are any string, stop any strings,
numbers any size) gets ``MAX_EXAMPLES`` more; all of it stops at ``TIME_BUDGET_S`` seconds. Any 5xx
fails. The cases tried are counted and printed (``-s``) for BENCHMARKS.md. The schema itself is
checked in the default stage, in process.
"""
from __future__ import annotations

import json
import time

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

MAX_EXAMPLES = 400  # per operation and mode, and for the sampling fields' fuzz
TIME_BUDGET_S = 300.0  # for the whole fuzz: past it, the cases left are not sent


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


def _settings(max_examples: int = MAX_EXAMPLES):
    return hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


# what the request schemas leave open: any string as a logit_bias key (digits of every script: "²",
# "١٢"), numbers of any size, stop strings of any count, unicode prompts; one or two fields at a time
# over a valid request, so that no other field's 400 hides what a field does
_KEYS = st.one_of(st.text(st.characters(categories=("Nd", "No", "Nl", "Zs")), min_size=1, max_size=6),
                  st.text(max_size=6), st.integers(0, 10**30).map(str))
_NUMBERS = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=False, allow_infinity=False), st.none())
_FIELDS = {
    "logit_bias": st.dictionaries(_KEYS, st.one_of(st.integers(-200, 200), st.floats(-1e3, 1e3)), max_size=4),
    "stop": st.one_of(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=40)),
    "max_tokens": _NUMBERS, "temperature": _NUMBERS, "top_p": _NUMBERS, "top_k": _NUMBERS, "min_p": _NUMBERS,
    "seed": _NUMBERS, "n": st.integers(-2, 20), "presence_penalty": _NUMBERS, "frequency_penalty": _NUMBERS,
    "repetition_penalty": _NUMBERS, "logprobs": _NUMBERS, "ignore_eos": st.booleans(),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 10**6), max_size=8))}
_SAMPLING = st.lists(st.one_of(*(st.tuples(st.just(k), v) for k, v in _FIELDS.items())), min_size=1,
                     max_size=2).map(dict)


@pytest.mark.slow
def test_fuzzed_requests_never_get_a_server_error(server):
    """Issue 47, item 5: a digit-like logit_bias key ("²") was a 500; schemathesis over the schema, and
    hypothesis over the fields the schema types loosely, find any other request that is."""
    cases, t_end = 0, time.monotonic() + TIME_BUDGET_S
    for op, mode in [(op, mode) for op in operations(server) for mode in schemathesis.GenerationMode
                     if op.method.upper() == "POST" or mode == schemathesis.GenerationMode.POSITIVE]:

        @hypothesis.given(case=op.as_strategy(mode))
        @_settings()
        def check(case) -> None:
            nonlocal cases
            if time.monotonic() > t_end:
                return
            response = case.call(timeout=60)
            cases += 1
            assert response.status_code < 500, (op.label, case.body, response.text)

        check()

    @hypothesis.given(fields=_SAMPLING, chat=st.booleans())
    @_settings()
    def sampling(fields: dict, chat: bool) -> None:
        nonlocal cases
        if time.monotonic() > t_end:
            return
        body = {"model": "tiny", "max_tokens": 4} | fields
        if chat:
            body.pop("prompt", None)
            body["messages"] = [{"role": "user", "content": "Hi"}]
        else:
            body.setdefault("prompt", "Hi")
        status, answer = server.request("POST", "/v1/chat/completions" if chat else "/v1/completions",
                                        json.dumps(body).encode())
        cases += 1
        assert status < 500, (body, answer)

    sampling()

    @hypothesis.given(keys=st.lists(_KEYS, min_size=1, max_size=3))
    @_settings(max_examples=MAX_EXAMPLES // 4)
    def bias_keys(keys: list[str]) -> None:  # logit_bias keys alone: the fields above take turns
        nonlocal cases
        if time.monotonic() > t_end:
            return
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logit_bias": {k: 1 for k in keys}}
        status, answer = server.request("POST", "/v1/completions", json.dumps(body).encode())
        cases += 1
        assert status < 500, (body, answer)

    bias_keys()
    print(f"schemathesis and the sampling fields' fuzz: {cases} cases, 0 server errors")
    assert cases >= MAX_EXAMPLES


def test_schema_describes_the_request_bodies(tiny_model_dir):
    from specdec import LLM
    from specdec.server.app import ServerConfig, create_app

    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False, max_model_len=128)
    doc = create_app(llm, ServerConfig(model_name="tiny")).openapi()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest") and "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
