"""specdec.client against a fake GenerateService over real gRPC on a real port: streaming,
unary, model info, health, deadlines, cancellation, error mapping, TLS, and no torch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specdec.client import (
    AsyncClient,
    Client,
    GenerateOutput,
    SpecdecClientError,
    build_request,
)
from specdec.pb.specdec.v1 import generate_pb2, generate_pb2_grpc
from specdec.serving.server import Server, ServerConfig
from tests.certs import self_signed_localhost
from tests.specdec.test_torch_free import _probe

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
WORDS = ("Hello", " wörld", " 😀", "!")


class FakeGenerate(generate_pb2_grpc.GenerateServiceServicer):
    """Streams one response per word of WORDS (step i: 2 drafts, i % 3 accepted), then a final
    one; a text prompt "slow" waits 0.2 s between responses; temperature > 100 is refused."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()

    def _responses(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        self.requests.append(request)
        if request.HasField("temperature") and request.temperature > 100:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in [0, 100].")
        done = threading.Event()

        def on_end() -> None:  # the call ended: before the last response only if cancelled
            if not done.is_set():
                self.cancelled.set()

        context.add_callback(on_end)
        n = min(request.max_tokens, len(WORDS)) if request.HasField("max_tokens") else len(WORDS)
        for i in range(n):
            if request.text == "slow":
                time.sleep(0.2)
            yield generate_pb2.GenerateResponse(
                request_id=request.request_id or "server-id",
                text=WORDS[i],
                token_ids=[10 + i],
                steps=[generate_pb2.StepAcceptance(step=i, num_draft_tokens=2, num_accepted=i % 3)],
            )
        yield generate_pb2.GenerateResponse(
            request_id=request.request_id or "server-id",
            finish_reason=generate_pb2.FINISH_REASON_STOP_TOKEN,
            stop_token_id=2,
            usage=generate_pb2.Usage(
                prompt_tokens=3,
                completion_tokens=n,
                num_steps=n,
                num_drafts=n,
                num_draft_tokens=2 * n,
                num_accepted_tokens=sum(i % 3 for i in range(n)),
                num_accepted_tokens_per_pos=[2, 1],
                proposer=generate_pb2.PROPOSER_NGRAM,
                num_draft_tokens_per_step=2,
            ),
            timing=generate_pb2.Timing(queue_s=0.01, time_to_first_token_s=0.1, e2e_s=0.5),
        )
        done.set()

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        yield from self._responses(request, context)

    def Complete(self, request, context):  # type: ignore[no-untyped-def]
        parts = list(self._responses(request, context))
        final = parts[-1]
        for part in parts[:-1]:
            final.text += part.text
            final.token_ids.extend(part.token_ids)
            final.steps.extend(part.steps)
        return final

    def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return generate_pb2.ServedModelInfo(
            models=[
                generate_pb2.ServedModel(
                    name="t/d",
                    target_model="/m/t",
                    draft_model="/m/d",
                    vocab_size=1024,
                    max_seq_len=512,
                    default_proposer=generate_pb2.PROPOSER_DRAFT,
                    default_num_draft_tokens=4,
                    max_num_draft_tokens=8,
                    eos_token_ids=[2],
                    draft_up=True,
                )
            ]
        )


def _serve(fake: FakeGenerate, config: ServerConfig) -> Server:
    server = Server(
        config,
        [SERVICE],
        lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(fake, s),
    )
    server.start()
    server.set_serving(True)
    return server


@pytest.fixture
def served() -> Iterator[tuple[FakeGenerate, str, Server]]:
    fake = FakeGenerate()
    server = _serve(fake, ServerConfig())
    yield fake, f"127.0.0.1:{server.port}", server
    server.stop(0)


def _check_stream(outs: list[GenerateOutput]) -> None:
    assert "".join(o.text for o in outs) == "".join(WORDS)
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12, 13]
    assert [s.num_accepted for o in outs for s in o.steps] == [0, 1, 2, 0]
    assert not any(o.finished for o in outs[:-1])
    final = outs[-1]
    assert final.finish_reason == "stop_token" and final.stop_token_id == 2
    assert final.stop_string is None
    assert final.usage is not None and final.timing is not None
    assert final.usage.acceptance_rate == pytest.approx(3 / 8)
    assert final.usage.mean_acceptance_length == pytest.approx(1 + 3 / 4)
    assert final.usage.proposer == "ngram" and final.usage.num_accepted_tokens_per_pos == (2, 1)
    assert final.timing.e2e_s == pytest.approx(0.5)


def test_generate_streams_and_sends_every_field(served) -> None:
    fake, address, _ = served
    with Client(address, timeout=10) as client:
        outs = list(
            client.generate(
                [1, 2, 3],
                stop="\n",
                stop_token_ids=[7],
                ignore_eos=True,
                temperature=0.0,
                top_k=5,
                top_p=0.9,
                seed=42,
                proposer="off",
                num_draft_tokens=0,
                include_stop_str_in_output=True,
                model="t/d",
                request_id="mine",
            )
        )
    _check_stream(outs)
    assert {o.request_id for o in outs} == {"mine"}
    sent = fake.requests[-1]
    assert list(sent.token_ids.ids) == [1, 2, 3] and sent.WhichOneof("prompt") == "token_ids"
    assert list(sent.stop) == ["\n"] and list(sent.stop_token_ids) == [7] and sent.ignore_eos
    assert sent.HasField("temperature") and sent.temperature == 0.0
    assert (sent.top_k, sent.top_p, sent.seed) == (5, pytest.approx(0.9), 42)
    assert sent.speculation.proposer == generate_pb2.PROPOSER_OFF
    assert sent.speculation.HasField("num_draft_tokens")
    assert sent.speculation.num_draft_tokens == 0
    assert sent.include_stop_str_in_output and sent.model == "t/d"


