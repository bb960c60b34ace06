"""The draft service; `python -m draft_service` runs it alone."""

from specdec.forking import grpc_fork_handlers_off

grpc_fork_handlers_off()  # first: before anything imports grpc (specdec/forking.py says why)
