"""The OpenAPI document (/openapi.json, which /docs and /redoc read) of routes that parse their own bodies.

The POST handlers read the raw body themselves (for their own 400s: invalid UTF-8, nesting depth, strict
fields, see serving.parse_body), so FastAPI sees no request model. `json_body(Model)` documents one on a route
(its `openapi_extra`), `errors(...)` the OpenAI-shaped error bodies it may answer, and `install(app, models)`
adds the request models' schemas to the document, so that /docs can send a request.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from deltaserve.server.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "the request is invalid (the error names the field in `param`)",
    401: "missing or wrong API key (only with --api-key)",
    404: "unknown model",
    408: "the request body did not arrive within --request-body-timeout",
    500: "the engine failed while running the request",
}


def json_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def errors(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def streamed(response: type[BaseModel], what: str) -> dict:
    """The 200 of a route that streams with `stream: true`: JSON, or server-sent events of `what`."""
    return {200: {"model": response, "description": f"the {what}; with `stream: true`, server-sent events "
                  f"(`data: {{chunk}}`, then `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def install(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Serve a document that holds `request_models`' schemas (and the models they refer to)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
