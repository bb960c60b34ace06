"""The benchmarks (see BENCHMARKS.md)."""

from specdec.forking import grpc_fork_handlers_off

grpc_fork_handlers_off()  # first: before anything imports grpc (specdec/forking.py says why)
