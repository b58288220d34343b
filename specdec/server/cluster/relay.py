"""One HTTP request through an ASGI app inside this process, its response as ASGI messages.

An engine replica (``replica.py``) runs the single-process server's FastAPI app unchanged and
answers each request the ingress forwards by calling the app here: the same parsing, validation,
scheduling and rendering as ``specdec serve``, with no socket in between. The messages come back as
the app sends them (``http.response.start``, then one ``http.response.body`` per streamed event),
so a stream stays a stream. When the caller stops reading (the client went away, or the ingress
cancelled), the app is told ``http.disconnect`` and cancels the request's sequences as it does for
a closed connection.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

DISCONNECT_GRACE_S = 2.0  # how long the app may take to wind a request down after the disconnect
REPLICA_HEADER = b"x-specdec-replica"  # a replica's answers name it (the ingress resends a 503 elsewhere)


@dataclass(frozen=True)
class HTTPCall:
    """What the ingress forwards: the request as it arrived (headers as raw (name, value) pairs)."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query, "root_path": "", "headers": list(self.headers),
                "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}


async def call_asgi(app, call: HTTPCall) -> AsyncIterator[dict]:
    """Run ``call`` through ``app``; yield its response messages until the last body message."""
    out: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(call.scope(), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()
