"""Exceptions → OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status of the gRPC code the same failure gets on the gRPC API (`status_for`)."""

from __future__ import annotations

import logging
import re
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from orchestrator.openai_protocol import ChatRequest, CompletionRequest, ModelNotFoundError
from orchestrator.requests import RequestFailed
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
NESTED_FIELDS = ("role", "content", "include_usage", "proposer")
_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)(?:\[\d+\])*\s")


def _path(loc: tuple[Any, ...], unknown: bool = False) -> str:
    """A pydantic error's location as a field path: messages[0].content. Union members'
    names (pydantic puts them in the location too) are left out; `unknown`: the last part is
    a field the body should not have."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELDS or part in NESTED_FIELDS or (unknown and i == len(loc) - 1):
            out += f".{part}" if out else part
    return out or "body"


def validation_message(error: ValidationError) -> tuple[str, str]:
    """(message, param) of a body pydantic refused: one sentence naming the field."""
    errors = error.errors()
    first = errors[0]
    path = _path(first["loc"], unknown=first["type"] == "extra_forbidden")
    if first["type"] == "extra_forbidden":
        return f"The field {path} is not supported by this server (unknown field).", path
    if first["type"] == "missing":
        return f"The field {path} is required.", path
    reasons = list(dict.fromkeys(e["msg"] for e in errors if _path(e["loc"]) == path))
    got = first.get("input")
    return f"The field {path} is invalid: {'; or '.join(reasons)} (got {got!r}).", path


def _body(kind: str, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a failed request."""
    if isinstance(exc, ValidationError):
        message, path = validation_message(exc)
        return 400, _body("invalid_request_error", message, path, None)
    if isinstance(exc, ModelNotFoundError):
        return 404, _body("not_found_error", str(exc), "model", "model_not_found")
    if isinstance(exc, RequestFailed):
        code, message = exc.code, exc.message
    else:
        code, message = status_for(exc)
    status, kind = HTTP_STATUS.get(code, SERVER_ERROR)
    if status == 500:
        log.error("HTTP request failed: %s", message, exc_info=exc)
    match = _LEADING_FIELD.match(message)
    param = match.group(1) if match and match.group(1).split(".")[0] in FIELDS else None
    return status, _body(kind, message, param, code.name.lower())


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)
