"""Command-line flags that `specdec serve` and the services' mains (through `specdec.serving.cli`)
both declare, each declared here once: a gRPC server's (where it listens, its TLS, its stop) and
a model runner's (device, dtype, sequence length, CUDA graphs).

Each program passes its own defaults, read from the config dataclass the flags fill
(`specdec.defaults.default_of`), and where the two differ the choices: `specdec serve` adds
"auto" to --device and --dtype. What a group of flags applies to (the client ports, a service's
port) its argument group says. Torch-free: `specdec serve --help` loads this without the runner.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.message_limits import DEFAULT_SEQ_LEN_CAP

Defaults = Callable[[str], Any]  # a config field's name -> its default
Group = argparse.ArgumentParser | argparse._ArgumentGroup


def add_listen_flags(group: Group, defaults: Defaults, *, port: int) -> None:
    """--host and --port (`port` the default: each program has its own)."""
    group.add_argument("--host", default=defaults("host"), help="address to listen on")
    group.add_argument("--port", type=int, default=port, help="gRPC port; 0 picks a free one")


def add_stop_flags(group: Group, defaults: Defaults) -> None:
    """--grace-s and --drain-s: the graceful stop on SIGTERM."""
    group.add_argument("--grace-s", type=float, default=defaults("grace_s"),
                       help="seconds the calls in flight get to finish on SIGTERM once the drain "
                            "is over")  # fmt: skip
    group.add_argument("--drain-s", type=float, default=defaults("drain_s"),
                       help="on SIGTERM, seconds health reports NOT_SERVING while calls are still "
                            "taken, before new ones are refused; e.g. 5 behind a load "
                            "balancer")  # fmt: skip


def add_tls_flags(group: Group, defaults: Defaults) -> None:
    """--tls-cert, --tls-key and --tls-client-ca: PEM files; plaintext without them."""
    pem: Callable[..., Any] = lambda flag, **kw: group.add_argument(
        flag, type=Path, metavar="FILE", default=defaults(flag[2:].replace("-", "_")), **kw
    )
    pem("--tls-cert", help="PEM certificate chain: TLS only, no plaintext (with --tls-key)")
    pem("--tls-key", help="PEM private key of --tls-cert")
    pem("--tls-client-ca",
        help="PEM CA that must have signed each client's certificate: a client without one is "
             "refused at the TLS handshake (mutual TLS, with --tls-cert)")  # fmt: skip


def add_runner_flags(
    group: Group, defaults: Defaults, *, devices: Sequence[str] | None, dtypes: Sequence[str]
) -> None:
    """--device, --dtype, --max-seq-len and --cuda-graph-batch-sizes. `devices` None takes any
    device torch names (cuda:1, ...); "auto" among the choices is explained in the help."""
    device_help = "device the model runs on"
    if devices is not None and "auto" in devices:
        device_help += "; auto: CUDA where Ray gives the service a GPU, else CPU"
    group.add_argument("--device", choices=devices, default=defaults("device"), help=device_help)
    dtype_help = "weights' and activations' dtype"
    if "auto" in dtypes:
        dtype_help += "; auto: the checkpoint's torch_dtype on a GPU, float32 on the CPU"
    group.add_argument("--dtype", choices=dtypes, default=defaults("dtype"), help=dtype_help)
    group.add_argument("--max-seq-len", type=int,
                       help="tokens per request (default: the checkpoint's "
                            f"max_position_embeddings, at most {DEFAULT_SEQ_LEN_CAP})")  # fmt: skip
    group.add_argument("--cuda-graph-batch-sizes", type=int, nargs="*", metavar="N",
                       default=list(defaults("cuda_graph_batch_sizes")),
                       help="batch sizes whose steps are captured as CUDA graphs (GPU "
                            "only)")  # fmt: skip
