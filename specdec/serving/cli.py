"""Command-line options both services share (server and runner)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError
from specdec.runner import RunnerConfig
from specdec.serving.server import DEFAULT_MAX_MESSAGE_BYTES, Server, ServerConfig


def serve(prog: str, start: Callable[[], tuple[Server, Any]]) -> int:
    """A service's main after its arguments are parsed: logging, then `start` (which builds
    the config and starts the server); a bad config or checkpoint is one line on stderr and exit
    code 2, otherwise it serves until SIGTERM or SIGINT and returns 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        server, _ = start()
    except (ValueError, SpecdecError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    server.serve_until_signal()
    return 0


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=default_port)
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    g.add_argument("--tls-cert", type=Path, help="PEM certificate chain (enables TLS)")
    g.add_argument("--tls-key", type=Path, help="PEM private key")
    g.add_argument("--grace-s", type=float, default=10.0, help="in-flight calls on SIGTERM")
    g.add_argument("--drain-s", type=float, default=0.0, help="NOT_SERVING before closing")


def add_runner_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=required, help="local Hugging Face checkpoint directory")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-slots", type=int, default=32, help="requests held at once")
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--cuda-graph-batch-sizes", type=int, nargs="*", default=[])


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        grace_s=args.grace_s,
        drain_s=args.drain_s,
    )


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    return RunnerConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        max_slots=args.max_slots,
        max_seq_len=args.max_seq_len,
        cuda_graph_batch_sizes=tuple(args.cuda_graph_batch_sizes),
    )
