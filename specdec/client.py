"""Python client of `specdec serve` (the `specdec.v1.GenerateService` API), sync and asyncio.

    from specdec.client import Client

    with Client("localhost:50050") as client:
        for out in client.generate("def fib(n):", max_tokens=64, proposer="draft"):
            print(out.text, end="", flush=True)
        print(out.usage.acceptance_rate, out.usage.mean_acceptance_length)

`AsyncClient` has the same methods as coroutines (`generate` is an async iterator). A failed
call raises `SpecdecClientError` with the gRPC status code and the server's message. Torch-free:
it needs only grpcio and protobuf.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.pb.specdec.v1 import generate_pb2, generate_pb2_grpc
from specdec.serving.auth import API_KEY_ENV
from specdec.serving.proposers import TO_PB

DEFAULT_ADDRESS = "localhost:50050"
PROPOSERS = {"default": generate_pb2.PROPOSER_DEFAULT, **TO_PB}  # the server's, or one of them
_PROPOSER_NAMES = {v: k for k, v in PROPOSERS.items()}


class SpecdecClientError(Exception):
    """A failed call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> SpecdecClientError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


@dataclass(frozen=True, slots=True)
class StepAcceptance:
    """Drafted and accepted counts of one verify step; it committed num_accepted + 1 tokens."""

    step: int
    num_draft_tokens: int
    num_accepted: int


@dataclass(frozen=True, slots=True)
class Usage:
    """Token and acceptance counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    num_steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    proposer: str
    num_draft_tokens_per_step: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per draft step: 1 + accepted / drafts; None without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @classmethod
    def from_pb(cls, pb: generate_pb2.Usage) -> Usage:
        return cls(
            pb.prompt_tokens, pb.completion_tokens, pb.num_steps, pb.num_drafts,
            pb.num_draft_tokens, pb.num_accepted_tokens, tuple(pb.num_accepted_tokens_per_pos),
            _PROPOSER_NAMES.get(pb.proposer, "default"), pb.num_draft_tokens_per_step,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Timing:
    """Latencies measured by the server, in seconds from the request's arrival."""

    queue_s: float  # until sent to a pair of services
    time_to_first_token_s: float
    e2e_s: float
    admission_s: float = 0.0  # until the services answered the admission
    prefill_s: float = 0.0  # the services' own admission time (the target's prefill)


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """One GenerateResponse: new text and tokens (the whole output from `complete`); the final
    one also has finish_reason ("length", "stop_string", "stop_token", "max_seq_len",
    "cancelled"), usage and timing."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    steps: tuple[StepAcceptance, ...]
    finish_reason: str | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    timing: Timing | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_pb(cls, pb: generate_pb2.GenerateResponse) -> GenerateOutput:
        reason = None
        if pb.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            name = generate_pb2.FinishReason.Name(pb.finish_reason)
            reason = name.removeprefix("FINISH_REASON_").lower()
        stop_kind = pb.WhichOneof("stop_reason")
        return cls(
            request_id=pb.request_id,
            text=pb.text,
            token_ids=tuple(pb.token_ids),
            steps=tuple(
                StepAcceptance(s.step, s.num_draft_tokens, s.num_accepted) for s in pb.steps
            ),
            finish_reason=reason,
            stop_string=pb.stop_string if stop_kind == "stop_string" else None,
            stop_token_id=pb.stop_token_id if stop_kind == "stop_token_id" else None,
            usage=Usage.from_pb(pb.usage) if pb.HasField("usage") else None,
            timing=(
                Timing(
                    pb.timing.queue_s,
                    pb.timing.time_to_first_token_s,
                    pb.timing.e2e_s,
                    pb.timing.admission_s,
                    pb.timing.prefill_s,
                )
                if pb.HasField("timing")
                else None
            ),
        )


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One served draft/target pair and its limits (see `specdec.v1.ServedModel`)."""

    name: str
    target_model: str
    draft_model: str
    vocab_size: int
    max_seq_len: int
    default_proposer: str
    default_num_draft_tokens: int
    max_num_draft_tokens: int
    eos_token_ids: tuple[int, ...]
    draft_up: bool

    @classmethod
    def from_pb(cls, pb: generate_pb2.ServedModel) -> ServedModel:
        return cls(
            pb.name, pb.target_model, pb.draft_model, pb.vocab_size, pb.max_seq_len,
            _PROPOSER_NAMES.get(pb.default_proposer, "default"), pb.default_num_draft_tokens,
            pb.max_num_draft_tokens, tuple(pb.eos_token_ids), pb.draft_up,
        )  # fmt: skip


