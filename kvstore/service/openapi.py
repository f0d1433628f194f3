"""The served OpenAPI schema, made to agree with what the server actually answers.

FastAPI's defaults disagree in four places, fixed here: it documents 422 (the service
answers validation errors with 400); it cannot know that guard.py answers 401 on every
guarded path (only when a token is configured), 408 to a stalled body, 413 to any body over
the limit and 503 past max_requests in flight on /v1; it would declare bearer security
whether or not a token is configured; and the prefix lookup parses its own body, so its
schema (with this server's max_lookup_tokens) is added here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvstore.service.guard import UNAUTHORIZED, is_api, is_guarded
from kvstore.service.lookup import lookup_schemas
from kvstore.service.settings import ServiceSettings

_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


def openapi_for(app: FastAPI, settings: ServiceSettings) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        schema["components"]["schemas"].update(lookup_schemas(settings.max_lookup_tokens))
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                _document_guard(operation, path, settings.token is not None)
        if settings.token is not None:
            schema["components"]["securitySchemes"] = {"bearer": {
                "type": "http", "scheme": "bearer", "description": "the token the server was started with"}}
        app.openapi_schema = schema
    return app.openapi_schema


def _document_guard(operation: dict, path: str, token: bool) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    responses.pop("401", None)
    responses["408"] = {"description": "the request body stalled; the connection is closed", "content": _ERROR}
    responses["413"] = {"description": "the body exceeds max_body_bytes (a lookup: names more than "
                                       "max_lookup_tokens token ids or chunk hashes)", "content": _ERROR}
    if is_api(path):
        responses["503"] = {"description": "overloaded: max_requests in flight (Retry-After: 1); or degraded: a "
                                           "write to a store running read-only", "content": _ERROR}
    if is_guarded(path) and token:
        responses["401"] = {"description": UNAUTHORIZED, "content": _ERROR}
        operation["security"] = [{"bearer": []}]
