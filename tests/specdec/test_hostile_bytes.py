"""Bytes that are not the request a method expects, at every method of the client API, the draft
service and the target service: undecodable ones are INVALID_ARGUMENT naming the method, and
nothing (random bytes, mutated valid messages) ends a call with INTERNAL or UNKNOWN or harms
the services: afterwards greedy requests still give the target's reference tokens.

The client API runs in this process in front of a local pair (`tests.orchestrator.inprocess`);
the target's Serve stream (one at a time) is sent to a second, bare target service.
Set SPECDEC_FUZZ_EXAMPLES to change the `slow` run's examples per method and kind: 500 by
default, so the whole test command stays within minutes; SPECDEC_FUZZ_EXAMPLES=5000 is the
10,000-messages-per-method run (about 14 minutes on 2 cores).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.local import LocalPair
from bench.pipeline import Pipeline
from orchestrator.config import ServeConfig, ServiceConfig
from specdec.pb import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.client import make_channel
from specdec.serving.server import Server
from tests.draft_service.models import build_checkpoints, model_draft, runner_config, services
from tests.orchestrator.inprocess import api_on
from tests.orchestrator.test_serve import oracle
from tests.specdec import hostile_bytes as hb

METHODS = hb.methods()
VALID = hb.valid_messages()
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
PROMPT = (5, 6, 7, 8)
SLOW_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "500"))


@dataclass
class Rig:
    pair: LocalPair
    bare_target: Server
    channels: dict[str, grpc.Channel]
    target_dir: Path
    api_address: str

    def channel(self, method: hb.Method) -> grpc.Channel:
        return self.channels["serve" if method.path.endswith("/Serve") else method.role]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    from target_service.config import TargetConfig
    from target_service.server import start as start_target

    target, draft = build_checkpoints(tmp_path_factory.mktemp("hostile"))
    api_config = ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=128),
        host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5,
    )  # fmt: skip
    bare, _ = start_target(TargetConfig(runner_config(target), sampler_impl="torch"))
    with services(target, model_draft(draft), sampler_impl="torch") as pair, \
            api_on(pair, api_config) as api:  # fmt: skip
        api_address = f"127.0.0.1:{api.port}"
        channels = {
            "api": make_channel(api_address),
            "draft": make_channel(pair.draft_address),
            "target": make_channel(pair.target_address),
            "serve": make_channel(f"127.0.0.1:{bare.port}"),
        }
        try:
            yield Rig(pair, bare, channels, target, api_address)
        finally:
            for channel in channels.values():
                channel.close()
            bare.stop(0)


def _release(rig: Rig, method: hb.Method, data: bytes) -> None:
    """Frees what a (mutated) Admit may have admitted, so that slots never run out."""
    if not method.path.endswith("/Admit"):
        return
    ids = [hb.FUZZ_ID]
    if hb.decodes(method.request, data):
        ids.append(method.request.FromString(data).request_id)  # type: ignore[attr-defined]
    stub_cls = draft_pb2_grpc.DraftServiceStub if method.role == "draft" else (
        target_pb2_grpc.TargetServiceStub)  # fmt: skip
    stub_cls(rig.channel(method)).Release(common_pb2.ReleaseRequest(request_ids=ids), timeout=30)


def send(rig: Rig, method: hb.Method, data: bytes) -> tuple[grpc.StatusCode, str]:
    """The status `data` gets; a Serve stream still open from the last call is waited for."""
    deadline = time.monotonic() + 10
    while True:
        outcome = hb.call(rig.channel(method), method, data)
        code, details = outcome.code(), outcome.details() or ""
        if code != grpc.StatusCode.FAILED_PRECONDITION or "Serve stream is already" not in details:
            break
        assert time.monotonic() < deadline, "the previous Serve stream never ended"
        time.sleep(0.02)
    _release(rig, method, data)
    assert code not in BAD_CODES, (method.name, data, code, details)
    return code, details


def _cases() -> list[tuple[hb.Method, str, bytes]]:
    return [
        (m, name, data)
        for m in METHODS
        for valid in VALID[m.request.DESCRIPTOR.name][:1]
        for name, data in hb.malformed(m.request, valid.SerializeToString()).items()
    ]


CASES = _cases()


def test_there_are_over_100_hand_written_cases_across_every_method() -> None:
    assert len(CASES) >= 100, len(CASES)
    assert {m.path for m, _, _ in CASES} == {m.path for m in METHODS}
    assert {m.role for m in METHODS} == {"api", "draft", "target"} and len(METHODS) == 13


@pytest.mark.parametrize(
    ("method", "name", "data"), CASES, ids=[f"{m.name}-{n}" for m, n, _ in CASES]
)
def test_undecodable_bytes_are_invalid_argument_naming_the_method(
    rig: Rig, method: hb.Method, name: str, data: bytes
) -> None:
    code, details = send(rig, method, data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
    assert details.startswith(f"{method.path}: the request is not a valid "), details
    assert method.request.DESCRIPTOR.full_name in details


@st.composite
def mutated(draw: st.DrawFn, valid: list[bytes]) -> bytes:
    """A valid message with one of: a byte changed, a cut, bytes inserted, a span repeated."""
    data = bytearray(draw(st.sampled_from(valid)))
    kind = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "flip" and data:
        data[at] ^= draw(st.integers(1, 255))
    elif kind == "cut":
        del data[at:]
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        data += data[at:]
    return bytes(data)


def _storm(rig: Rig, method: hb.Method, examples: int) -> None:
    valid = [m.SerializeToString() for m in VALID[method.request.DESCRIPTOR.name]]
    fuzz = settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip

    @fuzz
    @given(st.binary(max_size=200))
    def random_bytes(data: bytes) -> None:
        send(rig, method, data)

    @fuzz
    @given(mutated(valid))
    def mutated_messages(data: bytes) -> None:
        send(rig, method, data)

    random_bytes()
    mutated_messages()


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_random_and_mutated_messages_never_internal(rig: Rig, method: hb.Method) -> None:
    _storm(rig, method, 20)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_random_and_mutated_messages_never_internal_long(rig: Rig, method: hb.Method) -> None:
    _storm(rig, method, SLOW_EXAMPLES)


def test_after_the_storm_greedy_output_is_the_targets(rig: Rig) -> None:
    """Runs last in this module: the client API, the pair and the bare target still give the
    target-only greedy tokens."""
    from specdec.client import Client

    expected = oracle(rig.target_dir, PROMPT, 12)
    with Client(rig.api_address, timeout=60) as client:
        out = client.complete(list(PROMPT), max_tokens=12, temperature=0.0, ignore_eos=True,
                              proposer="draft", num_draft_tokens=3)  # fmt: skip
    assert list(out.token_ids) == expected
    pipeline = Pipeline(None, rig.channels["serve"])
    try:
        pipeline.admit("after", PROMPT, SamplingParams(temperature=0.0))
        pipeline.generate({"after": 0}, 12)
        assert pipeline.requests["after"].generated[:12] == expected
    finally:
        pipeline.close()
