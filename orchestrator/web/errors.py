"""Exceptions → OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status of the gRPC code the same failure gets on the gRPC API (`status_for`)."""

from __future__ import annotations

import logging
import re
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from orchestrator.core.requests import RequestFailed
from orchestrator.web.openai_protocol import (
    BODIES,
    ChatRequest,
    CompletionRequest,
    FieldError,
    ModelNotFoundError,
)
from specdec.errors import SpecdecError
from specdec.serving.status import status_for

log = logging.getLogger(__name__)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")
# request fields a message may start with: its `param`
FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields) | {"tokens"}
# every body's and nested object's fields: the parts of a pydantic location that name a field
ALL_FIELDS = {name for body in BODIES for name in body.model_fields}
_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)(?:\[\d+\])*\s")
# pydantic's error types → OpenAI's `code` for a schema error (the rest: invalid_type)
SCHEMA_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
                "greater_than_equal": "invalid_value", "less_than_equal": "invalid_value",
                "greater_than": "invalid_value", "less_than": "invalid_value",
                "literal_error": "invalid_value", "too_short": "invalid_value",
                "too_long": "invalid_value"}  # fmt: skip


class RequestTooLargeError(SpecdecError):
    """The body is over --max-request-bytes (HTTP 413; the gRPC port refuses such a message
    with RESOURCE_EXHAUSTED)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http = (413, "invalid_request_error", "request_too_large")


class RequestTimeoutError(SpecdecError):
    """The client stopped sending its body (HTTP 408)."""

    grpc_code = "DEADLINE_EXCEEDED"
    http = (408, "timeout_error", "request_timeout")


class ClientGoneError(SpecdecError):
    """The client closed the connection before its response (nobody reads the 499)."""

    grpc_code = "CANCELLED"
    http = (499, "cancelled_error", "cancelled")


def _path(loc: tuple[Any, ...], unknown: bool = False) -> str:
    """A pydantic error's location as a field path: messages[0].content. Union members'
    names (pydantic puts them in the location too) are left out; `unknown`: the last part is
    a field the body should not have."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ALL_FIELDS or (unknown and i == len(loc) - 1):
            out += f".{part}" if out else part
    return out or "body"


def validation_message(error: ValidationError) -> tuple[str, str, str]:
    """(message, param, code) of a body pydantic refused: one sentence naming the field."""
    errors = error.errors()
    first = errors[0]
    path = _path(first["loc"], unknown=first["type"] == "extra_forbidden")
    code = SCHEMA_CODES.get(first["type"], "invalid_type")
    if first["type"] == "extra_forbidden":
        return f"The field {path} is not supported by this server (unknown field).", path, code
    if first["type"] == "missing":
        return f"The field {path} is required.", path, code
    reasons = list(dict.fromkeys(e["msg"] for e in errors if _path(e["loc"]) == path))
    got = _shown(first.get("input"))
    return f"The field {path} is invalid: {'; or '.join(reasons)} (got {got}).", path, code


def _shown(value: Any, limit: int = 80) -> str:
    """A refused value as the message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _body(kind: str, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a failed request."""
    if isinstance(exc, ValidationError):
        message, path, code = validation_message(exc)
        return 400, _body("invalid_request_error", message, path, code)
    if isinstance(exc, ModelNotFoundError):
        return 404, _body("not_found_error", str(exc), "model", "model_not_found")
    if isinstance(exc, FieldError):
        return 400, _body("invalid_request_error", str(exc), exc.param, "invalid_value")
    if isinstance(exc, RequestTooLargeError | RequestTimeoutError | ClientGoneError):
        status, kind, name = exc.http
        return status, _body(kind, str(exc), None, name)
    if isinstance(exc, RequestFailed):
        code, message = exc.code, exc.message
    else:
        code, message = status_for(exc)
    status, kind = HTTP_STATUS.get(code, SERVER_ERROR)
    if status == 500:
        log.error("HTTP request failed: %s", message, exc_info=exc)
    match = _LEADING_FIELD.match(message)
    param = match.group(1) if match and match.group(1).split(".")[0] in FIELDS else None
    name = "invalid_value" if code == grpc.StatusCode.INVALID_ARGUMENT else code.name.lower()
    return status, _body(kind, message, param, name)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)
