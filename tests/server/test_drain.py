"""A 413 every client reads (drain.py): the answer sent whole first, then the rest of the refused body read
and dropped within bounds (bytes, seconds), and not waited for where it cannot help. The end-to-end
check, a client that writes the whole body before reading (urllib), is in test_limits.py."""
from __future__ import annotations

import asyncio
import json

from starlette.datastructures import Headers

from specdec.server.drain import DrainingJSONResponse, discard_body


def body_receive(chunks: int, size: int = 1000, stall: bool = False):
    """An ASGI receive giving ``chunks`` body messages of ``size`` bytes (then the body's end, or with
    ``stall`` nothing more ever); ``sent`` counts what was taken."""
    sent = [0]

    async def receive() -> dict:
        if sent[0] == chunks:
            if stall:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}
        sent[0] += 1
        return {"type": "http.request", "body": b"x" * size, "more_body": sent[0] < chunks}
    return receive, sent


def test_the_rest_of_the_body_is_dropped_within_bounds():
    receive, sent = body_receive(10)
    assert asyncio.run(discard_body(receive, 1 << 20, 5.0)) == 10_000 and sent[0] == 10  # to the body's end
    receive, sent = body_receive(100)
    assert asyncio.run(discard_body(receive, 2_500, 5.0)) == 3_000 and sent[0] == 3  # past max_bytes: stops
    receive, sent = body_receive(2, stall=True)
    assert asyncio.run(discard_body(receive, 1 << 20, 0.2)) == 2_000  # the client stalls: the time limit


def answer(headers: dict[str, str], receive) -> list[dict]:
    """The messages a DrainingJSONResponse to a request with ``headers`` sends."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
    response = DrainingJSONResponse({"error": {"code": "request_body_too_large"}}, 413,
                                    request_headers=Headers(headers), max_bytes=1 << 20, seconds=5.0)
    asyncio.run(response(scope={"type": "http"}, receive=receive, send=send))
    return sent


def test_the_whole_answer_goes_first_then_the_body_is_read_then_the_response_ends():
    receive, sent = body_receive(50)
    messages = answer({"content-length": "50000"}, receive)
    assert messages[0]["status"] == 413 and json.loads(messages[1]["body"])["error"]["code"] == "request_body_too_large"
    assert messages[1]["more_body"] is True  # the client may read the whole answer now
    assert sent[0] == 50 and messages[2] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_body_too_large_to_drop_or_held_back_for_100_continue_is_not_waited_for():
    for headers in ({"content-length": str(2 << 20)}, {"content-length": "50000", "expect": "100-continue"}):
        receive, sent = body_receive(50)
        messages = answer(headers, receive)
        assert sent[0] == 0 and messages[0]["status"] == 413 and messages[-1].get("more_body", False) is False
