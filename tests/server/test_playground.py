"""The playground's server side: its page at /, the model card's speculation, per-token provenance in
the stream (read by the official openai client too), OpenAI's streamed usage, the start-up banner."""
from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

openai = pytest.importorskip("openai")

# a tiny random model repeats itself on a repetitive prompt: n-gram drafts get accepted, others rejected
LOOP = [{"role": "user", "content": "the cat the cat the cat the cat the cat the cat"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("playground")
    # --no-cost-aware: a random model's n-gram drafts mostly fail, and the cost-aware policy would turn them off
    srv = ServerProcess(make_model_dir(root / "model"), "--speculative-method", "ngram", "--num-speculative-tokens",
                        "4", "--no-cost-aware", log=root / "serve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def sse_events(server: ServerProcess, body: dict) -> list[dict]:
    """The JSON events of one streamed request, read raw (what the client library would hide)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        lines = [x for x in resp.read().decode().split("\n\n") if x.startswith("data: ")]
    finally:
        conn.close()
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


def test_the_page_and_its_files_are_served(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for path, kind, needle in (("/", "text/html", b"<textarea"), ("/static/playground.js", "text/javascript",
                                   b"provenance"), ("/static/playground.css", "text/css", b"data-source"),
                                   ("/static/favicon.svg", "image/svg+xml", b"<svg")):
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200 and resp.getheader("content-type").startswith(kind) and needle in body, path
    finally:
        conn.close()
    status, body = server.request("GET", "/static/../app.py")
    assert status == 404 and "error" in body


def test_the_model_card_names_the_method_k_and_the_per_request_options(client):
    card = client.models.list().data[0].model_extra["speculative"]
    assert card["method"] == "ngram" and card["num_speculative_tokens"] == 4
    k = card["per_request"]["num_speculative_tokens"]
    assert k["type"] == "integer" and k["minimum"] == 1 and k["maximum"] == 4 and k["default"] == 4


def test_the_banner_names_the_method_and_k(server):
    out = server.output()
    assert "speculation: ngram, K=4" in out and f"playground: {server.url}/" in out, out


def _tokens(chunks) -> tuple[str, list[dict], dict | None]:
    """(content joined, provenance tokens joined, the last provenance counts) of an openai-client stream."""
    content, tokens, last = "", [], None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            ext = (c.model_extra or {}).get("specdec")
            if ext is not None:
                tokens += ext["tokens"]
                last = ext
    return content, tokens, last


def test_the_openai_client_reads_streams_with_and_without_provenance(server, client):
    kw = dict(model=server.model, messages=LOOP, max_tokens=40, temperature=0.0, stream=True)
    plain = list(client.chat.completions.create(**kw))
    marked = list(client.chat.completions.create(**kw, extra_body={"specdec": {"provenance": True}}))
    text, tokens, _ = _tokens(plain)
    assert tokens == [] and text  # not asked: no extension field
    text2, tokens, last = _tokens(marked)
    assert text2 == text == "".join(t["text"] for t in tokens)  # the tokens are exactly the text
    sources = {t["source"] for t in tokens}
    assert sources == {"draft", "target"}, tokens  # accepted n-gram drafts and the target's own tokens
    drafted = sum(t["source"] == "draft" for t in tokens)
    assert 0 < drafted <= last["accepted_tokens"] <= last["draft_tokens"]
    assert last["completion_tokens"] == 40 and 0 < last["steps"] < 40 and last["k"] == 4
    assert len(last["drafted_at"]) == 4 and sum(last["accepted_at"]) == last["accepted_tokens"]
    assert all(a <= d for a, d in zip(last["accepted_at"], last["drafted_at"]))
    assert last["speculation_off"] is None


def test_provenance_with_speculation_off_is_all_target(server, client):
    chunks = client.chat.completions.create(model=server.model, messages=LOOP, max_tokens=24, temperature=0.0,
                                            stream=True, extra_body={"specdec": {"provenance": True},
                                                                     "speculative": {"enabled": False}})
    text, tokens, last = _tokens(chunks)
    assert text == "".join(t["text"] for t in tokens) and {t["source"] for t in tokens} == {"target"}
    assert last["k"] == 0 and last["draft_tokens"] == 0 and last["steps"] == 24
    assert last["speculation_off"] == "the request asked for no drafts"  # what the playground shows


def test_provenance_follows_the_text_through_a_stop_string(server, client):
    """The scheduler holds back a stop string's possible start and the stop cuts the text: each chunk's
    tokens are still exactly its text."""
    kw = dict(model=server.model, messages=LOOP, max_tokens=40, temperature=0.0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    chunks = list(client.chat.completions.create(**kw, stop=[stop, "never-seen-stop"], stream=True,
                                                 extra_body={"specdec": {"provenance": True}}))
    for ch in chunks:
        for c in ch.choices:
            ext = (c.model_extra or {}).get("specdec")
            if ext is not None:
                assert "".join(t["text"] for t in ext["tokens"]) == (c.delta.content or "")
    text, tokens, _ = _tokens(chunks)
    assert text == full[:full.find(stop)] == "".join(t["text"] for t in tokens)


def test_a_whole_answer_carries_provenance_too(server, client):
    out = client.chat.completions.create(model=server.model, messages=LOOP, max_tokens=30, temperature=0.0,
                                         extra_body={"specdec": {"provenance": True}})
    c = out.choices[0]
    ext = c.model_extra["specdec"]
    assert "".join(t["text"] for t in ext["tokens"]) == c.message.content
    assert ext["accepted_tokens"] == out.usage.num_accepted_tokens and ext["completion_tokens"] == 30


def test_bad_extension_fields_are_a_400(server):
    for bad, param in (({"provenance": "yes"}, "specdec.provenance"), ({"colours": True}, "specdec.colours")):
        status, body = server.request("POST", "/v1/chat/completions",
                                      {"model": server.model, "messages": LOOP, "specdec": bad})
        assert status == 400 and body["error"]["param"] == param, body


def test_streamed_usage_follows_openai(server):
    """OpenAI: no usage in stream chunks unless stream_options.include_usage; then "usage": null in every
    chunk and the usage in one last chunk without choices."""
    body = {"model": server.model, "messages": LOOP, "max_tokens": 8, "stream": True}
    events = sse_events(server, body)
    assert events and all("usage" not in e for e in events)
    events = sse_events(server, body | {"stream_options": {"include_usage": True}})
    assert all(e["usage"] is None and e["choices"] for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_the_ingress_serves_the_page_without_a_replica():
    pytest.importorskip("ray")
    from starlette.requests import Request

    from specdec.server.cluster.ingress import Ingress

    class NoReplica:  # any request reaching a replica fails the test
        def options(self, **_):
            return self

        @property
        def forward(self):
            raise AssertionError("the page went to an engine replica")

    ingress = Ingress(NoReplica(), board=None)
    for path, kind in (("/", "text/html"), ("/static/playground.js", "text/javascript")):
        scope = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}
        resp = asyncio.run(ingress(Request(scope)))
        assert resp.status_code == 200 and resp.media_type.startswith(kind)


def test_the_cluster_banner_names_the_method_and_k():
    pytest.importorskip("ray")
    from specdec.cli import build_parser
    from specdec.server.cluster.launch import _speculation

    def label(*flags: str) -> str:
        return _speculation(build_parser().parse_args(["serve", "--model", "m", "--replicas", "2", *flags]))

    assert label("--speculative-method", "ngram", "--num-speculative-tokens", "3") == "ngram, K=3"
    assert label("--speculative-method", "ngram", "--adaptive") == "ngram, K=5 (adaptive)"
    assert label() == "off"