def build_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None = None,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    proposer: str | None = None,
    num_draft_tokens: int | None = None,
    include_stop_str_in_output: bool = False,
    model: str = "",
    request_id: str = "",
) -> generate_pb2.GenerateRequest:
    """A GenerateRequest. None leaves a field to the server's default (temperature 1, top_p 1,
    a random seed, the served proposer and k, max_tokens up to max_seq_len); the server checks
    every value against the model and answers INVALID_ARGUMENT naming the field."""
    for name, value in (("max_tokens", max_tokens), ("top_k", top_k), ("seed", seed),
                        ("num_draft_tokens", num_draft_tokens)):  # fmt: skip
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
    if proposer is not None and proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(PROPOSERS)}, got {proposer!r}.")
    request = generate_pb2.GenerateRequest(
        request_id=request_id,
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        top_k=top_k,
        include_stop_str_in_output=include_stop_str_in_output,
        model=model,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, bytes | bytearray):
        raise ValueError("prompt must be a str or a sequence of token ids, got bytes.")
    else:
        request.token_ids.ids.extend(prompt)
    for name, opt in (("max_tokens", max_tokens), ("temperature", temperature),
                      ("top_p", top_p), ("seed", seed)):  # fmt: skip
        if opt is not None:
            setattr(request, name, opt)
    if proposer is not None:
        request.speculation.proposer = PROPOSERS[proposer]
    if num_draft_tokens is not None:
        request.speculation.num_draft_tokens = num_draft_tokens
    return request


def build_set_speculation(
    request_id: str, proposer: str | None = None, num_draft_tokens: int | None = None
) -> generate_pb2.SetSpeculationRequest:
    """A SetSpeculationRequest; None leaves a setting to the server's default."""
    if not request_id:
        raise ValueError("request_id must name a running or queued request.")
    if proposer is not None and proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(PROPOSERS)}, got {proposer!r}.")
    if num_draft_tokens is not None and num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}.")
    request = generate_pb2.SetSpeculationRequest(request_id=request_id)
    if proposer is not None:
        request.speculation.proposer = PROPOSERS[proposer]
    if num_draft_tokens is not None:
        request.speculation.num_draft_tokens = num_draft_tokens
    return request


def _speculation_in_force(pb: generate_pb2.SetSpeculationResponse) -> tuple[str, int]:
    return _PROPOSER_NAMES.get(pb.proposer, "default"), pb.num_draft_tokens


