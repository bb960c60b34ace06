"""The OpenAI-compatible HTTP API of `specdec serve` (`--http-port`): Starlette on uvicorn, on a
thread and event loop of its own inside the orchestrator's process (`orchestrator.web.server`).

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events, then [DONE])
    GET  /v1/models, /health                     POST /tokenize, /detokenize (vLLM's shapes)

Requests go through the same `Frontend` as the gRPC API: the same call limit, validation,
scheduler and metrics. Bodies are bounded as the gRPC port bounds its messages
(`orchestrator.web.limits`); parsing, validation, templating and tokenizing run on worker
threads, at most max_concurrent_calls at once, so the event loop only moves bytes (a 4 MB
prompt tokenized on it stopped /health and every stream for 6 s). A job's responses reach the
event loop through `AsyncOutbox`, so no thread waits per request; a non-streamed request whose
client goes is cancelled as a stream is. Errors have OpenAI's shape, `{"error": {"message",
"type", "param", "code"}}`, with the status their gRPC code maps to (400 bad input, 404 unknown
model, 429 full, 503 not ready; 413 a body over --max-request-bytes, 408 one sent too slowly);
one that happens mid-stream is sent as a last `data:` event before [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.core.frontend import Backend, Frontend
from orchestrator.core.requests import END, Job, RequestFailed, response_of
from orchestrator.web.chat import ChatTemplate
from orchestrator.web.errors import ClientGoneError, error_body, error_response
from orchestrator.web.limits import BODY_TIMEOUT_S, BodyLimit, disconnected, parse_json, read_body
from orchestrator.web.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    Responder,
    TokenizeRequest,
    chat_messages,
    check_model,
    completion_prompt,
    generate_request,
)
from specdec.errors import UnauthenticatedError, UnavailableError
from specdec.message_limits import (
    DEFAULT_SEQ_LEN_CAP,
    MAX_CHARS_PER_TOKEN,
    max_prompt_chars,
    request_bytes,
)
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.auth import UNAUTHENTICATED_MESSAGE, authorized

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
Body = TypeVar("Body", bound=BaseModel)


class AsyncOutbox:
    """A job's outbox read on an event loop; `put` is called from the scheduler's thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()

    def put(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def responses(self) -> AsyncIterator[generate_pb2.GenerateResponse]:
        while (item := await self._queue.get()) is not END:
            yield response_of(item)


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def _validated(raw: bytes, model: type[Body]) -> Body:
    return model.model_validate(parse_json(raw))


async def _drain(outbox: AsyncOutbox) -> None:
    async for _ in outbox.responses():
        pass


async def _until_done(request: Request, outbox: AsyncOutbox) -> None:
    """Waits for the job's last response; ClientGoneError if its client goes first."""
    done = asyncio.ensure_future(_drain(outbox))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()  # a request: the task ends cancelled only when it next runs
            await asyncio.wait((done,))  # (result() before that raised InvalidStateError: a 500)
    if done.cancelled():
        raise ClientGoneError("The client closed the connection before the response.")
    done.result()  # RequestFailed, if the job failed


def _openai_errors(handler: Handler) -> Handler:
    """Any exception → OpenAI's error JSON with its HTTP status."""

    @wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            return error_response(e)

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}."
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"message": message, "type": kind, "param": None, "code": None}
    return JSONResponse({"error": body}, status_code=exc.status_code, headers=exc.headers)


