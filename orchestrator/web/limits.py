"""What bounds an HTTP request before its handler looks at it: its size, the time its client
takes to send it, and the depth and text of its JSON.

- Size: a body over `--max-request-bytes` (the gRPC port's limit) is refused with 413, by its
  Content-Length before any of it is read (`BodyLimit`, every route), or by counting a chunked
  body as it arrives (`read_body`). A response sent before the body was read whole closes the
  connection, so the rest is never read.
- Time: a connection must send its request's headers within `header_timeout_s` of opening (or
  of its last response), else it is closed (`header_timeout_protocol`); the body must follow
  within `body_timeout_s` (408). A thousand half-sent requests then hold nothing for long.
- JSON: `parse_json` refuses what `json.loads` takes but no client means: nesting deeper than
  MAX_JSON_DEPTH, NaN and Infinity, and strings holding lone surrogates ("\\ud800"), which are
  not Unicode text and which no tokenizer or protobuf string takes. Each 400 names the field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from orchestrator.web.errors import (
    ClientGoneError,
    RequestTimeoutError,
    RequestTooLargeError,
    error_response,
)
from orchestrator.web.openai_protocol import FieldError

MAX_JSON_DEPTH = 64  # OpenAI's deepest request (a tool's JSON schema) nests far less
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # 1 MiB at 35 KB/s
# open connections the HTTP port holds per call it serves at once (max_concurrent_calls): idle
# keep-alive connections of clients' pools count; past it a new request is answered 503 at
# once, so that no number of clients (half-sent or idle) exhausts the process's sockets
CONNECTIONS_PER_CALL = 4


def too_large(limit: int, size: int | None = None) -> RequestTooLargeError:
    got = "more" if size is None else str(size)
    return RequestTooLargeError(
        f"The request body must be at most {limit} bytes (the server's --max-request-bytes), "
        f"got {got}."
    )


class BodyLimit:
    """ASGI middleware: 413 for a declared Content-Length over `limit` on any route, and
    `connection: close` on a response sent before its request's body was read whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.limit:  # h11 checked it is a number
            await _refuse(send, too_large(self.limit, int(length)))
            return
        unread = length not in (None, b"0") or b"transfer-encoding" in headers

        async def counted_receive() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread = False
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, counted_receive, closing_send)


async def _refuse(send: Send, error: RequestTooLargeError) -> None:
    response = error_response(error)
    response.headers["connection"] = "close"
    await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, refused once it passes `limit` bytes or `timeout_s` seconds."""
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g} s (after {size} bytes); "
            f"send it whole, without pauses."
        ) from None
    except ClientDisconnect:
        raise ClientGoneError(
            "The client closed the connection while sending its request."
        ) from None
    return b"".join(chunks)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ValueError (a FieldError where a field is at fault)."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        value = None  # deeper than Python's parser goes: refused below as too deep
        _too_deep("body")
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
        raise ValueError(f"The request body must be a JSON object ({e}).") from None
    if not isinstance(value, dict):
        raise ValueError("The request body must be a JSON object.")
    _check_tree(value)
    return value


def _too_deep(path: str) -> None:
    raise FieldError(
        path, f"The field {path} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects."
    )


def _check_text(text: str, path: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise FieldError(
            path,
            f"The field {path} holds a lone surrogate ({text[e.start]!r} at character "
            f"{e.start}), which is not Unicode text; send text as UTF-8.",
        ) from None


def _check_tree(body: dict[str, Any]) -> None:
    """Every string's text and the nesting depth, walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            _too_deep(path)
        if isinstance(value, str):
            _check_text(value, path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{path}.<key>" if path else "<key>")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (or the response was sent); the body was read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's
    headers `timeout_s` after it opened or after its last response (uvicorn waits forever)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in: the handler's body timeout takes over

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request handled inside disarms it again
            super().on_response_complete()

    return HeaderTimeoutProtocol
