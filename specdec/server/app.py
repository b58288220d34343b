"""The FastAPI app: OpenAI-compatible endpoints in front of the engine thread (scheduler.py).

    app = create_app(llm, ServerConfig(model_name="qwen2.5-coder-1.5b"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true``: server-sent events
ending in ``data: [DONE]``), GET /v1/models, GET /health (503 when the engine thread is dead or
hung, or the engine is broken: see scheduler.py; its body counts the engine's failures in a row and
its restarts), GET /metrics (Prometheus text), GET /openapi.json (the request schemas, for fuzzers), and
the web playground at GET / (playground.py).

Overload control, so that no one request can load the server past its limits (docs/server.md,
"Limits"): a body over ``max_body_bytes`` is a 413, answered from its Content-Length before it is
read (a chunked one: once that much has arrived), the rest of it then read and dropped before the
connection closes (a client that writes the whole body first reads the 413 too: drain.py); at most
``max_prompts`` prompts, ``MAX_N`` choices, ``MAX_STOP`` stop strings of ``MAX_STOP_CHARS`` characters
and ``max_request_tokens`` tokens (prompt + max_tokens, over every choice) per request (400 naming the
field); a prompt of more
characters than any prompt that fits the context has is a 400 before it is tokenized; at most
``max_waiting`` sequences (each choice of each prompt) waiting for a row, a new request's own counted
(429 with ``Retry-After``; a request of more than that alone, 400, before its prompts are tokenized);
``request_timeout`` seconds per request (408, or an error event on a stream; 600 by default, so a
client never waits forever); 503 with ``Retry-After`` while the engine is dead or restarting.
Tokenization runs off the event loop in two lanes: requests with bodies over ``LARGE_BODY_BYTES``
on one thread, the others on another, so a huge prompt holds up only the huge ones queued behind it.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.args import deployment_config, speculative_config
from specdec.errors import SpecdecError
from specdec.runtime.sequence import Sequence
from specdec.server.flags import (DEFAULT_MAX_BODY_MB, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_REQUEST_TIMEOUT,
                                  DEFAULT_SPEC_MAX_BATCH, engine_limits)
from specdec.server.metrics import ServerMetrics
from specdec.server.openapi import openapi_schema
from specdec.server.playground import FILES, page, speculation_card
from specdec.server.constraints import structured_output
from specdec.server.drain import DrainingJSONResponse
from specdec.server.protocol import (MAX_N, APIError, ChatCompletionRequest, CompletionRequest, completion_body,
                                     new_id, parse_request, read_body, sampling_params, speculative_cap, sse,
                                     usage)
from specdec.server.render import ChoiceRenderer
from specdec.server.scheduler import Event, RequestHandle, Scheduler, too_many_sequences
from specdec.server.tools import supports_tools, tags_are_tokens
from specdec.server.traffic import TrafficRecorder

if TYPE_CHECKING:
    from specdec.llm import LLM

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
LARGE_BODY_BYTES = 64 << 10  # requests with larger bodies tokenize on a thread of their own (``_Api``)
# no prompt of more than ``NORMALIZED_CHARS x`` (the longest token's characters) x (the context) characters
# fits the context: a token stands for at most the longest token's characters of normalized text, and
# Unicode normalization (NFC, as Qwen's tokenizer does) composes at most four code points into one
NORMALIZED_CHARS = 4


@dataclass(frozen=True)
class ServerConfig:
    """What ``specdec serve`` was asked for (None: no limit)."""

    model_name: str
    api_key: str | None = None
    max_batch_size: int = 16
    spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH
    rows_budget: int = 16
    max_waiting: int | None = 256  # sequences waiting for a row; past it: 429
    max_prompts: int = 64  # prompts in one completion request
    max_request_tokens: int | None = None  # prompt + max_tokens over a request's choices
    max_body_bytes: int | None = DEFAULT_MAX_BODY_MB << 20  # request body size; past it 413
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT  # seconds from arrival to the last token (None: none)
    max_prefill_tokens: int | None = DEFAULT_MAX_PREFILL_TOKENS  # chunked prefill: prompt tokens per engine step
    stale_after: float = 60.0  # seconds without an engine beat before /health says 503
    record_traffic: str | None = None  # directory recording prompts and outputs (traffic.py); None: off
    record_traffic_bytes: int = 1 << 30  # at most this much recorded (oldest files go first)


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


class _Api:
    """The request handlers: parse, validate, build sequences, submit, answer."""

    def __init__(self, llm, config: ServerConfig, scheduler: Scheduler) -> None:
        self.llm, self.config, self.scheduler = llm, config, scheduler
        self.tokenizer = llm.tokenizer.copy()  # the engine thread decodes with llm.tokenizer
        self.special_tags = tags_are_tokens(self.tokenizer)  # forced tool calls write <tool_call> as one token
        # tokenization and sequence building, off the event loop, in two lanes: requests whose body is over
        # LARGE_BODY_BYTES on one thread, the others on another, so that a huge prompt (seconds of
        # tokenizing) holds up only the large requests behind it; sequences are built under one lock
        # (make_sequence draws seeds)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize")
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize-large")
        self._build = threading.Lock()
        longest = max(map(len, self.tokenizer.hf.get_vocab()), default=1)
        self.max_prompt_chars = NORMALIZED_CHARS * longest * llm.max_model_len  # more cannot fit: see above

    async def _off_loop(self, large: bool, fn, *args):
        pool = self.large_pool if large else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _check_size(self, req, prompts: list, chars: int, param: str) -> None:
        """Before tokenizing: 400 for a request of more sequences than may wait for a row, or for a
        prompt of more characters than any prompt that fits the context."""
        count, limit = len(prompts) * req.n, self.scheduler.max_waiting
        if limit is not None and count > limit:
            raise APIError(too_many_sequences(count, limit), param="n", code="too_many_sequences")
        if chars > self.max_prompt_chars:
            raise APIError(f"this model's maximum context length is {self.llm.max_model_len} tokens, but the prompt "
                           f"has {chars:,} characters, more than any prompt of that many tokens has (at most "
                           f"{self.max_prompt_chars:,} here): shorten the prompt", param=param,
                           code="context_length_exceeded")

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(f"the model '{name}' does not exist: this server serves '{self.config.model_name}'",
                           404, param="model", code="model_not_found")

    def _sequences(self, req, prompts: list[list[int]]) -> list[Sequence]:
        cap = speculative_cap(req.speculative, self.llm.speculative if self.scheduler.k else None)
        constraint = self._constraint(req)
        plan = []  # (prompt ids, sampling parameters) of each sequence
        for ids in prompts:
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                plan.append((ids, sampling_params(req, len(ids), self.llm.max_model_len, seed, constraint)))
        limit = self.config.max_request_tokens
        total = sum(len(ids) + params.max_tokens for ids, params in plan)
        if limit is not None and total > limit:
            raise APIError(f"the request asks for {total} tokens (prompt + max_tokens over {len(plan)} choices), "
                           f"more than this server's limit of {limit} per request: lower max_tokens, n or the "
                           "number of prompts", param="max_tokens", code="request_too_large")
        seqs = []
        with self._build:
            for ids, params in plan:
                try:
                    seq = self.llm.make_sequence(ids, params)
                except SpecdecError as e:  # the prompt, or a logit_bias id outside the vocabulary
                    param = "logit_bias" if str(e).startswith("logit_bias") else "prompt"
                    raise APIError(str(e), param=param) from None
                seq.num_speculative_tokens = cap
                seqs.append(seq)
        return seqs

    def _constraint(self, req):
        """The request's structured-output constraint (None: none), compiled here once (the engine's
        compiler caches it for every choice): a schema, regex or grammar that does not compile is a
        400 naming the field it came from, before anything reaches the engine."""
        found = structured_output(req, self.special_tags)
        if found is None:
            return None
        field, so = found
        try:
            self.llm.grammars.grammar(so)
        except Exception as e:  # noqa: BLE001 (whatever the grammar engine raises, the request's text caused it)
            msg = str(e) if isinstance(e, SpecdecError) else f"invalid structured output ({so.kind}): {e}"
            raise APIError(msg, param=field, code="invalid_value") from None
        return so

    def _completion_sequences(self, req: CompletionRequest) -> tuple[list[Sequence], list[list[int]]]:
        raw = req.prompts()
        if len(raw) > self.config.max_prompts:
            raise APIError(f"the request has {len(raw)} prompts, more than this server's limit of "
                           f"{self.config.max_prompts}: split it", param="prompt", code="too_many_prompts")
        self._check_size(req, raw, max((len(p) for p in raw if isinstance(p, str)), default=0), "prompt")
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in raw]
        return self._sequences(req, prompts), prompts

    def _chat_sequences(self, req: ChatCompletionRequest) -> tuple[list[Sequence], list[list[int]]]:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tool_mode() != "off" else None
        if tools and not supports_tools(self.tokenizer.chat_template):
            raise APIError("this model's chat template has no tool-call format (such as Qwen2.5's <tool_call>): "
                           "send the request without tools, or serve a model that calls tools", param="tools",
                           code="unsupported_parameter")
        self._check_size(req, [req.messages], sum(len(_text(m)) for m in req.messages), "messages")
        try:
            ids = self.tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages], tools,
                                                     req.chat_template_kwargs)
        except SpecdecError as e:
            raise APIError(str(e), param="messages") from None
        return self._sequences(req, [ids]), [ids]

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.config.max_body_bytes)
        req = parse_request(CompletionRequest, body)
        self._check_model(req.model)
        seqs, prompts = await self._off_loop(len(body) > LARGE_BODY_BYTES, self._completion_sequences, req)
        return await self._respond(request, req, seqs, prompts, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self.config.max_body_bytes)
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req.model)
        seqs, prompts = await self._off_loop(len(body) > LARGE_BODY_BYTES, self._chat_sequences, req)
        return await self._respond(request, req, seqs, prompts, chat=True)

    async def _respond(self, request: Request, req, seqs: list[Sequence], prompts: list[list[int]],
                       chat: bool) -> Response:
        provenance = req.specdec is not None and req.specdec.provenance
        try:
            handle = self.scheduler.submit(seqs, asyncio.get_running_loop(), provenance)
        except APIError as e:
            self.scheduler.metrics.rejected.labels(reason=e.code or "other").inc()
            raise
        timeout = self.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        rid = new_id("chatcmpl" if chat else "cmpl")
        prompt_tokens = sum(len(p) for p in prompts)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            render = ChoiceRenderer(req, seqs, self.tokenizer, chat)
            return StreamingResponse(self._stream(handle, rid, req.model, prompt_tokens, chat, include, deadline,
                                                  render), media_type="text/event-stream")
        texts, reasons = ["" for _ in seqs], [None for _ in seqs]
        marks: list[dict | None] = [None for _ in seqs]  # each choice's provenance, when asked
        consume = asyncio.ensure_future(self._collect(handle, texts, reasons, marks, deadline))
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
        if consume.exception() is not None:  # the engine's error or the timeout: free the rows
            self.scheduler.cancel(handle)
        consume.result()  # raises it
        choices = ChoiceRenderer(req, seqs, self.tokenizer, chat).final(texts, reasons)
        if provenance:
            for c, m in zip(choices, marks):
                c["specdec"] = m
        return JSONResponse(completion_body(rid, req.model, choices, usage(prompt_tokens, *handle.counts()), chat))

    @staticmethod
    async def _collect(handle: RequestHandle, texts: list[str], reasons: list, marks: list[dict | None],
                       deadline: float | None) -> None:
        async for ev in handle.events(deadline):
            if ev.error is not None:
                raise _engine_error(ev)
            texts[ev.index] += ev.text
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            if ev.provenance is not None:  # the tokens add up, the counts are the latest
                before = marks[ev.index]["tokens"] if marks[ev.index] is not None else []
                marks[ev.index] = ev.provenance | {"tokens": before + ev.provenance["tokens"]}

    async def _stream(self, handle: RequestHandle, rid: str, model: str, prompt_tokens: int, chat: bool,
                      include_usage: bool, deadline: float | None, render: ChoiceRenderer) -> AsyncIterator[str]:
        def chunk(choices: list[dict]) -> str:  # "usage": null in each chunk only when usage comes at the end
            return sse(completion_body(rid, model, choices, None, chat, chunk=True, usage_field=include_usage))

        try:
            for c in render.first_chunks():
                yield chunk([c])
            try:
                async for ev in handle.events(deadline):
                    if ev.error is not None:
                        yield sse(_engine_error(ev).body())
                        yield sse("[DONE]")
                        return
                    parts = render.chunks(ev.index, ev.text, ev.finish_reason)  # logprobs, tool calls, echo
                    if ev.provenance is not None:  # on the event's last chunk (an empty one if all is held back)
                        parts = parts or [render.empty(ev.index)]
                        parts[-1]["specdec"] = ev.provenance
                    for c in parts:
                        yield chunk([c])
            except APIError as e:  # the request timed out: its error event ends the stream
                yield sse(e.body())
                yield sse("[DONE]")
                return
            if include_usage:
                yield sse(completion_body(rid, model, [], usage(prompt_tokens, *handle.counts()), chat, True))
            yield sse("[DONE]")
        finally:  # also runs when the client disconnects and the response task is cancelled
            if not handle.done:
                self.scheduler.cancel(handle)

    def models(self) -> dict:
        spec = speculation_card(self.llm.speculative, self.scheduler.k)  # an extension field, as max_model_len
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": self.llm.max_model_len,
                                            "speculative": spec}]}


def _text(message) -> str:
    """A chat message's text: what its template renders of it, at least."""
    c = message.content
    return c if isinstance(c, str) else "".join(p.text for p in c or [])


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_error(ev: Event) -> APIError:
    """An engine error event as OpenAI's error: 503 (retryable, with Retry-After) or 500."""
    if ev.status == 503:
        return APIError(ev.error, 503, "server_error", code="engine_restarted", headers={"Retry-After": "1"})
    return APIError(ev.error, ev.status, "server_error", code="request_failed")


