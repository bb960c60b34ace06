"""The client API (`orchestrator.server.Orchestrator`) in this process, in front of a pair
started by `bench.local` instead of Ray: the same server, scheduler and hub stream as
`specdec serve`, seconds to start instead of a Ray cluster's minute."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.local import LocalPair
from orchestrator.config import ServeConfig
from orchestrator.launch.placement import PairPlacement
from orchestrator.server import Orchestrator
from target_service.engine import TargetEngine


@contextmanager
def api_on(pair: LocalPair, config: ServeConfig) -> Iterator[Orchestrator]:
    """An Orchestrator serving `pair` (its placement never starts: no Ray is involved), on the
    ports `config` asks for (HTTP with `http_port`, metrics with `metrics_port`)."""
    orchestrator = Orchestrator(config)
    orchestrator._bind()
    no_ray: Any = None  # no placement group or actor handles: the pair is local
    placed = PairPlacement(
        0, no_ray, no_ray, pair.target_address, pair.target_engine.info, no_ray,
        pair.draft_address, pair.draft_engine.info,
    )  # fmt: skip
    try:
        orchestrator._connect([placed])
        orchestrator._set_serving(True)  # gRPC health and HTTP /health
        yield orchestrator
    finally:
        orchestrator.stop(0.5)


@contextmanager
def slow_steps(engine: TargetEngine, step_s: float) -> Iterator[None]:
    """Every verification step of `engine` (the hub's `verify_timed`) takes at least step_s
    while this is open: a request of n tokens at k = 0 then runs for at least n * step_s on any
    machine, however fast, for tests that need it still running after some event."""
    verify_timed = engine.verify_timed

    def slowed(*args: Any, **kw: Any) -> Any:
        time.sleep(step_s)
        return verify_timed(*args, **kw)

    engine.verify_timed = slowed  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.verify_timed  # the class's method again
