"""One draft/target pair in this process, on loopback ports, without Ray: the services started
from their own configs, the target pointed at the draft, and both stopped on exit.

`specdec serve` starts each service in its own Ray actor instead (`orchestrator.launch.services`);
this is the launcher for everything that drives one pair directly: the services' tests, the
direct `Pipeline` driver and the hub's tests. Like `orchestrator.launch.services`, it imports the
services (and so torch) only when called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bench.pipeline import Pipeline
from specdec.serving.client import make_channel

if TYPE_CHECKING:
    from draft_service.config import DraftConfig
    from draft_service.engine import DraftEngine
    from specdec.serving.server import Server, ServerConfig
    from target_service.config import TargetConfig
    from target_service.engine import TargetEngine

LOOPBACK = "127.0.0.1"


@dataclass
class LocalPair:
    """The running pair. `restart_draft` replaces a stopped draft service with a fresh one."""

    target: Server
    target_engine: TargetEngine
    draft: Server
    draft_engine: DraftEngine
    draft_config: DraftConfig

    @property
    def target_address(self) -> str:
        return f"{LOOPBACK}:{self.target.port}"

    @property
    def draft_address(self) -> str:
        return f"{LOOPBACK}:{self.draft.port}"

    def pipeline(self) -> Pipeline:
        """A direct driver of the two services (the target relays nothing to its hub)."""
        return Pipeline(make_channel(self.draft_address), make_channel(self.target_address))

    def restart_draft(self) -> str:
        """A fresh draft service from the same config; returns its address."""
        from draft_service.server import start as start_draft

        self.draft, self.draft_engine = start_draft(self.draft_config)
        return self.draft_address


@contextmanager
def local_pair(draft: DraftConfig, target: TargetConfig) -> Iterator[LocalPair]:
    """Starts the draft, then the target with `draft_address` pointing at it (the target checks
    the pair's tokenizers at start-up); both on free loopback ports unless the configs name a
    port."""
    from draft_service.server import start as start_draft
    from target_service.server import start as start_target

    d_srv, d_engine = start_draft(replace(draft, server=_loopback(draft.server)))
    try:
        t_config = replace(
            target, server=_loopback(target.server), draft_address=f"{LOOPBACK}:{d_srv.port}"
        )
        t_srv, t_engine = start_target(t_config)
    except BaseException:
        d_srv.stop(0)
        raise
    pair = LocalPair(t_srv, t_engine, d_srv, d_engine, draft)
    try:
        yield pair
    finally:
        pair.target.stop(0)
        pair.draft.stop(0)
        pair.target_engine.runner.close()  # a tensor-parallel target's other ranks


def _loopback(server: ServerConfig) -> ServerConfig:
    return replace(server, host=LOOPBACK)
