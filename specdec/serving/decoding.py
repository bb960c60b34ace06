"""Request bytes that do not parse are the client's error: INVALID_ARGUMENT naming the method.

grpcio deserialises a request before any project code runs and answers a failure with INTERNAL
"Exception deserializing request!" (its `_common.deserialize` logs the exception and returns
None; a deserializer cannot choose the status). So `DecodingInterceptor` takes the
deserializer out of every handler, hands the handler the raw bytes, and parses them itself,
inside the call, where it can abort with INVALID_ARGUMENT. Streamed requests are parsed as the
servicer reads them; a bad message ends the call with INVALID_ARGUMENT even when the servicer
reads its stream on a thread of its own (the target's Serve does): `context.abort` sets the
call's status, and the call ends with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

Deserializer = Callable[[bytes], Any]


def message_name(deserializer: Deserializer) -> str:
    """The protobuf message's full name (`X.FromString` is bound to the class X)."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "request message"))


def decode(
    data: bytes, deserializer: Deserializer, method: str, context: grpc.ServicerContext
) -> Any:
    """The parsed request, or the call aborted with INVALID_ARGUMENT naming `method`."""
    try:
        return deserializer(data)
    except Exception as e:  # protobuf's DecodeError; any parser failure is the bytes' fault
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a valid {message_name(deserializer)} message "
            f"({len(data)} bytes): {e}",
        )
        raise  # unreachable: abort raises


def _decoded(
    requests: Iterator[bytes], deserializer: Deserializer, method: str, context: Any
) -> Iterator[Any]:
    for data in requests:
        yield decode(data, deserializer, method, context)


def _unary(behavior: Callable[..., Any], des: Deserializer, method: str) -> Callable[..., Any]:
    def handler(data: bytes, context: grpc.ServicerContext, *rest: Any) -> Any:
        return behavior(decode(data, des, method, context), context, *rest)

    return handler


def _streamed(behavior: Callable[..., Any], des: Deserializer, method: str) -> Callable[..., Any]:
    def handler(requests: Iterator[bytes], context: grpc.ServicerContext, *rest: Any) -> Any:
        return behavior(_decoded(requests, des, method, context), context, *rest)

    return handler


class DecodingInterceptor(grpc.ServerInterceptor):
    """Moves request parsing from grpcio into the call (see the module docstring)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler: Any = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler  # type: ignore[no-any-return]
        des, method = handler.request_deserializer, handler_call_details.method
        if handler.unary_unary is not None:
            changes = {"unary_unary": _unary(handler.unary_unary, des, method)}
        elif handler.unary_stream is not None:
            changes = {"unary_stream": _unary(handler.unary_stream, des, method)}
        elif handler.stream_unary is not None:
            changes = {"stream_unary": _streamed(handler.stream_unary, des, method)}
        elif handler.stream_stream is not None:
            changes = {"stream_stream": _streamed(handler.stream_stream, des, method)}
        else:
            return handler  # type: ignore[no-any-return]
        return handler._replace(request_deserializer=None, **changes)  # type: ignore[no-any-return]
