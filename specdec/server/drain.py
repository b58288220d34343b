"""A 413 that every client reads: the answer first, then the rest of the request's body read and dropped.

A body over the limit is refused from its Content-Length before a byte of it is read (protocol.py's
``read_body``). Closing the connection right after that answer, with the client still sending, resets it:
a client that reads as it writes (the ``openai`` client, ``requests``) has the 413 by then, but one that
writes the whole body before reading (Python's urllib) gets a connection reset instead, and the kernel
drops the answer it had received. ``DrainingJSONResponse`` therefore sends its whole answer (the client
may read it at once), then reads and drops what is left of the body, at most ``DRAIN_BYTES`` bytes within
``DRAIN_SECONDS`` seconds (nothing is kept: no memory is spent on it), and only then ends the response
(the connection closes). A body announced larger than that, or sent after ``Expect: 100-continue`` (the
client waits for a go-ahead the answer withholds), is not waited for.
"""
from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

DRAIN_BYTES = 256 << 20  # the most of a refused body read and dropped before closing
DRAIN_SECONDS = 10.0  # ... and the longest it is waited for


async def discard_body(receive: Receive, max_bytes: int, seconds: float) -> int:
    """Read and drop what is left of a request's body: until its end, the client's disconnect, more than
    ``max_bytes`` bytes or ``seconds`` seconds, whichever comes first. Returns the bytes dropped."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + seconds, 0
    while dropped <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            break
        if message["type"] != "http.request":  # http.disconnect
            break
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return dropped


class DrainingJSONResponse(JSONResponse):
    """A JSONResponse (a 413's) sent whole, then the rest of the request's body dropped before it ends
    (``discard_body``; see the module's docstring): ``request_headers`` say whether to wait for it."""

    def __init__(self, content: dict, status_code: int, headers: dict[str, str] | None = None, *,
                 request_headers: Headers, max_bytes: int = DRAIN_BYTES, seconds: float = DRAIN_SECONDS) -> None:
        super().__init__(content, status_code, headers=headers)
        length = request_headers.get("content-length", "")
        announced = int(length) if length.isascii() and length.isdigit() else 0
        waits = "100-continue" in request_headers.get("expect", "").lower()
        self.max_bytes = 0 if waits or announced > max_bytes else max_bytes
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.max_bytes:
            return await super().__call__(scope, receive, send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await discard_body(receive, self.max_bytes, self.seconds)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
