"""The FastAPI app: OpenAI-compatible endpoints in front of the engine thread (scheduler.py).

    app = create_app(llm, ServerConfig(model_name="qwen2.5-coder-1.5b"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true``: server-sent events
ending in ``data: [DONE]``), GET /v1/models, GET /health, GET /metrics (Prometheus text).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.runtime.sequence import Sequence
from specdec.server import DEFAULT_SPEC_MAX_BATCH
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, choice, completion_body,
                                     new_id, parse_request, sampling_params, speculative_cap, usage)
from specdec.server.scheduler import RequestHandle, Scheduler

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_batch_size: int = 16
    spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH
    rows_budget: int = 16


def speculative_method(llm) -> str | None:
    """The configured speculation method of ``llm`` (None: plain decoding)."""
    if llm.proposer is None or llm.num_speculative_tokens <= 0:
        return None
    return next((cfg.method for p, cfg in llm._proposers.values() if p is llm.proposer), None)


class _Gate:
    """ASGI middleware: the API key check on /v1/*, and request count / latency by endpoint."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        t0, status = time.perf_counter(), [500]

        async def send_(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path.startswith("/v1") and not self._authorized(scope):
                err = APIError("missing or invalid API key: send 'Authorization: Bearer <key>'", 401,
                               "authentication_error", code="invalid_api_key")
                await JSONResponse(err.body(), err.status)(scope, receive, send_)
            else:
                await self.app(scope, receive, send_)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status[0])).inc()
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)

    def _authorized(self, scope) -> bool:
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode())


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Api:
    """The request handlers: parse, validate, build sequences, submit, answer."""

    def __init__(self, llm, config: ServerConfig, scheduler: Scheduler) -> None:
        self.llm, self.config, self.scheduler = llm, config, scheduler
        self.tokenizer = Tokenizer(llm.target.path)  # the engine thread decodes with llm.tokenizer
        self.method = speculative_method(llm)

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(f"the model '{name}' does not exist: this server serves '{self.config.model_name}'",
                           404, param="model", code="model_not_found")

    def _sequences(self, req, prompts: list[list[int]]) -> list[Sequence]:
        cap = speculative_cap(req.speculative, self.method, self.scheduler.k)
        seqs = []
        for ids in prompts:
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                params = sampling_params(req, len(ids), self.llm.max_model_len, seed)
                try:
                    seq = self.llm._sequence(ids, params)
                except SpecdecError as e:
                    raise APIError(str(e), param="prompt") from None
                seq.num_speculative_tokens = cap
                seqs.append(seq)
        return seqs

    async def completions(self, request: Request) -> Response:
        req = parse_request(CompletionRequest, await request.body())
        self._check_model(req.model)
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]
        return await self._respond(request, req, self._sequences(req, prompts), prompts, chat=False)

    async def chat(self, request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        try:
            ids = self.tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages])
        except SpecdecError as e:
            raise APIError(str(e), param="messages") from None
        return await self._respond(request, req, self._sequences(req, [ids]), [ids], chat=True)

    async def _respond(self, request: Request, req, seqs: list[Sequence], prompts: list[list[int]],
                       chat: bool) -> Response:
        handle = self.scheduler.submit(seqs, asyncio.get_running_loop())
        rid = new_id("chatcmpl" if chat else "cmpl")
        prompt_tokens = sum(len(p) for p in prompts)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(handle, rid, req.model, prompt_tokens, chat, include),
                                     media_type="text/event-stream")
        texts, reasons = ["" for _ in seqs], [None for _ in seqs]
        consume = asyncio.ensure_future(self._collect(handle, texts, reasons))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({consume, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            lost = not consume.done()
            if lost:  # the client went away (or the server stops): free the rows now
                consume.cancel()
                self.scheduler.cancel(handle)
        if lost:
            return Response(status_code=499)  # nobody reads this: the client is gone
        consume.result()  # raises the engine's error, if any
        choices = [choice(i, t, r, chat) for i, (t, r) in enumerate(zip(texts, reasons))]
        return JSONResponse(completion_body(rid, req.model, choices, usage(prompt_tokens, *handle.counts()), chat))

    @staticmethod
    async def _collect(handle: RequestHandle, texts: list[str], reasons: list) -> None:
        async for ev in handle.events():
            if ev.error is not None:
                raise APIError(ev.error, 500, "server_error")
            texts[ev.index] += ev.text
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]

    async def _stream(self, handle: RequestHandle, rid: str, model: str, prompt_tokens: int, chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:
        left = len(handle.seqs)
        try:
            if chat:
                for i in range(len(handle.seqs)):
                    yield _sse(completion_body(rid, model, [choice(i, "", None, chat, True, first=True)], None,
                                               chat, chunk=True))
            async for ev in handle.events():
                if ev.error is not None:
                    yield _sse(APIError(ev.error, 500, "server_error").body())
                    break
                left -= ev.finish_reason is not None
                use = usage(prompt_tokens, *handle.counts()) if left == 0 and not include_usage else None
                yield _sse(completion_body(rid, model, [choice(ev.index, ev.text, ev.finish_reason, chat, True)],
                                           use, chat, chunk=True))
            if include_usage:
                yield _sse(completion_body(rid, model, [], usage(prompt_tokens, *handle.counts()), chat, True))
            yield _sse("[DONE]")
        finally:  # also runs when the client disconnects and the response task is cancelled
            if not handle.done:
                self.scheduler.cancel(handle)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": self.llm.max_model_len}]}


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm, config: ServerConfig) -> FastAPI:
    """An app serving ``llm`` (a loaded specdec.LLM); its engine thread runs while the app runs."""
    metrics = ServerMetrics()
    scheduler = Scheduler(llm, metrics, config.max_batch_size, config.spec_max_batch, config.rows_budget)
    api = _Api(llm, config, scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(e.detail), e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(err.body(), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        err = APIError(f"internal server error: {type(e).__name__}: {e}", 500, "server_error")
        return JSONResponse(err.body(), 500)

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(metrics.render(), media_type=metrics.content_type),
                      methods=["GET"])
    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)
    return app
