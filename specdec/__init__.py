"""Shared code of the specdec services: sampling parameters, counter-based random streams,
the model runner and the generated protobuf modules.

Importing it turns gRPC's fork handlers off for this process and its children unless
GRPC_ENABLE_FORK_SUPPORT is already set. With them on (grpcio's default), a child forked while
other threads are in gRPC aborts now and then (SIGABRT) before it execs: 2 to 8 forks in 400 on
a 2-core machine with a server busy. Ray starts its GCS, raylet and dashboard by forking from
the process that serves the client port, and Triton forks its compilers inside the services, so
Ray's dashboard exited with "return code -6" beside two local clusters that did not start (a CI
run, 2026-11-26). Every process specdec forks execs at once and needs none of the handlers. The
variable is read when grpc is imported, so this package's `__init__` (and the orchestrator's and
the services', which import it) run it first.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
