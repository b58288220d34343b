"""OpenAI-compatible request models, their validation and the response bodies.

Requests are parsed strictly: malformed JSON, wrong types, unknown top-level fields and
unsupported options are all an ``APIError`` (a 4xx with OpenAI's error JSON), never a 500.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.config import MAX_LOGPROBS, SamplingParams
from specdec.errors import SpecdecError
from specdec.proposers.options import SpecOptions

if TYPE_CHECKING:
    from specdec.sampling.grammar import StructuredOutput

MAX_N = 16  # choices per request: each one is a sequence in the batch
# stop strings: every kept token of the request is searched for each of them on the engine thread, which
# every stream shares, and a stream holds back the longest one's length of text; OpenAI takes 4
MAX_STOP = 32  # stop strings per request
MAX_STOP_CHARS = 1024  # characters of one stop string


class APIError(Exception):
    """An error answered with ``{"error": {"message", "type", "param", "code"}}`` and ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers  # e.g. Retry-After on a 429 / 503

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: <JSON or text>`` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculativeOptions(_Strict):
    """The extra body field ``speculative``: per-request control of speculative decoding.

    ``enabled`` and ``method`` (which must be the server's) plus the server method's options marked
    per-request in its schema (``specdec methods``), e.g. ``num_speculative_tokens`` (0: off)."""

    model_config = ConfigDict(extra="allow", strict=True)
    enabled: bool | None = None
    method: str | None = None

    def overrides(self) -> dict:
        return dict(self.model_extra or {})


class SpecdecExtension(_Strict):
    """The extra body field ``specdec``: what this server adds to its answers on request.

    ``provenance``: each choice carries a ``specdec`` field with its tokens, each marked as a draft
    token the target accepted or the target's own, and its running speculation counts
    (docs/server-provenance.md; ``server/provenance.py``)."""

    provenance: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None
    specdec: SpecdecExtension | None = None  # this server's extensions of the answer (provenance)
    user: str | None = None  # accepted and ignored, as OpenAI does
    # penalties and bias (sampling/penalties.py), lossless under speculation
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra parameter
    logit_bias: dict[str, float] | None = None
    # structured output (server/constraints.py), vLLM's fields: ``structured_outputs`` ({"json": schema},
    # {"regex": ...}, {"choice": [...]}, {"grammar": ...}, {"json_object": true}) or the older ``guided_*``
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something this server cannot honour."""
        return []

    def check_limits(self) -> None:
        """APIError (400) for more than ``MAX_STOP`` stop strings or one longer than ``MAX_STOP_CHARS``."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP:
            raise APIError(f"the request has {len(stop)} stop strings, more than this server's limit of {MAX_STOP}",
                           param="stop", code="too_many_stop_strings")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(f"a stop string has {longest} characters, more than this server's limit of "
                           f"{MAX_STOP_CHARS}", param="stop", code="stop_string_too_long")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self) -> list[tuple[str, str]]:
        bad = [("suffix", "no fill-in-the-middle")] if self.suffix else []
        return bad + ([("best_of", "best_of must equal n")] if self.best_of not in (None, self.n) else [])

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # accepted and ignored (an assistant turn as OpenAI returned it)

    def as_template_dict(self) -> dict:
        """The message as chat templates read it: tool calls with their arguments as objects
        (Qwen2.5's template writes ``arguments | tojson``), tool results with their call's id."""
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        d: dict = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            d["tool_calls"] = [{"id": t.id, "type": "function",
                                "function": {"name": t.function.name, "arguments": _json_object(t.function.arguments)}}
                               for t in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            d["name"] = self.name
        return d


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's own switches, as vLLM takes them, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted and ignored, as OpenAI's server does (they change no output)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict | None = None  # predicted output: a latency hint only

    def unsupported(self) -> list[tuple[str, str]]:
        bad = []
        if self.top_logprobs is not None and not self.logprobs:
            bad.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.tool_choice is not None and not self.tools:
            bad.append(("tool_choice", "tool_choice needs tools"))
        elif isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self._names():
            bad.append(("tool_choice", f"tool_choice names the function '{self.tool_choice.function.name}', which "
                                       f"is not in tools ({', '.join(self._names())})"))
        return bad

    def _names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def tool_mode(self) -> str:
        """'off' (no tools, or tool_choice 'none': the template shows none, no call is parsed), 'auto'
        (the model may call one) or 'required' (``required`` or a named function: the output is
        constrained to calls)."""
        if not self.tools or self.tool_choice == "none":
            return "off"
        return "auto" if self.tool_choice in (None, "auto") else "required"


def parse_request(model: type[_Common], body: bytes) -> Any:
    """JSON body -> request model, or an APIError naming what is wrong."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    unknown = sorted(set(data) - set(model.model_fields))
    if unknown:
        raise APIError(f"unknown parameter(s): {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")
    try:
        req = model.model_validate_json(body, strict=True)
    except ValidationError as e:
        errors = e.errors()
        err = max(errors, key=lambda x: len(_param(x["loc"]).split(".")))  # the most specific
        loc = _param(err["loc"])
        if sum(_param(x["loc"]) == loc for x in errors) > 1:  # every member of a union failed here
            raise APIError(f"invalid type for '{loc}': got {json_type(err['input'])}", param=loc,
                           code="invalid_type") from None
        if err["type"] == "missing":
            raise APIError(f"missing required parameter: '{loc}'", param=loc, code="missing_parameter") from None
        if err["type"] == "extra_forbidden":
            raise APIError(f"unknown parameter: '{loc}'", param=loc, code="unknown_parameter") from None
        raise APIError(f"invalid value for '{loc}': {err['msg']}", param=loc, code="invalid_value") from None
    req.check_limits()
    bad = req.unsupported()
    if bad:
        raise APIError("unsupported parameter(s) for this server: "
                       + "; ".join(f"{field} ({why})" for field, why in bad), param=bad[0][0],
                       code="unsupported_parameter")
    return req


async def read_body(request, limit: int | None) -> bytes:
    """The request's body, or an APIError 413 as soon as it is known to exceed ``limit`` bytes (None:
    no limit): from its Content-Length before a byte of it is read, else (a chunked body) when what
    has arrived passes the limit. Never read whole past the limit."""
    if limit is None:
        return await request.body()
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"has {size:,} bytes, more than" if size is not None else "is larger than"
    return APIError(f"the request body {got} this server's limit of {limit:,} bytes (--max-body-mb): send a "
                    "shorter prompt or fewer prompts", 413, code="request_body_too_large")


def _param(loc: tuple) -> str:
    """``messages.0.content`` from pydantic's location, without union member tags such as ``list[int]``."""
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TAGS)))


