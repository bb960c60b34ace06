"""The orchestrator behind `specdec serve`: places each draft/target pair's services as Ray
actors (`placement`), admits and routes requests (`scheduler`), keeps every request's committed
tokens (`records`), and serves the client API (`servicer`, `server`) with metrics; `cli` is the
`specdec` command.

It imports without torch or Triton: the services, and torch, load only inside their actors.
"""

from specdec.forking import grpc_fork_handlers_off

grpc_fork_handlers_off()  # first: before anything imports grpc (specdec/forking.py says why)