def create_app(llm, config: ServerConfig) -> FastAPI:
    """An app serving ``llm`` (a loaded specdec.LLM); its engine thread runs while the app runs."""
    metrics = ServerMetrics()
    scheduler = Scheduler(llm, metrics, config.max_batch_size, config.spec_max_batch, config.rows_budget,
                          max_waiting=config.max_waiting, max_prefill_tokens=config.max_prefill_tokens,
                          stale_after=config.stale_after,
                          recorder=TrafficRecorder(config.record_traffic, config.record_traffic_bytes)
                          if config.record_traffic else None)
    api = _Api(llm, config, scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        api.pool.shutdown(wait=False, cancel_futures=True)
        api.large_pool.shutdown(wait=False, cancel_futures=True)
        if scheduler.recorder is not None:
            scheduler.recorder.close()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if e.code == "request_body_too_large":  # answered at once, then the body read and dropped (drain.py)
            return DrainingJSONResponse(e.body(), e.status, headers=e.headers, request_headers=request.headers)
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(e.detail), e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(err.body(), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        err = APIError(f"internal server error: {type(e).__name__}: {e}", 500, "server_error")
        return JSONResponse(err.body(), 500)

    def health() -> JSONResponse:
        report = scheduler.health_report()  # the verdict, and the engine's failures in a row and restarts
        return JSONResponse(report, 200 if report["status"] == "ok" else 503)

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(metrics.render(), media_type=metrics.content_type),
                      methods=["GET"])

    async def playground(request: Request) -> Response:
        return page(request.url.path)

    for path in FILES:  # the playground's page and its files (playground.py)
        app.add_api_route(path, playground, methods=["GET", "HEAD"], include_in_schema=False)
    app.openapi = lambda: openapi_schema(app)
    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)
    return app


