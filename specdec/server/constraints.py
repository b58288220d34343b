"""A request's output constraint: OpenAI's ``response_format`` and forced ``tool_choice``, vLLM's
``structured_outputs`` and ``guided_*`` fields -> one ``StructuredOutput`` (sampling/grammar.py).

At most one field of a request may constrain its output; a malformed one is an ``APIError`` naming
it. Whether a schema, regex or grammar compiles is checked by the caller (``app._Api._constraint``)
with the engine's compiler, before anything is generated.
"""
from __future__ import annotations

import json
from typing import Any

from specdec.errors import SpecdecError
from specdec.sampling.grammar import StructuredOutput
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice,
                                     json_type)
from specdec.server.tools import tool_call_grammar

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's guided_<kind> fields
Request = CompletionRequest | ChatCompletionRequest


def structured_output(req: Request, special_tags: bool = False) -> tuple[str, StructuredOutput] | None:
    """The request's output constraint and the field that asked for it (None: unconstrained), or an
    APIError: several fields asking for one, or a malformed one. ``special_tags``: a forced tool
    call writes ``<tool_call>`` as the tokenizer's own token (``tools.tags_are_tokens``)."""
    found = constraints(req, special_tags)
    if not found:
        return None
    if len(found) > 1:
        raise APIError("a request takes at most one output constraint, got " + ", ".join(f for f, _ in found),
                       param=found[1][0], code="invalid_value")
    field, value = found[0]
    try:
        return field, StructuredOutput.from_dict(value)
    except SpecdecError as e:
        raise APIError(f"invalid '{field}': {e}", param=field, code="invalid_value") from None


def constraints(req: Request, special_tags: bool = False) -> list[tuple[str, Any]]:
    """(field, structured-output dict) for each field of ``req`` that constrains the output."""
    found = [("structured_outputs", req.structured_outputs)] if req.structured_outputs is not None else []
    found += [(f"guided_{k}", {k: getattr(req, f"guided_{k}")}) for k in GUIDED
              if getattr(req, f"guided_{k}") is not None]
    if not isinstance(req, ChatCompletionRequest):
        return found
    fmt = response_format(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    if req.tool_mode() == "required":  # a grammar of the model's own <tool_call> blocks
        name = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        grammar = tool_call_grammar([t.function.model_dump(exclude_none=True) for t in req.tools], name,
                                    parallel=req.parallel_tool_calls is not False, special_tags=special_tags)
        found.append(("tool_choice", {"grammar": grammar}))
    return found


def response_format(fmt: dict | None) -> dict | None:
    """OpenAI's ``response_format`` as a structured-output dict (None: plain text), or an APIError."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise APIError(f"invalid 'response_format': 'type' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                       f"{json.dumps(kind)}", param="response_format.type", code="invalid_value")
    extra = sorted(set(fmt) - {"type", "json_schema" if kind == "json_schema" else "type"})
    if extra:
        raise APIError(f"invalid 'response_format': unknown field(s) {', '.join(extra)} for type '{kind}'",
                       param=f"response_format.{extra[0]}", code="invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError("invalid 'response_format': type 'json_schema' needs a 'json_schema' object "
                       '{"name": ..., "schema": {...}}', param="response_format.json_schema", code="invalid_value")
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise APIError(f"invalid 'response_format.json_schema': unknown field(s) {', '.join(unknown)} (it takes "
                       "name, description, schema, strict)", param=f"response_format.json_schema.{unknown[0]}",
                       code="invalid_value")
    for key, typ in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], typ):
            raise APIError(f"invalid type for 'response_format.json_schema.{key}': got {json_type(spec[key])}",
                           param=f"response_format.json_schema.{key}", code="invalid_type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError("invalid 'response_format.json_schema': 'schema' must be a JSON schema object, got "
                       + ("nothing" if schema is None else json_type(schema)),
                       param="response_format.json_schema.schema", code="invalid_value")
    return {"json": schema}
