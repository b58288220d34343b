"""The server's OpenAPI document: FastAPI's, with the request bodies the handlers parse themselves.

The handlers read raw bodies (``protocol.parse_request``) so that every malformed input gets
OpenAI's error JSON; this adds the pydantic models they validate against as the request bodies,
so a schema-driven fuzzer (schemathesis, in the tests) generates requests from the real contract.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from specdec.server.protocol import ChatCompletionRequest, CompletionRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def openapi_schema(app: FastAPI) -> dict:
    """OpenAPI 3.1 for ``app``'s routes, with the completion request schemas (computed once)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema
