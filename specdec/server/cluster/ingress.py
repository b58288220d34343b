"""The ingress deployment: behind Ray Serve's HTTP proxy, in front of the engine replicas.

It forwards each request, as it arrived, to an engine replica through a DeploymentHandle (a
streaming call: one message per response part) with the request's route key for the router, and
passes the replica's answer through unchanged: status, headers and body, 4xx included, streams
included. What it adds is what only a caller of several replicas can do:

- a replica that dies (or answers 503: draining, its engine dead or restarting) before the first byte
  of its answer reached the client: the request is resent to another replica (never again to one that
  answered 503 while others remain), up to ``retries`` times, with a short
  back-off; no client sees it. A non-streaming answer is sent in one piece at its end, so this covers
  every non-streaming request;
- with every retry spent, or no replica answering within ``--request-timeout`` (and a grace): 503 with
  ``Retry-After`` and code ``replica_unavailable`` (the openai client retries it by itself);
- a replica that dies while its stream is under way: the stream ends with an error event (code
  ``replica_failed``, status 503) and ``data: [DONE]``; the client resends the request;
- a body over ``--max-body-mb``: 413 before it is read, as a replica would answer (``protocol.read_body``);
- ``GET /metrics``: every replica's metrics merged (``metrics.py``);
- ``GET /``: the web playground (``server/playground.py``), served here from the package.
"""
from __future__ import annotations

import asyncio
import logging
import time

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specdec.server.cluster.metrics import IngressMetrics
from specdec.server.cluster.relay import REPLICA_HEADER, HTTPCall
from specdec.server.cluster.routing import route_key
from specdec.server.playground import page
from specdec.server.protocol import APIError, read_body, sse

REPLICA_GONE = (RayActorError, ReplicaUnavailableError)
log = logging.getLogger("specdec.cluster")
TIMEOUT_GRACE_S = 5.0  # past --request-timeout the replica answers 408 itself; the ingress waits this much more


class _Retry(Exception):
    """The replica failed before answering: send the request elsewhere (``replica``: its id, when it
    answered a 503; a replica that died is dropped by Serve's router)."""

    def __init__(self, replica: str | None = None) -> None:
        super().__init__(replica)
        self.replica = replica


class Ingress:
    """A Ray Serve deployment class (HTTP callable); ``engine`` and ``board``: DeploymentHandles."""

    def __init__(self, engine, board, retries: int = 3, request_timeout: float | None = None,
                 max_body_bytes: int | None = None) -> None:
        self.engine, self.board = engine.options(stream=True), board
        self.retries, self.max_body_bytes = retries, max_body_bytes
        self.timeout = None if request_timeout is None else request_timeout + TIMEOUT_GRACE_S
        self.metrics = IngressMetrics()

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path == "/metrics":
            text = await self.board.merged.remote({"ingress": self.metrics.render()})
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        static = page(request.url.path) if request.method == "GET" else None
        if static is not None:  # the playground's files: from the package, no replica needed
            return static
        try:
            body = await read_body(request, self.max_body_bytes)
        except APIError as e:  # a body over the limit: 413, never forwarded
            return JSONResponse(e.body(), e.status)
        call = HTTPCall(request.method, request.url.path, request.url.query.encode(), tuple(request.headers.raw), body)
        key = route_key(call.path, body)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        avoid: tuple[str, ...] = ()  # replicas that answered 503: the router picks others while it can
        for attempt in range(self.retries + 1):
            gen = self.engine.forward.remote(call, route_key=key, avoid=avoid)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                start, first = await asyncio.wait_for(self._head(gen, attempt < self.retries), left)
            except _Retry as r:
                gen.cancel()
                avoid += (r.replica,) if r.replica else ()
                self.metrics.retries.inc()
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
                continue
            except asyncio.TimeoutError:
                gen.cancel()
                break
            return self._respond(start, first, gen)
        self.metrics.failed.labels(stage="before_response").inc()
        err = APIError("no engine replica could take the request (replicas died, are restarting or are "
                       "shutting down): retry it", 503, "server_error", code="replica_unavailable",
                       headers={"Retry-After": "1"})
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @staticmethod
    async def _head(gen, may_retry: bool) -> tuple[dict, dict]:
        """The answer's start and first body message; _Retry when the replica failed before them."""
        try:
            start = await gen.__anext__()
            first = await gen.__anext__()
        except REPLICA_GONE as e:
            log.warning("engine replica failed before answering: %s", e)
            raise _Retry from None
        if start["status"] == 503 and may_retry and not first.get("more_body", False):
            # a draining replica, or one whose engine died or is restarting: another may take it
            raise _Retry(dict(start["headers"]).get(REPLICA_HEADER, b"").decode() or None)
        return start, first

    def _respond(self, start: dict, first: dict, gen) -> Response:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
                   if k.lower() != b"content-length"}
        if not first.get("more_body", False):  # a whole answer (JSON, or an error)
            return Response(first["body"], start["status"], headers=headers)
        event_stream = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._rest(first, gen, event_stream), start["status"], headers=headers)

    async def _rest(self, first: dict, gen, event_stream: bool):
        try:
            yield first["body"]
            async for message in gen:
                if message["type"] == "http.response.body":
                    yield message["body"]
        except REPLICA_GONE as e:
            log.warning("engine replica failed during a stream: %s", e)
            self.metrics.failed.labels(stage="streaming").inc()
            if event_stream:
                err = APIError("the engine replica serving this stream failed before it finished: resend the "
                               "request (the text above is incomplete)", 503, "server_error", code="replica_failed")
                yield sse(err.body()).encode()
                yield sse("[DONE]").encode()
        finally:  # also when the client went away: stop the replica's work on it
            gen.cancel()
