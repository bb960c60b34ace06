"""More Generate calls at once than `specdec serve` holds, all on one channel, against a real
local stack (Ray actors on CPU, tiny checkpoints): every call is served with the greedy tokens
or refused with RESOURCE_EXHAUSTED naming the limit and the flag that raises it; none ends
CANCELLED, every slot is given back, and the server serves a full load again afterwards.

Past ~1,000 calls opened at once, grpc core dropped some with a bare CANCELLED from its backlog
of calls the server had not taken yet (orchestrator.server.MAX_PENDING_CALLS): 2,000 lost ~10%.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from orchestrator.config import (
    SPARE_WORKERS,
    PlacementConfig,
    SchedulerConfig,
    ServeConfig,
    ServiceConfig,
)
from orchestrator.server import Orchestrator
from specdec.pb.specdec.v1 import generate_pb2_grpc
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.test_serve import eventually, request

MAX_CALLS = 64
# the scheduler holds 16 running + 64 waiting > MAX_CALLS: every refusal is the call limit's
MAX_REQUESTS, MAX_QUEUE = 16, 64
PROMPT, NUM_TOKENS = [5, 6, 7, 8], 24
OK, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
Outcome = tuple[grpc.StatusCode, list[int] | str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Orchestrator, str]]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("many_calls"))
    config = ServeConfig(
        ServiceConfig(
            str(target), str(draft), device="cpu", max_requests=MAX_REQUESTS, max_seq_len=64,
            sampler_impl="torch",
        ),
        PlacementConfig(num_cpus=4),
        SchedulerConfig(max_queue=MAX_QUEUE, proposer="draft", num_draft_tokens=3),
        host="127.0.0.1", port=0, metrics_port=None, grace_s=2.0,
        max_workers=MAX_CALLS + SPARE_WORKERS, max_concurrent_calls=MAX_CALLS,
    )  # fmt: skip
    orchestrator = Orchestrator(config)
    port = orchestrator.start()
    try:
        yield orchestrator, f"127.0.0.1:{port}"
    finally:
        orchestrator.stop(1.0)


async def _burst(address: str, n: int) -> list[Outcome]:
    """n greedy streams opened at once on one channel: (status, tokens or the error details)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one() -> Outcome:
            tokens: list[int] = []
            try:
                async for response in stub.Generate(request(PROMPT, NUM_TOKENS), timeout=60):
                    tokens += response.token_ids
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
            return OK, tokens

        return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.parametrize("calls", [200, 2000])
def test_calls_past_the_limit_are_served_or_refused_never_cancelled(
    stack: tuple[Orchestrator, str], calls: int
) -> None:
    orchestrator, address = stack
    [(code, expected)] = asyncio.run(_burst(address, 1))
    assert code == OK and len(expected) == NUM_TOKENS

    outcomes = asyncio.run(_burst(address, calls))
    codes = Counter(code for code, _ in outcomes)
    assert set(codes) <= {OK, EXHAUSTED}, codes
    assert codes[OK] >= MAX_CALLS and codes[EXHAUSTED] > 0, codes
    for code, out in outcomes:
        if code == OK:
            assert out == expected
        else:
            assert f"max_concurrent_calls={MAX_CALLS}" in out and "--max-concurrent-calls" in out

    eventually(lambda: orchestrator.frontend.calls.in_flight == 0, timeout_s=10.0)
    assert asyncio.run(_burst(address, MAX_CALLS)) == [(OK, expected)] * MAX_CALLS
