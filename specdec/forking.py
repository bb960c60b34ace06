"""gRPC's fork handlers off in specdec's programs, before grpc is imported.

With the handlers on (grpcio's default), a child made by a real `fork()` while other threads
are inside gRPC aborts now and then (SIGABRT, exit -6) before it execs: 2 to 33 children of 400
on a 2-core machine with a busy server, in our runs. Python's `subprocess` forks for real when
given a `preexec_fn`, and Ray starts its GCS, raylet and dashboard that way, from the process
that already serves the client port: a CI run lost Ray's dashboard ("return code -6") and two
local cluster starts to it (2026-11-26). Every process specdec or Ray forks execs at once and
needs none of the handlers. grpc reads GRPC_ENABLE_FORK_SUPPORT when it is imported, so each
program's package (`orchestrator`, `draft_service`, `target_service`, and `bench`) calls
`grpc_fork_handlers_off()` in its `__init__`, before anything imports grpc; the children it
starts, Ray's processes and actors among them, inherit the setting. A value the user set is
kept. The library alone (`specdec.client` in a user's program) leaves the environment as it is.
"""

from __future__ import annotations

import os

VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"


def grpc_fork_handlers_off() -> None:
    """GRPC_ENABLE_FORK_SUPPORT=0 for this process and its children, unless it is set."""
    os.environ.setdefault(VARIABLE, "0")