class HttpApi:
    """The Starlette app over a `Frontend`; the chat template comes from the target's
    tokenizer (None: chat completions are refused with 400)."""

    def __init__(
        self,
        frontend: Frontend,
        chat_template: ChatTemplate | None,
        api_key: str | None = None,
        *,
        max_request_bytes: int = request_bytes(DEFAULT_SEQ_LEN_CAP),  # the gRPC port's default
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.frontend = frontend
        self.chat_template = chat_template
        self.api_key = api_key  # every route but /health needs `Authorization: Bearer KEY`
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self._workers = anyio.CapacityLimiter(frontend.calls.limit)  # the gRPC port's bound
        routes = [
            ("/v1/completions", self.completions, "POST"),
            ("/v1/chat/completions", self.chat_completions, "POST"),
            ("/v1/models", self.models, "GET"),
            ("/tokenize", self.tokenize, "POST"),
            ("/detokenize", self.detokenize, "POST"),
            ("/health", self.health, "GET"),
        ]
        keyed = [(path, fn if path == "/health" else self._keyed(fn), m) for path, fn, m in routes]
        starlette = Starlette(
            routes=[Route(path, _openai_errors(fn), methods=[m]) for path, fn, m in keyed],
            exception_handlers={HTTPException: _http_error},
        )
        self.app = BodyLimit(starlette, max_request_bytes)

    def _keyed(self, handler: Handler) -> Handler:
        """`handler` behind the API key (the gRPC API's check, `specdec.serving.auth`)."""

        @wraps(handler)
        async def wrapped(request: Request) -> Response:
            key = self.api_key
            if key is not None and not authorized(request.headers.get("authorization"), key):
                raise UnauthenticatedError(UNAUTHENTICATED_MESSAGE)
            return await handler(request)

        return wrapped

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread, at most max_concurrent_calls at once."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._workers)

    async def _read(self, request: Request) -> bytes:
        return await read_body(request, self.max_request_bytes, self.body_timeout_s)

    def _chat_prompt(self, b: Backend, messages: list[Any], generation_prompt: bool) -> list[int]:
        if self.chat_template is None:
            raise ValueError(
                "messages cannot be turned into a prompt: the model's tokenizer has no chat "
                "template (tokenizer_config.json's chat_template or chat_template.jinja); use "
                "/v1/completions with a prompt instead."
            )
        try:
            text = self.chat_template.render(messages, add_generation_prompt=generation_prompt)
        except ValueError as e:
            raise FieldError("messages", str(e)) from None
        limit = max_prompt_chars(b.served.max_seq_len)
        if len(text) > limit:
            raise ValueError(
                f"messages render to {len(text)} characters through the chat template; a "
                f"prompt is at most {limit} (max_seq_len {b.served.max_seq_len} × "
                f"{MAX_CHARS_PER_TOKEN})."
            )
        ids = b.tokenizer.encode(text, add_special_tokens=False)  # the template has them
        if not ids:
            raise ValueError("messages render to an empty prompt through the chat template.")
        return ids

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _parse(
        self, raw: bytes, chat: bool
    ) -> tuple[CompletionRequest | ChatRequest, generate_pb2.GenerateRequest, Responder]:
        """The body, its GenerateRequest and the responder of a (chat) completion request."""
        body: CompletionRequest | ChatRequest = (
            _validated(raw, ChatRequest) if chat else _validated(raw, CompletionRequest)
        )
        b = self.frontend.ready()
        check_model(body.model, b.served.name)
        if isinstance(body, ChatRequest):
            messages = chat_messages(body.messages)
            prompt: str | list[int] = self._chat_prompt(b, messages, body.add_generation_prompt)
        else:
            prompt = completion_prompt(body, b.served.vocab_size)
        responder = Responder(chat, b.served.name)
        pb = generate_request(body, prompt)
        pb.request_id = responder.id  # one id in the response, the scheduler and the services
        return body, pb, responder

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            raw = await self._read(request)
            body, pb, responder = await self._off_loop(self._parse, raw, chat)
        except Exception as e:  # refused before it reached the scheduler: counted all the same
            self.frontend.refused(e)
            raise
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(pb, responder, usage)
            await anext(events)  # accepted (refusals raise here, before the headers go)
            return StreamingResponse(events, media_type="text/event-stream")
        async with self._running(pb) as (job, outbox):
            await _until_done(request, outbox)  # its client gone: the job is cancelled here
            return JSONResponse(responder.whole(job.record.complete_response()))

    @contextlib.asynccontextmanager
    async def _running(
        self, pb: generate_pb2.GenerateRequest
    ) -> AsyncIterator[tuple[Job, AsyncOutbox]]:
        """The request's job while the call holds a slot; however the call ends, the job does."""
        with self.frontend.slot():
            outbox = AsyncOutbox()
            job = await self._off_loop(self.frontend.submit, pb, None, outbox)  # tokenizes
            try:
                yield job, outbox
            finally:
                self.frontend.end(job)

    async def _events(
        self, pb: generate_pb2.GenerateRequest, responder: Responder, usage: bool
    ) -> AsyncIterator[str]:
        """An empty string once the request is accepted, then its server-sent events."""
        async with self._running(pb) as (_, outbox):
            yield ""  # closed here (the response never started): the job ends too
            try:
                first = True
                async for response in outbox.responses():
                    yield _sse(responder.chunk(response, first))
                    first = False
                if usage:
                    yield _sse(responder.usage_chunk(response))
            except RequestFailed as e:
                yield _sse(error_body(e)[1])
        yield _sse("[DONE]")

    async def models(self, request: Request) -> Response:
        b = self.frontend.ready()
        info = b.model_info().models[0]
        model = {"id": b.served.name, "object": "model", "created": int(time.time()),
                 "owned_by": "specdec", "root": info.target_model,
                 "max_model_len": b.served.max_seq_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [model]})

    async def tokenize(self, request: Request) -> Response:
        return await self._off_loop(self._tokenized, await self._read(request))

    def _tokenized(self, raw: bytes) -> Response:
        body = _validated(raw, TokenizeRequest)
        b = self.frontend.ready()
        check_model(body.model, b.served.name)
        if (body.prompt is None) == (body.messages is None):
            raise FieldError("prompt", "The request must give exactly one of prompt and messages.")
        if body.messages is not None:
            messages = chat_messages(body.messages)
            ids = self._chat_prompt(b, messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            limit = max_prompt_chars(b.served.max_seq_len)
            if len(body.prompt) > limit:  # as the gRPC API's: no prompt longer can be served
                raise ValueError(
                    f"prompt must be at most {limit} characters (max_seq_len "
                    f"{b.served.max_seq_len} × {MAX_CHARS_PER_TOKEN}), got {len(body.prompt)}."
                )
            ids = b.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": b.served.max_seq_len,
                             "tokens": ids, "token_strs": None})  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        return await self._off_loop(self._detokenized, await self._read(request))

    def _detokenized(self, raw: bytes) -> Response:
        body = _validated(raw, DetokenizeRequest)
        b = self.frontend.ready()
        check_model(body.model, b.served.name)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < b.served.vocab_size:
                raise ValueError(f"tokens[{i}] must be in [0, {b.served.vocab_size}), got {token}.")
        return JSONResponse({"prompt": b.tokenizer.decode(body.tokens)})

    async def health(self, request: Request) -> Response:
        """200 while the gRPC health service says SERVING, else 503."""
        self.frontend.ready()
        if not self.frontend.serving:
            raise UnavailableError("No pair of services can take requests now; retry later.")
        return Response(status_code=200)
