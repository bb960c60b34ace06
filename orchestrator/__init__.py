"""The orchestrator behind `specdec serve`: places each draft/target pair's services as Ray
actors (`placement`), admits and routes requests (`scheduler`), keeps every request's committed
tokens (`records`), and serves the client API (`servicer`, `server`) with metrics; `cli` is the
`specdec` command.

It imports without torch or Triton: the services, and torch, load only inside their actors.
"""

import specdec  # noqa: F401  (first: turns gRPC's fork handlers off before grpc loads)
