"""Bad input gets a 4xx with OpenAI's error JSON, and the server keeps serving; the API key."""
from __future__ import annotations

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

KEY = "secret"
DROP = None  # a field set to DROP is left out of the request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("err") / "model")
    srv = ServerProcess(model, "--speculative-method", "ngram", "--max-batch-size", "2",
                        "--served-model-name", "tiny", "--max-model-len", "128", api_key=KEY)
    yield srv
    srv.stop()


def good(path: str = "/v1/completions") -> dict:
    if path.endswith("chat/completions"):
        return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


def assert_still_serving(server) -> None:
    status, body = server.request("POST", "/v1/completions", good())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def assert_error(status: int, body, expected_status: int, *words: str) -> None:
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    for w in words:
        assert w in err["message"], err


BAD_COMPLETIONS = [
    ({"model": DROP}, 400, "model"),
    ({"prompt": DROP}, 400, "prompt"),
    ({"model": "other-model", "prompt": "Hi"}, 404, "other-model"),
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**9}, 400, "context length"),
    ({"prompt": "hello " * 400}, 400, "context length"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"top_p": 0.0}, 400, "top_p"),
    ({"top_k": -3}, 400, "top_k"),
    ({"min_p": 2.0}, 400, "min_p"),
    ({"stop": [""]}, 400, "stop"),
    ({"foo": 1, "bar": "x"}, 400, "bar, foo"),
    ({"max_tokens": "ten"}, 400, "max_tokens"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"stream": "yes"}, 400, "stream"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [10**7]}, 400, "vocabulary"),
    ({"stop": [1, 2]}, 400, "stop"),
    ({"n": 0}, 400, "n"),
    ({"n": 1000}, 400, "n"),
    ({"seed": 1.5}, 400, "seed"),
    ({"presence_penalty": 5}, 400, "presence_penalty"),
    ({"speculative": {"method": "draft_model"}}, 400, "draft_model"),
    ({"speculative": {"num_speculative_tokens": -1}}, 400, "num_speculative_tokens"),
    ({"speculative": {"turbo": True}}, 400, "turbo"),
    ({"stream_options": {"include_usage": "yes"}}, 400, "include_usage"),
]


@pytest.mark.parametrize("change,status,word", BAD_COMPLETIONS, ids=[str(c) for c, _, _ in BAD_COMPLETIONS])
def test_bad_completion_request(server, change, status, word):
    body = {k: v for k, v in (good() | change).items() if v is not DROP}
    assert_error(*server.request("POST", "/v1/completions", body), status, word)
    assert_still_serving(server)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": "Hi"}, "messages"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"logprobs": "yes"}, "logprobs"),
]


@pytest.mark.parametrize("change,word", BAD_CHATS, ids=[str(c) for c, _ in BAD_CHATS])
def test_bad_chat_request(server, change, word):
    status, body = server.request("POST", "/v1/chat/completions", good("/v1/chat/completions") | change)
    assert_error(status, body, 400, word)
    assert_still_serving(server)


@pytest.mark.parametrize("raw,word", [(b'{"model": "tiny", "prompt": ', "JSON"), (b"[1, 2]", "object"),
                                      (b"\xff\xfe", "JSON"), (b"", "JSON")])
def test_malformed_body(server, raw, word):
    assert_error(*server.request("POST", "/v1/completions", raw), 400, word)
    assert_error(*server.request("POST", "/v1/chat/completions", raw), 400, word)
    assert_still_serving(server)


def test_missing_chat_messages(server):
    assert_error(*server.request("POST", "/v1/chat/completions", {"model": "tiny"}), 400, "messages")


def test_api_key(server):
    for key in (None, "wrong"):
        status, body = server.request("POST", "/v1/completions", good(), key=key)
        assert_error(status, body, 401, "API key")
        assert body["error"]["type"] == "authentication_error"
        assert server.request("GET", "/v1/models", key=key)[0] == 401
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("GET", "/metrics", key=None)[0] == 200
    assert server.request("GET", "/v1/models")[1]["data"][0]["id"] == "tiny"
    assert server.metric("specdec:http_requests_total", 'endpoint="/v1/completions",status="401"') >= 2


def test_unknown_route_and_method(server):
    assert_error(*server.request("GET", "/v1/nothing"), 404, "Not Found")
    assert_error(*server.request("GET", "/v1/completions"), 405, "Method Not Allowed")


def test_requests_beyond_the_batch_wait_and_finish(server):
    """Max batch 2: four n=2 requests queue; all finish; the server is idle afterwards."""
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: server.request("POST", "/v1/completions", good() | {
            "n": 2, "max_tokens": 20, "ignore_eos": True, "temperature": 0.0, "prompt": f"Hello {i}"}), range(4)))
    assert all(s == 200 and [c["index"] for c in b["choices"]] == [0, 1] for s, b in outs)
    assert all(b["usage"]["completion_tokens"] == 40 for _, b in outs)
    assert server.wait_metric("specdec:num_requests_waiting", 0) == 0
    assert server.wait_metric("specdec:num_requests_running", 0) == 0
