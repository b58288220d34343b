"""OpenAI-compatible request models, their validation and the response bodies.

Requests are parsed strictly: malformed JSON, wrong types, unknown top-level fields and
unsupported options are all an ``APIError`` (a 4xx with OpenAI's error JSON), never a 500.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.config import SamplingParams
from specdec.errors import SpecdecError

MAX_N = 16  # choices per request: each one is a sequence in the batch


class APIError(Exception):
    """An error answered with ``{"error": {"message", "type", "param", "code"}}`` and ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculativeOptions(_Strict):
    """The extra body field ``speculative``: per-request control of speculative decoding."""

    enabled: bool | None = None
    method: str | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0)


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
    user: str | None = None  # accepted and ignored, as OpenAI does
    # accepted only at their "off" values: specdec implements no penalties or logprobs
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        bad = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f) not in (None, 0, 0.0)]
        return bad + (["logit_bias"] if self.logit_bias else [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [f for f in ("echo", "suffix", "logprobs") if getattr(self, f)]
        return bad + (["best_of"] if self.best_of not in (None, self.n) else [])

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [f for f in ("logprobs", "top_logprobs") if getattr(self, f)]
        fmt = self.response_format
        return bad + (["response_format"] if fmt and fmt != {"type": "text"} else [])


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
            raise APIError(f"invalid type for '{loc}': got {_json_type(err['input'])}", param=loc,
                           code="invalid_type") from None
        if err["type"] == "missing":
            raise APIError(f"missing required parameter: '{loc}'", param=loc, code="missing_parameter") from None
        if err["type"] == "extra_forbidden":
            raise APIError(f"unknown parameter: '{loc}'", param=loc, code="unknown_parameter") from None
        raise APIError(f"invalid value for '{loc}': {err['msg']}", param=loc, code="invalid_value") from None
    bad = req.unsupported()
    if bad:
        raise APIError(f"unsupported parameter(s) for this server: {', '.join(bad)} (specdec implements no "
                       "penalties, logprobs, echo, suffix, best_of or response formats)", param=bad[0],
                       code="unsupported_parameter")
    return req


def _param(loc: tuple) -> str:
    """``messages.0.content`` from pydantic's location, without union member tags such as ``list[int]``."""
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TAGS)))


_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict"})


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def sampling_params(req: _Common, prompt_len: int, max_model_len: int, seed: int | None) -> SamplingParams:
    """The request's SamplingParams for one choice; length limits checked against the context."""
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
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens, stop=req.stop, seed=seed, ignore_eos=req.ignore_eos)
    except SpecdecError as e:
        raise APIError(str(e), code="invalid_value") from None


def speculative_cap(opts: SpeculativeOptions | None, server_method: str | None, server_k: int) -> int | None:
    """The per-request draft length cap (None: the server's own), or an APIError."""
    if opts is None:
        return None
    if opts.method is not None and opts.method != server_method:
        have = f"'{server_method}'" if server_method else "no speculative decoding"
        raise APIError(f"speculative method '{opts.method}' is not available: this server runs {have} "
                       "(one proposer per server; leave 'method' out or start another server)",
                       param="speculative.method", code="unsupported_speculative_method")
    if opts.enabled is False or server_method is None:
        return 0
    k = opts.num_speculative_tokens
    return None if k is None or k >= server_k else k


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, num_draft: int, num_accepted: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "num_draft_tokens": num_draft, "num_accepted_tokens": num_accepted}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, chat: bool,
                    chunk: bool = False) -> dict:
    """A (chat) completion response or stream chunk; ``choices`` are already shaped."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, chunk: bool = False,
           first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}
