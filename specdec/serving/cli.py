"""Command-line options both services share (server and runner).

Every default comes from the config dataclass field the option fills (`default_of`), so the
command line and the Python API cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from specdec.defaults import default_of
from specdec.errors import SpecdecError
from specdec.message_limits import DEFAULT_SEQ_LEN_CAP
from specdec.runner import RunnerConfig
from specdec.serving.flags import add_listen_flags, add_runner_flags, add_stop_flags, add_tls_flags
from specdec.serving.server import Server, ServerConfig

log = logging.getLogger(__name__)
# A checkpoint's own limit is the default max_seq_len, up to this: the KV cache reserves
# max_slots × max_seq_len positions up front, and Llama 3's 131,072 would need 16 GiB per slot
# for the 8B in bfloat16.
MAX_DEFAULT_SEQ_LEN = DEFAULT_SEQ_LEN_CAP


def serve(prog: str, start: Callable[[], tuple[Server, Any]]) -> int:
    """A service's main after its arguments are parsed: logging, then `start` (which builds
    the config and starts the server); a bad config or checkpoint, or a port that cannot be
    bound, is one line on stderr and exit code 2, otherwise it serves until SIGTERM or SIGINT
    and returns 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        server, _ = start()
    except (ValueError, SpecdecError, OSError) as e:  # OSError: the port could not be bound
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    server.serve_until_signal()
    return 0


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    g = parser.add_argument_group("server", "the service's gRPC port")
    d = partial(default_of, ServerConfig)
    add_listen_flags(g, d, port=default_port)
    g.add_argument("--max-message-bytes", type=int, default=d("max_message_bytes"))
    add_tls_flags(g, d)
    add_stop_flags(g, d)


def add_runner_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("model")
    d = partial(default_of, RunnerConfig)
    g.add_argument("--model", required=required, help="local Hugging Face checkpoint directory")
    g.add_argument("--max-slots", type=int, default=d("max_slots"), help="requests held at once")
    add_runner_flags(g, d, devices=None, dtypes=("float32", "bfloat16", "float16"))
    g.add_argument("--tensor-parallel", type=int, default=d("tensor_parallel"), metavar="N",
                   help="split the model over N ranks of this node: N GPUs from --device's "
                        "on (cuda or cuda:0: 0 .. N-1; cuda:1: 1 .. N), or N gloo processes "
                        "on the CPU")  # fmt: skip


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        grace_s=args.grace_s,
        drain_s=args.drain_s,
    )


def checkpoint_seq_len(model_path: str) -> int | None:
    """The checkpoint's max_position_embeddings from its config.json; None if it has none (the
    loader then reports what is wrong with the directory)."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text())
        value = value.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value >= 1 else None


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    """The runner's config; without --max-seq-len, the checkpoint's own limit (capped)."""
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        limit = checkpoint_seq_len(args.model)
        max_seq_len = default_of(RunnerConfig, "max_seq_len") if limit is None else limit
        max_seq_len = min(max_seq_len, MAX_DEFAULT_SEQ_LEN)
        log.info("max_seq_len %d (checkpoint limit %s, cap %d)", max_seq_len, limit,
                 MAX_DEFAULT_SEQ_LEN)  # fmt: skip
    return RunnerConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        max_slots=args.max_slots,
        max_seq_len=max_seq_len,
        cuda_graph_batch_sizes=tuple(args.cuda_graph_batch_sizes),
        tensor_parallel=args.tensor_parallel,
        kv_block_size=args.kv_block_size,
        kv_blocks=args.kv_blocks,
        prefix_caching=args.prefix_caching,
    )
