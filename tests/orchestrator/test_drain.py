"""One drain for both client ports (`Orchestrator.stop`), the orchestrator in this process in
front of a local pair (`tests.orchestrator.inprocess`): SIGTERM with 40 HTTP and 40 gRPC streams
in flight. For --drain-s the gRPC health service says NOT_SERVING and HTTP /health answers 503
while both ports still take calls; then both refuse new calls, and every stream in flight
finishes within --grace-s, none cut (HTTP streams used to end at once with "abort", and the
HTTP port closed at once)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.local import local_pair
from orchestrator.config import ServeConfig, ServiceConfig
from orchestrator.server import Orchestrator
from specdec.client import Client, SpecdecClientError
from specdec.serving.server import stop_on_signal
from target_service.config import TargetConfig
from tests.draft_service.models import model_draft, runner_config
from tests.orchestrator.inprocess import api_on, slow_steps

STREAMS = 40  # of each kind
PROMPT = [5, 6, 7, 8]
TOKENS = 120  # proposer off: one step a token, so the streams outlast the drain
DRAIN_S = 3.0
# each step at least this long, so that the streams outlast the drain on any machine: after
# their first token, 119 steps take at least 3.6 s
STEP_S = 0.03
GRACE_S = 60.0  # a bound, not a wait: the stop ends as soon as the last stream does


@dataclass
class Stream:
    """What one stream received: its tokens, its finish reason and when it ended."""

    tokens: int = 0
    finish_reason: str | None = None
    ended_at: float = 0.0
    error: BaseException | None = None


@pytest.fixture
def served(checkpoints: tuple[Path, Path]) -> Iterator[Orchestrator]:
    """Both client ports in front of a pair with a KV slot for every stream."""
    target, draft = checkpoints
    slots = 2 * STREAMS + 2  # and the calls made during the drain
    target_config = TargetConfig(runner_config(target, max_slots=slots), sampler_impl="torch")
    draft_config = replace(model_draft(draft), runner=runner_config(draft, max_slots=slots))
    config = ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=128),
        host="127.0.0.1", port=0, metrics_port=None, http_port=0, grace_s=GRACE_S,
        drain_s=DRAIN_S,
    )  # fmt: skip
    with (
        local_pair(draft_config, target_config) as pair,
        api_on(pair, config) as orchestrator,
        slow_steps(pair.target_engine, STEP_S),
    ):
        yield orchestrator


def http_post(port: int, path: str, body: dict[str, object]) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection.getresponse()


def http_stream(port: int, out: Stream, started: threading.Semaphore) -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"proposer": "off"}}  # fmt: skip
    try:
        response = http_post(port, "/v1/completions", body)
        assert response.status == 200, response.read()
        first = True
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            if first:
                started.release()
                first = False
            chunk = json.loads(line[len(b"data: ") :])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"] is not None:
                out.finish_reason = chunk["choices"][0]["finish_reason"]
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
    except BaseException as e:
        out.error = e
    out.ended_at = time.monotonic()


def grpc_stream(client: Client, out: Stream, started: threading.Semaphore) -> None:
    try:
        first = True
        for delta in client.generate(PROMPT, max_tokens=TOKENS, temperature=0.0,
                                     ignore_eos=True, proposer="off"):  # fmt: skip
            if first:
                started.release()
                first = False
            out.tokens += len(delta.token_ids)
            out.finish_reason = delta.finish_reason
    except BaseException as e:
        out.error = e
    out.ended_at = time.monotonic()


def http_health(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/health")
    return connection.getresponse().status


def grpc_health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status  # type: ignore[no-any-return]


def sigterm(orchestrator: Orchestrator) -> None:
    """SIGTERM to this process, handled as `serve_until_signal` handles it."""
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop_on_signal(orchestrator.stop, orchestrator.config.grace_s)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])


def check_the_drain(served: Orchestrator, client: Client, signalled: float) -> None:
    """During the drain health says no and both ports still take calls; after it, both refuse."""
    assert served.http_port is not None
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        assert http_health(served.http_port) == 503
        assert grpc_health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    late = http_post(served.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                           "ignore_eos": True})  # fmt: skip
    assert late.status == 200, late.read()
    # ignore_eos: at the default temperature the first token can be the end of sequence (CI
    # once sampled it), and the call then rightly returns one token
    assert len(client.complete(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2
    drained = time.monotonic() - signalled
    assert drained < DRAIN_S, f"the checks took {drained:.2f} s: past the drain"
    time.sleep(DRAIN_S + 1.0 - drained)
    with pytest.raises(ConnectionRefusedError):
        http_health(served.http_port)
    with pytest.raises(SpecdecClientError, match="UNAVAILABLE"):
        client.complete(PROMPT, max_tokens=2)


def test_sigterm_drains_both_ports_and_every_stream_finishes(served: Orchestrator) -> None:
    assert served.http_port is not None and http_health(served.http_port) == 200
    started = threading.Semaphore(0)
    streams = {kind: [Stream() for _ in range(STREAMS)] for kind in ("http", "grpc")}
    with Client(f"127.0.0.1:{served.port}") as client:
        threads = [threading.Thread(target=http_stream, args=(served.http_port, s, started))
                   for s in streams["http"]]  # fmt: skip
        threads += [threading.Thread(target=grpc_stream, args=(client, s, started))
                    for s in streams["grpc"]]  # fmt: skip
        for t in threads:
            t.start()
        for _ in threads:  # every stream has its first token
            assert started.acquire(timeout=120), [s for v in streams.values() for s in v if s.error]
        signalled = time.monotonic()
        sigterm(served)
        time.sleep(DRAIN_S / 4)
        check_the_drain(served, client, signalled)
        for t in threads:
            t.join(GRACE_S + 10)
    assert served._done.wait(30), "the stop did not end"
    for kind, kind_streams in streams.items():
        errors = [s.error for s in kind_streams if s.error is not None]
        assert not errors, f"{kind}: {errors[:3]}"
        reasons = {s.finish_reason for s in kind_streams}
        assert reasons == {"length"}, f"{kind} streams cut: {reasons}"
        assert all(s.tokens == TOKENS for s in kind_streams), [s.tokens for s in kind_streams]
        last = max(s.ended_at for s in kind_streams) - signalled
        after_drain = sum(s.ended_at > signalled + DRAIN_S for s in kind_streams)
        print(f"{kind}: {after_drain} of {STREAMS} streams ended after the drain, the last "
              f"{last:.1f} s after the signal")  # fmt: skip
        assert last < DRAIN_S + GRACE_S
        assert after_drain > 0, "every stream ended within the drain: nothing tested the grace"


def test_a_second_stop_returns_when_the_first_has_ended(checkpoints: tuple[Path, Path]) -> None:
    """A stop called while a SIGTERM's runs on its thread (a program's own stop in a `finally`,
    say) returns once that one has ended, its drain included: it used to return at once, with
    the ports still open."""
    target, draft = checkpoints
    config = ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=128),
        host="127.0.0.1", port=0, metrics_port=None, http_port=0, drain_s=1.0, grace_s=1.0,
    )  # fmt: skip
    orchestrator = Orchestrator(config)
    orchestrator._bind()  # the ports only: no pair is started
    assert orchestrator.http_port is not None
    first = threading.Thread(target=orchestrator.stop)
    started = time.monotonic()
    first.start()
    while not orchestrator._stopped.is_set():
        time.sleep(0.01)
    orchestrator.stop()
    waited = time.monotonic() - started
    assert orchestrator._done.is_set(), "the second stop returned before the first ended"
    assert waited >= 0.9, f"it returned {waited:.2f} s after the first began, within the drain"
    with pytest.raises(ConnectionRefusedError):
        http_health(orchestrator.http_port)
    first.join(30)
    assert not first.is_alive()