def build_app(a: argparse.Namespace) -> tuple[FastAPI, LLM, ServerConfig]:
    """Load the model the (checked: ``flags.check_serve_args``) flags name and return ``(app, llm,
    config)``: the FastAPI app of one server, whose engine thread runs while the app's lifespan runs.
    A Ray Serve engine replica (``cluster/replica.py``) builds the same app from the same flags."""
    from specdec.llm import LLM  # noqa: PLC0415

    deployment = deployment_config(a)
    spec_max_batch, max_prefill_tokens = engine_limits(a, deployment)
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              max_num_seqs=a.max_batch_size, config=deployment, speculative_config=speculative_config(a),
              quantization=a.quantization, kv_cache_memory=a.kv_cache_memory)
    llm.spec_max_batch, llm.max_prefill_tokens = spec_max_batch, max_prefill_tokens or None
    llm.prefill_slowdown = a.prefill_slowdown or None
    llm.runner.prefill_chunk = server_prefill_chunk(llm, max_prefill_tokens)
    # by default, what one prompt's n choices can take of the context, or every row's, whichever is more: so no
    # request of one prompt is refused for it, and one of many prompts takes at most that (0: no limit)
    max_request_tokens = max(MAX_N, a.max_batch_size) * llm.max_model_len
    if a.max_request_tokens is not None:
        max_request_tokens = a.max_request_tokens
    config = ServerConfig(model_name=a.served_model_name or a.model or deployment.model, api_key=a.api_key,
                          max_batch_size=a.max_batch_size, spec_max_batch=spec_max_batch,
                          max_waiting=a.max_waiting or None, max_prompts=a.max_prompts,
                          max_request_tokens=max_request_tokens or None,
                          max_body_bytes=int(a.max_body_mb * 2**20) or None, request_timeout=a.request_timeout or None,
                          max_prefill_tokens=max_prefill_tokens or None, stale_after=a.health_stale_after,
                          record_traffic=a.record_traffic, record_traffic_bytes=a.record_traffic_mb << 20)
    return create_app(llm, config), llm, config


