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
    """--device, --dtype, --max-seq-len, --cuda-graph-batch-sizes and the KV cache's layout
    (--kv-block-size, --kv-blocks, --prefix-caching). `devices` None takes any
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
    group.add_argument("--kv-block-size", type=int, metavar="N", default=defaults("kv_block_size"),
                       help="a paged KV cache in blocks of N positions, shared by the requests "
                            "(prefix caching, forks without copies); 0: a fixed slot of "
                            "max-seq-len positions per request")  # fmt: skip
    group.add_argument("--kv-blocks", type=int, metavar="N", default=defaults("kv_blocks"),
                       help="blocks of the paged KV cache (0: what the fixed slots would "
                            "take)")  # fmt: skip
    group.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults("prefix_caching"),
                       help="reuse a paged cache's full blocks across requests that begin with "
                            "the same tokens")  # fmt: skip


def add_k_limit_flag(group: Group, defaults: Defaults) -> None:
    """--max-num-draft-tokens: the largest k a service (and so a request) takes."""
    group.add_argument("--max-num-draft-tokens", type=int, metavar="K",
                       default=defaults("max_num_draft_tokens"),
                       help="largest k a request may ask for")  # fmt: skip


def add_prefill_chunk_flag(group: Group, defaults: Defaults) -> None:
    """--prefill-chunk-tokens: chunked prefill, on both services (serve passes it to both)."""
    group.add_argument("--prefill-chunk-tokens", type=int, metavar="N",
                       default=defaults("prefill_chunk_tokens"),
                       help="chunked prefill: a new prompt longer than N tokens is prefilled N "
                            "tokens at a time, one chunk between two steps, so running streams "
                            "keep stepping while it is prefilled (0: whole, at "
                            "admission)")  # fmt: skip


def add_target_flags(group: Group, defaults: Defaults) -> None:
    """The target service's: its sampler, dynamic speculation and its deadline for the draft."""
    group.add_argument("--sampler-impl", choices=["auto", "triton", "torch"],
                       default=defaults("sampler_impl"),
                       help="the target's rejection sampler: Triton kernels or their pure-torch "
                            "reference (auto: Triton on a GPU)")  # fmt: skip
    group.add_argument("--dynamic-speculation", action=argparse.BooleanOptionalAction,
                       default=defaults("dynamic_speculation"),
                       help="the target chooses each step's k (0 included) from the measured "
                            "acceptance and step times; a request's k is the upper bound, and a "
                            "sampled request with its own seed keeps its k")  # fmt: skip
    group.add_argument("--draft-deadline-ms", type=float, metavar="MS",
                       default=defaults("draft_deadline_s") * 1e3,
                       help="a draft that has not answered a step's Propose after this long "
                            "(or 10 times its median round trip, if longer) is given up for "
                            "that step: its requests decode at k = 0 until it answers "
                            "again")  # fmt: skip
    group.add_argument("--draft-push-chains", action=argparse.BooleanOptionalAction,
                       default=defaults("draft_push_chains"),
                       help="with draft-ahead, take the chains the draft pushes before they are "
                            "asked for: a step whose every verdict has one starts its verify "
                            "without waiting for the draft's answer (pushes are asked for where, "
                            "as measured, they make the target wait less than asking)")  # fmt: skip


def add_draft_flags(group: Group, defaults: Defaults) -> None:
    """The draft service's: the form of q it sends, and draft-ahead."""
    group.add_argument("--q-form", choices=["sparse", "dense"], default=defaults("q_form"),
                       help="draft probabilities sent as the draft's top tokens (sparse, exact "
                            "for what it sampled from) or over the whole vocabulary "
                            "(dense)")  # fmt: skip
    group.add_argument("--support-size", type=int, default=defaults("support_size"),
                       help="sparse q: the draft's top tokens sent per draft position")  # fmt: skip
    group.add_argument("--draft-ahead", type=int, default=defaults("draft_ahead"), metavar="F",
                       help="draft-ahead: while the target verifies, the draft drafts the next "
                            "step for its F best guesses of each verdict (0: off)")  # fmt: skip
    group.add_argument("--draft-ahead-backup", choices=["auto", "always", "never"],
                       default=defaults("draft_ahead_backup"),
                       help="with --draft-ahead: a request whose verdict was not drafted ahead "
                            "takes a backup step of no drafts instead of making the whole step "
                            "wait (auto: where that commits more tokens per second; seeded "
                            "sampled requests never do)")  # fmt: skip
    group.add_argument("--draft-ahead-spread", action=argparse.BooleanOptionalAction,
                       default=defaults("draft_ahead_spread"),
                       help="with --draft-ahead: as many hypotheses a pass as F guesses for "
                            "each likely accepted count, spread instead over the counts and up "
                            "to 2F guesses a position by how often each has been the verdict "
                            "(the draft keeps 2F + 1 ids a position)")  # fmt: skip
    group.add_argument("--saguaro-scale", type=float, default=defaults("saguaro_scale"),
                       metavar="C",
                       help="with --draft-ahead: the draft samples from its q with the F + 1 "
                            "tokens it guesses scaled by C in (0, 1] and sends that q (Saguaro "
                            "sampling: exact, and chains hit more often at temperature > 0; "
                            "1: off)")  # fmt: skip


def add_synthetic_length_flag(group: Group) -> None:
    """--synthetic-acceptance-length (BENCHMARKING ONLY, default off); which k it is for, the
    group says."""
    group.add_argument("--synthetic-acceptance-length", type=float, metavar="L",
                       help="BENCHMARKING ONLY: the target accepts drafts at mean acceptance "
                            "length L in [1, k + 1]")  # fmt: skip


def add_synthetic_spread_flag(group: Group) -> None:
    """--synthetic-acceptance-spread (BENCHMARKING ONLY, mixed traffic)."""
    group.add_argument("--synthetic-acceptance-spread", type=float, metavar="S", default=0.0,
                       help="BENCHMARKING ONLY, with --synthetic-acceptance-length L: each "
                            "request's own mean acceptance length, uniform in [L - S, L + S] by "
                            "a hash of its id (mixed traffic; default 0: all at L)")  # fmt: skip


def add_synthetic_hit_rate_flag(group: Group, defaults: Defaults) -> None:
    """--synthetic-hit-rate and its spread (BENCHMARKING ONLY)."""
    group.add_argument("--synthetic-hit-rate", type=float, metavar="H",
                       default=defaults("synthetic_hit_rate"),
                       help="BENCHMARKING ONLY, with --draft-ahead: the draft finds a chain "
                            "drafted ahead for this share of its asks, whatever the "
                            "verdict")  # fmt: skip
    group.add_argument("--synthetic-hit-rate-spread", type=float, metavar="S",
                       default=defaults("synthetic_hit_rate_spread"),
                       help="BENCHMARKING ONLY, with --synthetic-hit-rate H: each request's own "
                            "hit rate, uniform in [H - S, H + S] by a hash of its id (mixed "
                            "traffic; default 0: all at H)")  # fmt: skip
