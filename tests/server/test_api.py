"""The OpenAI-compatible server with the official openai client: a tiny target and an imperfect draft."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time

import pytest

from conftest import make_model_dir
from server_util import KEY, ServerProcess, spec

openai = pytest.importorskip("openai")

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nfor i in range(10):", "Hello world!",
           "Speculative decoding drafts", "The capital of France", "print(i, os", "jumps over the lazy"]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("srv") / "model")
    # a real, imperfect draft (another random model): most drafts are rejected, so the served
    # rejection path runs; 8 concurrent requests cross --spec-max-batch 4: speculation switches off and on
    # (--no-cost-aware: drafts this poor would have the cost-aware policy turn drafting off, as it should)
    draft = make_model_dir(tmp_path_factory.mktemp("srv") / "draft", seed=3, layers=1)
    srv = ServerProcess(model, "--speculative-model", str(draft), "--num-speculative-tokens", "4",
                        "--max-batch-size", "8", "--spec-max-batch", "4", "--no-cost-aware", api_key=KEY)
    yield srv
    srv.stop()


def test_models_health_and_basic_completion(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert server.request("GET", "/health", key=None) == (200, {"status": "ok", "consecutive_failures": 0, "restarts": 0})
    out = client.completions.create(model=server.model, prompt="def fibonacci(n):", **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    u = out.usage
    assert u.completion_tokens == 24 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + 24
    assert u.num_draft_tokens > 0 and 0 <= u.num_accepted_tokens <= u.num_draft_tokens


def test_chat_streaming_equals_non_streaming(server, client):
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=server.model, messages=msgs, **GREEDY)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.num_draft_tokens == full.usage.num_draft_tokens


def test_chat_template_kwargs_reach_the_template(server, client):
    """Qwen3's ``enable_thinking`` and the like, as vLLM takes them: passed to the template (this one
    ignores the switch: the same reply); a key the server sets itself is a 400, not a 500."""
    msgs = [{"role": "user", "content": "Hello there"}]
    plain = client.chat.completions.create(model=server.model, messages=msgs, **GREEDY)
    kw = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}}
    assert client.chat.completions.create(model=server.model, messages=msgs, **kw).choices[0].message.content \
        == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=server.model, messages=msgs, **{
            **GREEDY, "extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}})


def test_completion_streaming_without_include_usage_sends_no_usage(server, client):
    """As OpenAI: usage only when stream_options.include_usage asks for it (tests/server/test_playground.py)."""
    full = client.completions.create(model=server.model, prompt="Hello", **GREEDY)
    chunks = list(client.completions.create(model=server.model, prompt="Hello", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, client, stream):
    text = client.completions.create(model=server.model, prompt="The quick", **GREEDY).choices[0].text
    stop = text[6:9]
    kw = GREEDY | {"stop": [stop, "never-seen-stop"]}
    if stream:
        chunks = list(client.completions.create(model=server.model, prompt="The quick", stream=True, **kw))
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        c = client.completions.create(model=server.model, prompt="The quick", **kw).choices[0]
        got, reason = c.text, c.finish_reason
    assert got == text[:text.find(stop)] and reason == "stop"


def test_seed_reproducible_and_n_choices(server, client):
    kw = {"model": server.model, "prompt": "Hello", "temperature": 1.0, "max_tokens": 16,
          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a
    assert client.completions.create(seed=8, **kw).choices[0].text != a
    # what is guaranteed (README, "Server"): a seeded request repeats exactly under the same batch and
    # draft lengths; without speculation it repeats whatever else is batched (n=3 runs three rows)
    off = kw | {"extra_body": {"ignore_eos": True, "speculative": {"enabled": False}}}
    alone = client.completions.create(seed=7, **off).choices[0].text
    many = client.completions.create(seed=7, n=3, **off)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.choices[0].text == alone
    assert len({c.text for c in many.choices}) > 1 and many.usage.completion_tokens == 48
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          temperature=1.0, max_completion_tokens=8, seed=1,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 16


def test_greedy_identical_with_and_without_speculation(server, client):
    for prompt in PROMPTS[:3]:
        on = client.completions.create(model=server.model, prompt=prompt, temperature=0.0, max_tokens=32,
                                       extra_body=spec(True))
        off = client.completions.create(model=server.model, prompt=prompt, temperature=0.0, max_tokens=32,
                                        extra_body=spec(False))
        k1 = client.completions.create(model=server.model, prompt=prompt, temperature=0.0, max_tokens=32,
                                       extra_body={"speculative": {"num_speculative_tokens": 1}, "ignore_eos": True})
        assert on.choices[0].text == off.choices[0].text == k1.choices[0].text
        assert off.usage.num_draft_tokens == 0 and on.usage.num_draft_tokens > k1.usage.num_draft_tokens > 0
        assert on.usage.num_accepted_tokens < on.usage.num_draft_tokens  # an imperfect draft: rejections


def test_greedy_identical_alone_and_among_concurrent_requests(server, client):
    alone = [client.completions.create(model=server.model, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as ac:
            outs = await asyncio.gather(*[ac.completions.create(model=server.model, prompt=p, stream=i % 2 == 1,
                                                                **GREEDY) for i, p in enumerate(PROMPTS)])
            texts = []
            for o in outs:
                texts.append(o.choices[0].text if not hasattr(o, "__aiter__")
                             else "".join([c.choices[0].text async for c in o]))
            return texts

    assert asyncio.run(together()) == alone
    assert server.wait_metric("specdec:num_requests_running", 0) == 0


def _stream_and_hang_up(server, body: dict, read_first: bool) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    if read_first:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    else:  # hang up once its sequences run (a 250-token request takes ~0.2 s on the tiny model)
        deadline = time.monotonic() + 5
        while server.metric("specdec:num_requests_running") < body["n"] and time.monotonic() < deadline:
            time.sleep(0.005)
    conn.sock.shutdown(socket.SHUT_RDWR)  # hang up even while the response still holds the socket
    conn.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_its_rows(server, stream):
    aborted = server.metric("specdec:request_success_total", 'finished_reason="abort"')
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 250, "n": 4, "stream": stream,
            "temperature": 0.0, "ignore_eos": True, "speculative": {"enabled": False}}
    _stream_and_hang_up(server, body, read_first=stream)
    assert server.wait_metric("specdec:request_success_total", aborted + 4,
                              labels='finished_reason="abort"') == aborted + 4
    assert server.wait_metric("specdec:num_requests_running", 0) == 0
    assert server.metric("specdec:num_requests_waiting") == 0
    assert client_ok(server)


def client_ok(server) -> bool:
    status, body = server.request("POST", "/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2})
    return status == 200 and body["usage"]["completion_tokens"] >= 1


def test_metrics_after_requests(server, client):
    client.completions.create(model=server.model, prompt="Hello", **GREEDY)
    status, text = server.request("GET", "/metrics", key=None)
    assert status == 200
    for name in ("specdec:http_requests_total", "specdec:e2e_request_latency_seconds_bucket",
                 "specdec:time_to_first_token_seconds_count", "specdec:time_per_output_token_seconds_count",
                 "specdec:spec_decode_num_draft_tokens_total", "specdec:spec_decode_num_accepted_tokens_total",
                 "specdec:spec_decode_num_accepted_tokens_per_pos_total", "specdec:num_requests_running",
                 "specdec:num_requests_waiting", "process_resident_memory_bytes"):
        assert name in text, name
    assert server.metric("specdec:http_requests_total", 'endpoint="/v1/completions",status="200"') > 0
    assert server.metric("specdec:spec_decode_num_draft_tokens_per_pos_total", 'position="0"') > 0
    assert server.metric("specdec:spec_decode_num_draft_tokens_total") > 0
    # the per-position counts add up to the total (the random draft may have had nothing accepted at all:
    # how many is chance, that they agree is not)
    per_pos = re.findall(r'^specdec:spec_decode_num_accepted_tokens_per_pos_total\{position="\d+"\} ([0-9.e+-]+)$',
                         server.request("GET", "/metrics", key=None)[1], re.M)
    assert sum(map(float, per_pos)) == server.metric("specdec:spec_decode_num_accepted_tokens_total")


def test_load_script_runs_clean(server):
    from specdec.tools.bench import load
    assert load.main(["--url", server.url, "--api-key", KEY, "--requests", "16", "--concurrency", "6",
                      "--max-tokens", "12", "--settle", "0"]) == 0


def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path):
    """SIGTERM: the stream already running finishes whole, then the process exits with status 0."""
    model = make_model_dir(tmp_path / "model")
    srv = ServerProcess(model, "--drain-timeout", "20")
    body = {"model": srv.model, "prompt": "Hello", "max_tokens": 120, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        srv.proc.terminate()
        rest = resp.read().decode()
    finally:
        conn.close()
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
    assert srv.proc.wait(30) == 0
    srv.stop()
