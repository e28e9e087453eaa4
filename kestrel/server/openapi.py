"""The OpenAPI document (/openapi.json, rendered at /docs): request bodies and error responses for the POST routes.

The handlers read their bodies themselves (app.py `_parse`), so that every malformed request is a 400 in OpenAI's
error format naming the bad field, rather than FastAPI's 422; FastAPI therefore cannot see the request models.
They are declared here instead, so schema-driven clients and fuzzers see what the routes take and return.

/openapi.json and /docs are open even with --api-key, as /health and /metrics are: they describe the API and hold
nothing of the served data.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kestrel.server.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"

# the error statuses every /v1 POST route can answer, with what causes them
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request: a field out of range, a prompt too long, bad JSON"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key (with --api-key)"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "the body is larger than --max-request-body-bytes"},
    415: {"model": ErrorResponse, "description": "the body is not sent as `Content-Type: application/json`"},
    500: {"model": ErrorResponse, "description": "the engine failed while serving the request"},
    503: {"model": ErrorResponse, "description": "the model is still loading, or the queue is full (--max-queue)"},
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that takes `model` as its JSON body (its schema is added by install_openapi)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Build the document once, on first request, with `request_models` (and the models they use) as components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                body = model.model_json_schema(ref_template=REF_TEMPLATE, mode="validation")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