def _options(max_message_bytes: int, server_name: str | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def _credentials(
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials, presenting a client certificate where both its PEM parts are given (a
    server started with --tls-client-ca refuses a client without one); None: plaintext."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("certificate_chain and private_key must be given together.")
    if root_certificates is None:
        if certificate_chain is not None:
            raise ValueError("A client certificate needs TLS: give root_certificates too.")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )


class _Base:
    def __init__(self, address: str, timeout: float | None, api_key: str | None) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(
                f"timeout must be > 0 seconds (or None for no deadline), got {timeout}."
            )
        self.address = address
        self.timeout = timeout
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        # every call but health's carries the key (the server's health service needs none)
        self._metadata = None if key is None else (("authorization", f"Bearer {key}"),)

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _call(self, timeout: float | None) -> dict[str, Any]:
        """A call's deadline and metadata (the API key)."""
        return {"timeout": self._deadline(timeout), "metadata": self._metadata}


class Client(_Base):
    """Blocking client. `timeout` (seconds) is every call's default deadline; None: no deadline.
    TLS when `root_certificates` (PEM) is given; `server_name` overrides the name checked;
    `certificate_chain` and `private_key` (PEM) present a client certificate.
    `api_key` (default: $SPECDEC_API_KEY) is sent as `authorization: Bearer KEY`."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        root_certificates: bytes | None = None,
        server_name: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        api_key: str | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        super().__init__(address, timeout, api_key)
        options = _options(max_message_bytes, server_name)
        creds = _credentials(root_certificates, certificate_chain, private_key)
        if creds is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params: Any
    ) -> Iterator[GenerateOutput]:
        """Streams the output as the server commits it; `params` are `build_request`'s.
        Stopping early (break, close) cancels the request on the server."""
        call = self._stub.Generate(build_request(prompt, **params), **self._call(timeout))
        return _stream(call)

    def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params: Any
    ) -> GenerateOutput:
        """The whole output in one response; `params` are `build_request`'s."""
        request = build_request(prompt, **params)
        try:
            return GenerateOutput.from_pb(self._stub.Complete(request, **self._call(timeout)))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None

    def set_speculation(
        self,
        request_id: str,
        *,
        proposer: str | None = None,
        num_draft_tokens: int | None = None,
        timeout: float | None = None,
    ) -> tuple[str, int]:
        """Changes a running or queued request's proposer and k from its next step; returns
        the (proposer, k) now in force. NOT_FOUND once the request has finished."""
        request = build_set_speculation(request_id, proposer, num_draft_tokens)
        try:
            pb = self._stub.SetSpeculation(request, **self._call(timeout))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        return _speculation_in_force(pb)

    def model_info(self, *, timeout: float | None = None) -> list[ServedModel]:
        request = generate_pb2.GetServedModelInfoRequest()
        try:
            info = self._stub.GetModelInfo(request, **self._call(timeout))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        return [ServedModel.from_pb(m) for m in info.models]

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> bool:
        """True when the server reports SERVING; False when NOT_SERVING or unreachable."""
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False
            raise SpecdecClientError.from_rpc(e) from None
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stream(call: Any) -> Iterator[GenerateOutput]:
    try:
        for pb in call:
            yield GenerateOutput.from_pb(pb)
    except grpc.RpcError as e:
        raise SpecdecClientError.from_rpc(e) from None
    finally:
        call.cancel()  # a no-op once the call ended; frees the request when the caller stops


class AsyncClient(_Base):
    """The asyncio client (grpc.aio); the same methods as `Client`, as coroutines."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        root_certificates: bytes | None = None,
        server_name: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        api_key: str | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        super().__init__(address, timeout, api_key)
        options = _options(max_message_bytes, server_name)
        creds = _credentials(root_certificates, certificate_chain, private_key)
        if creds is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params: Any
    ) -> AsyncIterator[GenerateOutput]:
        """Streams the output as the server commits it; leaving the loop cancels the request."""
        call = self._stub.Generate(build_request(prompt, **params), **self._call(timeout))
        try:
            async for pb in call:
                yield GenerateOutput.from_pb(pb)
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        finally:
            call.cancel()

    async def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params: Any
    ) -> GenerateOutput:
        request = build_request(prompt, **params)
        try:
            pb = await self._stub.Complete(request, **self._call(timeout))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        return GenerateOutput.from_pb(pb)

    async def set_speculation(
        self,
        request_id: str,
        *,
        proposer: str | None = None,
        num_draft_tokens: int | None = None,
        timeout: float | None = None,
    ) -> tuple[str, int]:
        """As `Client.set_speculation`."""
        request = build_set_speculation(request_id, proposer, num_draft_tokens)
        try:
            pb = await self._stub.SetSpeculation(request, **self._call(timeout))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        return _speculation_in_force(pb)

    async def model_info(self, *, timeout: float | None = None) -> list[ServedModel]:
        request = generate_pb2.GetServedModelInfoRequest()
        try:
            info = await self._stub.GetModelInfo(request, **self._call(timeout))
        except grpc.RpcError as e:
            raise SpecdecClientError.from_rpc(e) from None
        return [ServedModel.from_pb(m) for m in info.models]

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> bool:
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = await self._health.Check(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False
            raise SpecdecClientError.from_rpc(e) from None
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
