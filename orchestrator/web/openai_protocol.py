"""The OpenAI-compatible API's request bodies, their translation to `GenerateRequest`, and the
response bodies built from `GenerateResponse`s.

Bodies are pydantic models that refuse unknown fields (a misspelt field is an error, not a
silent default) and take each field only in its JSON type, as OpenAI's API does (`"5"`, `5.0`
and `true` are not integers; `1` is a number but not a boolean). The extra fields vLLM takes
are taken here too (`top_k`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`add_generation_prompt`), plus `speculation`, shaped as the gRPC `GenerateRequest.speculation`:

    {"speculation": {"proposer": "draft" | "ngram" | "off" | "default", "num_draft_tokens": 4}}

Ranges are checked where the gRPC API checks them (`parse_request`), so both refuse the same
requests with the same sentences.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.client import PROPOSERS  # the gRPC client's names: one spelling
from specdec.errors import SpecdecError
from specdec.limits import INT32_MAX, MAX_SEED, check_range
from specdec.pb.specdec.v1 import generate_pb2

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
PROPOSER_NAMES = {value: name for name, value in PROPOSERS.items()}
FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_MAX_SEQ_LEN: "length",
    generate_pb2.FINISH_REASON_STOP_STRING: "stop",
    generate_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    generate_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's name for a request it stopped
}
UINT32 = 2**32 - 1
# the proto's field; ranges: parse_request
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]


class ModelNotFoundError(SpecdecError):
    """The request names a model this server does not serve (HTTP 404)."""

    grpc_code = "NOT_FOUND"


class FieldError(ValueError):
    """A refusal of one field, named by `param` (`messages[0].content`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Speculation(_Body):
    proposer: Literal["default", "draft", "ngram", "off"] = "default"
    num_draft_tokens: int | None = Field(None, ge=0, le=UINT32)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=UINT32)  # -1 or 0: off (vLLM takes -1)
    seed: int | None = None  # its range: generate_request, in the gRPC API's words
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted and ignored, as by vLLM
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculation: Speculation | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """A message as OpenAI's clients send it; the fields chat templates read are typed as
    OpenAI types them, others reach the template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def _refuse_unsupported(body: _Sampling) -> None:
    if body.n != 1:
        raise ValueError(f"n must be 1: this server returns one choice per request, got {body.n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0.0:
            raise ValueError(f"{name} is not supported by this server; leave it at 0.")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            raise ValueError("logprobs is not supported by this server; leave it unset.")
        for name, unset in (("echo", not body.echo), ("suffix", body.suffix is None),
                            ("best_of", body.best_of in (None, 1))):  # fmt: skip
            if not unset:
                raise ValueError(f"{name} is not supported by this server; leave it unset.")
    elif isinstance(body, ChatRequest) and (body.logprobs or body.top_logprobs is not None):
        raise ValueError("logprobs and top_logprobs are not supported by this server.")


def check_model(model: str | None, served_name: str) -> None:
    """ModelNotFoundError unless `model` (a request's model field) is unset or the served one."""
    if model is not None and model != served_name:
        raise ModelNotFoundError(
            f"The model {model!r} does not exist: this server serves {served_name!r} "
            f"(GET /v1/models lists it)."
        )


def completion_prompt(body: CompletionRequest, vocab_size: int) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (each a token of the
    vocabulary, as the gRPC API checks them)."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
        raise ValueError(
            f"prompt must be one string or one list of token ids; a batch of {len(prompt)} "
            f"prompts is not supported (send one request per prompt)."
        )
    if isinstance(prompt, list):
        for i, token in enumerate(prompt):
            if not 0 <= token < vocab_size:  # type: ignore[operator]
                raise FieldError(
                    "prompt", f"prompt token_ids[{i}] must be in [0, {vocab_size}), got {token}."
                )
    return prompt  # type: ignore[return-value]


def generate_request(body: _Sampling, prompt: str | list[int]) -> generate_pb2.GenerateRequest:
    """The GenerateRequest of an HTTP request whose model was checked (`check_model`)."""
    _refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise FieldError(
            "stream_options", "stream_options is only allowed when stream is true (as OpenAI's)."
        )
    if body.seed is not None:
        check_range(body.seed, "seed", 0, MAX_SEED)  # SamplingParams' sentence
    request = generate_pb2.GenerateRequest(
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        top_k=max(body.top_k or 0, 0),
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    max_tokens = body.max_tokens
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    elif isinstance(body, CompletionRequest) and max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("seed", body.seed)):  # fmt: skip
        if value is not None:
            setattr(request, name, value)
    if body.speculation is not None:
        request.speculation.proposer = PROPOSERS[body.speculation.proposer]
        if body.speculation.num_draft_tokens is not None:
            request.speculation.num_draft_tokens = body.speculation.num_draft_tokens
    return request


def usage_body(usage: generate_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage, with the request's speculation counts as an extra field."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "speculation": {
            "proposer": PROPOSER_NAMES.get(usage.proposer, "default"),
            "num_draft_tokens_per_step": usage.num_draft_tokens_per_step,
            "num_steps": usage.num_steps,
            "num_drafts": usage.num_drafts,
            "num_draft_tokens": usage.num_draft_tokens,
            "num_accepted_tokens": usage.num_accepted_tokens,
        },
    }


def stop_reason(response: generate_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the request."""
    which = response.WhichOneof("stop_reason")
    return None if which is None else getattr(response, which)


class Responder:
    """Builds one request's response bodies: the completion or chat completion object, or a
    streamed chunk of it (a delta, with finish_reason on the last)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def _choice(self, response: generate_pb2.GenerateResponse, text_key: str, text: Any) -> dict:
        finish = FINISH_REASONS.get(response.finish_reason)
        choice = {"index": 0, text_key: text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason(response)
        return choice

    def whole(self, response: generate_pb2.GenerateResponse) -> dict[str, Any]:
        """The non-streamed body of a request's complete response."""
        if self.chat:
            message = {"role": "assistant", "content": response.text}
            body = self._object("chat.completion", [self._choice(response, "message", message)])
        else:
            body = self._object("text_completion", [self._choice(response, "text", response.text)])
        body["usage"] = usage_body(response.usage)
        return body

    def chunk(self, response: generate_pb2.GenerateResponse, first: bool) -> dict[str, Any]:
        """A streamed chunk carrying one response's delta."""
        if not self.chat:
            return self._object("text_completion", [self._choice(response, "text", response.text)])
        delta = {"role": "assistant", "content": response.text} if first else {}
        if response.text and not first:
            delta["content"] = response.text
        return self._object("chat.completion.chunk", [self._choice(response, "delta", delta)])

    def usage_chunk(self, response: generate_pb2.GenerateResponse) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, []) | {"usage": usage_body(response.usage)}


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _text_of(i: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise FieldError(
                f"messages[{i}].content[{j}]",
                f"messages[{i}].content[{j}] must be a text part ({{'type': 'text', 'text': "
                f"...}}); got type {part.get('type')!r}: this server takes text only.",
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: the fields the client set (a template
    may test whether one is defined), content as one string."""
    return [m.model_dump(exclude_unset=True) | {"content": _text_of(i, m.content)}
            for i, m in enumerate(messages)]  # fmt: skip


# every body and the objects inside them: the names a field path may hold
BODIES: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatRequest, ChatMessage, Speculation, StreamOptions, TokenizeRequest,
    DetokenizeRequest,
)  # fmt: skip
