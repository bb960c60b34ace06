"""One place that turns exceptions into gRPC status codes (an error never kills the server).

`specdec.errors` classes carry `grpc_code`; any other `ValueError` is INVALID_ARGUMENT, a
`KeyError` NOT_FOUND, anything else INTERNAL (logged with its traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    if isinstance(exc, SpecdecError):
        return grpc.StatusCode[exc.grpc_code], str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "not found"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        return  # the client went away (cancelled, or the server is stopping): nobody to tell
    if context.code() not in (None, grpc.StatusCode.OK):
        raise exc  # the servicer aborted with its own status already
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    context.abort(code, message)


class StatusInterceptor(grpc.ServerInterceptor):
    """Wraps every unary and streaming handler so that exceptions become status codes."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method))
        return handler


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except Exception as exc:
            _abort(context, exc, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Any]:
    def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except Exception as exc:
            _abort(context, exc, method)

    return wrapped
