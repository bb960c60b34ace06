"""The orchestrator behind `specdec serve`, in folders by concern, each importing only the ones
below it (docs/design.md, "The orchestrator's folders"):

- `config`: what `specdec serve` runs (the dataclasses every flag's default comes from);
- `core`: the serving core: each pair's hub stream, scheduling, every request's records, the
  gRPC API and the metrics;
- `web`: the OpenAI-compatible HTTP API; `launch`: the checks before Ray, the processes, the
  local Ray cluster and the pairs' actors;
- `server`: the `Orchestrator` that wires them together;
- `demo`: `specdec demo`; `cli`: the `specdec` command.

It imports without torch or Triton: the services, and torch, load only inside their actors.
"""

from specdec.forking import grpc_fork_handlers_off

grpc_fork_handlers_off()  # first: before anything imports grpc (specdec/forking.py says why)