def test_unset_parameters_stay_unset() -> None:
    request = build_request("hi")
    assert request.WhichOneof("prompt") == "text" and request.text == "hi"
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        assert not request.HasField(name), name
    assert not request.HasField("speculation")
    with pytest.raises(ValueError, match="proposer must be one of"):
        build_request("hi", proposer="eagle")
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -1"):
        build_request("hi", max_tokens=-1)
    with pytest.raises(ValueError, match="got bytes"):
        build_request(b"hi")


def test_complete_returns_the_whole_output(served) -> None:
    _, address, _ = served
    with Client(address, timeout=10) as client:
        out = client.complete("hello", max_tokens=3)
    assert out.text == "".join(WORDS[:3]) and out.token_ids == (10, 11, 12)
    assert [s.step for s in out.steps] == [0, 1, 2]
    assert out.finish_reason == "stop_token" and out.request_id == "server-id"


def test_model_info_and_health(served) -> None:
    _, address, server = served
    with Client(address, timeout=10) as client:
        (model,) = client.model_info()
        assert (model.name, model.vocab_size, model.max_seq_len) == ("t/d", 1024, 512)
        assert (model.default_proposer, model.default_num_draft_tokens) == ("draft", 4)
        assert model.eos_token_ids == (2,) and model.draft_up
        assert client.health() and client.health(SERVICE)
        server.set_serving(False)
        assert not client.health()
        with pytest.raises(SpecdecClientError) as info:
            client.health("no.such.Service")
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_server_errors_carry_code_and_message(served) -> None:
    _, address, _ = served
    with Client(address, timeout=10) as client:
        with pytest.raises(SpecdecClientError) as info:
            list(client.generate("x", temperature=1000.0))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details == "temperature must be in [0, 100]."
        assert str(info.value) == "INVALID_ARGUMENT: temperature must be in [0, 100]."
        with pytest.raises(SpecdecClientError) as info:
            client.complete("x", temperature=1000.0)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_timeout_becomes_a_deadline(served) -> None:
    _, address, _ = served
    with Client(address, timeout=0.3) as client:
        with pytest.raises(SpecdecClientError) as info:
            list(client.generate("slow"))
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        outs = list(client.generate("slow", timeout=10))  # a per-call timeout overrides it
    _check_stream(outs)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Client(address, timeout=0)


def test_leaving_the_stream_early_cancels_the_call(served) -> None:
    fake, address, _ = served
    with Client(address, timeout=10) as client:
        assert len(list(client.generate("x"))) == len(WORDS) + 1
        time.sleep(0.2)
        assert not fake.cancelled.is_set()  # a call that ran to its end was not cancelled
        stream = client.generate("slow")
        assert next(stream).text == WORDS[0]
        stream.close()  # type: ignore[attr-defined]
        assert fake.cancelled.wait(5)


def test_unreachable_server_is_unavailable() -> None:
    with Client("127.0.0.1:1", timeout=2) as client:
        with pytest.raises(SpecdecClientError) as info:
            client.complete("x")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert not client.health(timeout=2)


def test_async_client(served) -> None:
    fake, address, _ = served

    async def main() -> None:
        async with AsyncClient(address, timeout=10) as client:
            outs = [o async for o in client.generate([1, 2], proposer="ngram", seed=7)]
            _check_stream(outs)
            assert fake.requests[-1].seed == 7
            out = await client.complete("x", max_tokens=2)
            assert out.text == "".join(WORDS[:2])
            assert (await client.model_info())[0].name == "t/d"
            assert await client.health()
            with pytest.raises(SpecdecClientError) as info:
                await client.complete("x", temperature=1000.0)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(SpecdecClientError) as info:
                _ = [o async for o in client.generate("slow", timeout=0.3)]
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(main())


def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed_localhost(tmp_path)
    server = _serve(FakeGenerate(), ServerConfig(tls_cert=cert, tls_key=key))
    try:
        address = f"localhost:{server.port}"
        with Client(address, timeout=10, root_certificates=cert.read_bytes()) as client:
            _check_stream(list(client.generate("x")))
        with Client(address, timeout=5) as plain, pytest.raises(SpecdecClientError) as info:
            plain.complete("x")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_client_and_orchestrator_pieces_import_without_torch() -> None:
    modules = (
        "specdec.client",
        "orchestrator.core.detokenizer",
        "orchestrator.core.records",
        "orchestrator.core.metrics",
        "orchestrator.cli.generate",
    )
    result = _probe(modules)
    assert result.returncode == 0, result.stderr