_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict"})


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def sampling_params(req: _Common, prompt_len: int, max_model_len: int, seed: int | None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """The request's SamplingParams for one choice; length limits checked against the context.
    ``structured``: its output constraint (``server/constraints.py``)."""
    param = "max_tokens"
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if prompt_len >= max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                       f"has {prompt_len} tokens: shorten the prompt", code="context_length_exceeded",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if max_tokens is None:
        max_tokens = 16 if isinstance(req, CompletionRequest) else max_model_len - prompt_len
    if max_tokens < 1:
        raise APIError(f"{param} must be at least 1, got {max_tokens}", param=param, code="invalid_value")
    if prompt_len + max_tokens > max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but {prompt_len + max_tokens}"
                       f" were requested ({prompt_len} in the prompt, {max_tokens} in the completion): lower "
                       f"{param}", param=param, code="context_length_exceeded")
    if isinstance(req, ChatCompletionRequest):
        logprobs, prompt_logprobs = ((req.top_logprobs or 0) if req.logprobs else None), None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None  # echo's prompt logprobs: a pass for these only
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens, stop=req.stop, seed=seed, ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=structured)
    except SpecdecError as e:
        named = [f for f in _SAMPLING_FIELDS if f in str(e)]
        raise APIError(str(e), param=named[0] if named else None, code="invalid_value") from None


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs")


def speculative_cap(opts: SpeculativeOptions | None, server: SpecOptions | None) -> int | None:
    """The per-request draft length cap (None: the server's own), or an APIError naming the field.

    ``server``: the server's validated speculative config (None: no speculation); a request may set
    the fields its schema marks per-request, within the schema's bounds and at most the server's."""
    if opts is None:
        return None
    server_method = server.method if server is not None else None
    if opts.method is not None and opts.method != server_method:
        have = f"'{server_method}'" if server_method else "no speculative decoding"
        raise APIError(f"speculative method '{opts.method}' is not available: this server runs {have} "
                       "(one proposer per server; leave 'method' out or start another server)",
                       param="speculative.method", code="unsupported_speculative_method")
    extra = opts.overrides()
    if extra.get("num_speculative_tokens") == 0 and not isinstance(extra["num_speculative_tokens"], bool):
        extra.pop("num_speculative_tokens")
        opts = opts.model_copy(update={"enabled": False})
    if server is None:
        if extra:
            raise APIError(f"unknown field(s) in 'speculative': {', '.join(sorted(extra))} (this server runs no "
                           "speculative decoding)", param=f"speculative.{sorted(extra)[0]}")
        return 0
    allowed = type(server).per_request()
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise APIError(f"'speculative' takes enabled, method and {', '.join(allowed)} for method "
                       f"'{server_method}', not {', '.join(unknown)}", param=f"speculative.{unknown[0]}")
    try:
        values = type(server).check_overrides(extra)
    except SpecdecError as e:
        raise APIError(str(e), param=f"speculative.{next(iter(extra))}") from None
    if opts.enabled is False:
        return 0
    k = values.get("num_speculative_tokens")
    return None if k is None or k >= server.num_speculative_tokens else k


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, num_draft: int, num_accepted: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "num_draft_tokens": num_draft, "num_accepted_tokens": num_accepted}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, chat: bool,
                    chunk: bool = False, usage_field: bool = True) -> dict:
    """A (chat) completion response or stream chunk; ``choices`` are already shaped.

    ``usage_field``: False leaves ``usage`` out, as OpenAI's stream chunks do unless the request sets
    ``stream_options.include_usage`` (then every chunk has ``"usage": null`` and one last chunk,
    with no choices, the usage)."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage_field:
        body["usage"] = use
    return body