def server_prefill_chunk(llm, max_prefill_tokens: int | None) -> int:
    """The pieces every prompt is prefilled in (chunked or not, alone or beside streams: the same
    pieces, so a prompt's cache and output never depend on the load). On the native path, pieces of one
    batch-invariant product: they ride the decode steps' forwards (see ``EngineCore._riding_chunks``,
    paced by ``--prefill-slowdown``), and alone they run 512 tokens per forward, about as fast as
    one-shot products on this CPU or faster (1.5B bf16: 130 against 72 tok/s; int4: 167 against 173;
    the 135M: 704 against 766 at 1,000 tokens, 372 against 556 at 3,000; docs/bench/native.md).
    Otherwise the runner's chunk, cut to ``--max-prefill-tokens``."""
    from specdec.quant.linear import row_block  # noqa: PLC0415 (torch: only where a model is loaded)

    model = llm.runner.model
    chunk = llm.runner.prefill_chunk
    if max_prefill_tokens and model.native is not None:
        chunk = row_block(model.embed_tokens.weight.dtype) or chunk
    return min(chunk, max_prefill_tokens) if max_prefill_tokens else chunk


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0) -> None:
    """Run ``app`` until SIGTERM / SIGINT, then drain: admit nothing new (503), let in-flight requests
    finish for up to ``drain_timeout`` seconds, cancel the rest, and return (the process exits 0)."""
    import uvicorn  # noqa: PLC0415

    scheduler: Scheduler = app.state.scheduler

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            scheduler.draining = True
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=drain_timeout))
    # uvicorn re-raises the signal it drained on once it is done; handled here, the process exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
