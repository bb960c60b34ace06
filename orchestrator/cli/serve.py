"""`specdec serve`: its flags, the ServeConfig they describe, and the command itself.

    specdec serve --target DIR --draft DIR [-k 4] [--pairs 1] [--port 50050] [--http-port 8000]
    specdec serve --target DIR --proposer ngram
    specdec serve --config serve.toml          # keys are the flags' names

Every default is the config dataclasses' (`orchestrator.config`). The flags a service's own
main declares too (its server's and its runner's) are declared once, in `specdec.serving.flags`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

from orchestrator.config import (
    DEVICES,
    DTYPES,
    PROPOSERS,
    PlacementConfig,
    SchedulerConfig,
    ServeConfig,
    ServiceConfig,
)
from orchestrator.launch.preflight import check_before_ray
from orchestrator.launch.supervisor import follow_parent, is_child, run_in_child
from specdec.defaults import default_of
from specdec.serving.auth import read_api_key_file
from specdec.serving.flags import (
    add_draft_flags,
    add_k_limit_flag,
    add_listen_flags,
    add_prefill_chunk_flag,
    add_runner_flags,
    add_stop_flags,
    add_synthetic_hit_rate_flag,
    add_synthetic_length_flag,
    add_synthetic_spread_flag,
    add_target_flags,
    add_tls_flags,
)

PROG = "specdec"


def _services_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models and services (each pair)")
    d = partial(default_of, ServiceConfig)
    g.add_argument("--target", help="target checkpoint: a local Hugging Face directory")
    g.add_argument("--draft", help="draft checkpoint directory (omit for ngram / off only)")
    add_runner_flags(g, d, devices=DEVICES, dtypes=DTYPES)
    g.add_argument("--max-requests", type=int, default=d("max_requests"),
                   help="requests each pair holds at once (KV slots per service)")  # fmt: skip
    g.add_argument("--target-tensor-parallel", type=int, metavar="N",
                   default=d("target_tensor_parallel"),
                   help="split the target over N GPUs of one node (tensor parallelism; N "
                        "divides its attention heads, KV heads and MLP width); the draft keeps "
                        "a GPU of its own, so a pair takes N + 1")  # fmt: skip
    add_k_limit_flag(g, d)
    add_prefill_chunk_flag(g, d)
    add_draft_flags(g, d)
    add_target_flags(g, d)
    b = parser.add_argument_group(
        "benchmarking only",
        "The served output is NOT distributed as the target's. "
        "--synthetic-acceptance-length's k is --num-draft-tokens.",
    )
    add_synthetic_length_flag(b)
    add_synthetic_spread_flag(b)
    add_synthetic_hit_rate_flag(b, d)
    b.add_argument("--draft-stand-in", type=Path, metavar="TIMES_JSON",
                   default=d("draft_stand_in"),
                   help="BENCHMARKING ONLY, with --synthetic-acceptance-length: the draft "
                        "service runs no model and uses no GPU; each forward waits the time "
                        "measured by `python -m draft_service.stand_in` (the draft on a GPU "
                        "of its own, on a one-GPU machine; greedy requests only)")  # fmt: skip


def _placement_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray placement")
    d = partial(default_of, PlacementConfig)
    g.add_argument("--pairs", type=int, default=d("pairs"), help="draft/target pairs to run")
    g.add_argument("--address", default=d("address"),
                   help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")  # fmt: skip
    g.add_argument("--num-cpus", type=int, default=d("num_cpus"), help="local cluster only")
    g.add_argument("--num-gpus", type=int, default=d("num_gpus"), help="local cluster only")
    g.add_argument("--start-timeout-s", type=float, default=d("start_timeout_s"),
                   help="seconds the services may take to load and warm up")  # fmt: skip
    g.add_argument("--restart-timeout-s", type=float, default=d("restart_timeout_s"),
                   help="seconds a crashed service may take to come back")  # fmt: skip
    g.add_argument("--ray-start-timeout", dest="ray_start_timeout_s", type=float, metavar="S",
                   default=d("ray_start_timeout_s"),
                   help="local cluster only: its start-up is tried again (each failed attempt "
                        "stopped) until this deadline")  # fmt: skip
    g.add_argument("--draft-resources", metavar="JSON", default=d("draft_resources"),
                   help='custom Ray resources every draft bundle asks for, e.g. '
                        '{"draft_gpu": 1}: drafts go to the nodes that offer them')  # fmt: skip
    g.add_argument("--target-resources", metavar="JSON", default=d("target_resources"),
                   help='the same for every target bundle, e.g. {"target_gpu": 1}')  # fmt: skip


def _scheduler_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling and speculation defaults")
    d = partial(default_of, SchedulerConfig)
    g.add_argument("--max-queue", type=int, default=d("max_queue"),
                   help="requests that may wait while every pair is full")  # fmt: skip
    g.add_argument("--proposer", choices=PROPOSERS, default=None,
                   help="default proposer (default: draft with --draft, else ngram)")  # fmt: skip
    g.add_argument("-k", "--num-draft-tokens", dest="num_draft_tokens", type=int,
                   default=d("num_draft_tokens"), help="default draft tokens per step")  # fmt: skip


def _server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "client API server", "specdec.v1.GenerateService on --port, the OpenAI-compatible HTTP "
        "API on --http-port and /metrics on --metrics-port, all on --host. The stop (--drain-s, "
        "--grace-s) holds for gRPC and HTTP alike; while draining, HTTP /health answers 503."
    )  # fmt: skip
    d = partial(default_of, ServeConfig)
    add_listen_flags(g, d, port=d("port"))
    g.add_argument("--http-port", type=int, default=d("http_port"),
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "...); 0 picks a free port; off without it")  # fmt: skip
    g.add_argument("--metrics-port", type=int, default=d("metrics_port"),
                   help="Prometheus /metrics over HTTP; 0 picks a free port, -1 turns it "
                        "off")  # fmt: skip
    add_stop_flags(g, d)
    g.add_argument("--max-workers", type=int, default=d("max_workers"),
                   help="gRPC server threads (each streaming call holds one)")  # fmt: skip
    g.add_argument("--max-concurrent-calls", type=int, default=d("max_concurrent_calls"),
                   help="Generate/Complete calls held at once, queued ones included; more are "
                        "refused with RESOURCE_EXHAUSTED (at most --max-workers - 16)")  # fmt: skip
    g.add_argument("--max-request-bytes", type=int, default=d("max_request_bytes"),
                   help="largest request the client port takes (default: 128 bytes a token "
                        "of max_seq_len plus 64 KiB); larger: RESOURCE_EXHAUSTED")  # fmt: skip


def _tls_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "TLS", "PEM files; plaintext without them. --tls-* are the client ports', gRPC and HTTP "
        "alike. The --service-tls-* files are read by every service on its own node, so they "
        "must exist at the same path on every node."
    )  # fmt: skip
    ds = partial(default_of, ServiceConfig)
    add_tls_flags(g, partial(default_of, ServeConfig))
    pem = partial(g.add_argument, type=Path, metavar="FILE")
    pem("--service-tls-cert", default=ds("tls_cert"),
        help="certificate chain of the draft and target services' servers, every pair (with "
             "--service-tls-key and --service-tls-root-cert)")  # fmt: skip
    pem("--service-tls-key", default=ds("tls_key"), help="private key of --service-tls-cert")
    pem("--service-tls-root-cert", default=ds("tls_root_cert"),
        help="CA that the orchestrator -> target and target -> draft channels trust")  # fmt: skip
    g.add_argument("--service-tls-server-name", metavar="NAME", default=ds("tls_server_name"),
                   help="name those channels check in the services' certificate (default: "
                        "the node's IP address, which the services listen on)")  # fmt: skip
    pem("--service-tls-client-cert", default=ds("tls_client_cert"),
        help="certificate (chain) that the orchestrator and the targets present to the "
             "services, signed by --service-tls-root-cert: mutual TLS (with the key)")  # fmt: skip
    pem("--service-tls-client-key", default=ds("tls_client_key"),
        help="private key of --service-tls-client-cert")  # fmt: skip
    a = parser.add_argument_group(
        "API key", "Clients send the metadata 'authorization: Bearer KEY'; the health service "
        "and /metrics stay open."
    )  # fmt: skip
    a.add_argument("--api-key", metavar="KEY", default=None,
                   help="the key (visible in the process list: prefer --api-key-file)")  # fmt: skip
    a.add_argument("--api-key-file", metavar="FILE", type=Path, default=None,
                   help="a file holding the key, e.g. a mounted Kubernetes Secret")  # fmt: skip


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path,
                        help="TOML or JSON file whose keys are these flags' names")  # fmt: skip
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="INFO: this program's own lines; DEBUG adds Ray's and grpc "
                             "core's")  # fmt: skip
    for add in (_services_args, _placement_args, _scheduler_args, _server_args, _tls_args):
        add(parser)


def _json(flag: str, value: Any) -> Any:
    """A JSON flag's value: parsed here from the command line's text; from --config it comes
    parsed already (a TOML table, a JSON object). The config dataclass checks its shape."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be JSON; {value!r} is not ({e.msg}, at {e.pos}).") from None


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file are alternatives: give one of them.")
    if args.api_key_file is not None:
        return read_api_key_file(args.api_key_file)
    return args.api_key  # type: ignore[no-any-return]


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The config the parsed flags describe; ValueError names the bad field."""
    if not args.target:
        raise ValueError("--target DIR is required (a local checkpoint directory).")
    proposer: Any = args.proposer or ("draft" if args.draft else "ngram")
    return ServeConfig(
        services=ServiceConfig(
            target=args.target, draft=args.draft, device=args.device, dtype=args.dtype,
            max_requests=args.max_requests, max_seq_len=args.max_seq_len,
            max_num_draft_tokens=args.max_num_draft_tokens, q_form=args.q_form,
            support_size=args.support_size, sampler_impl=args.sampler_impl,
            cuda_graph_batch_sizes=tuple(args.cuda_graph_batch_sizes),
            target_tensor_parallel=args.target_tensor_parallel,
            kv_block_size=args.kv_block_size, kv_blocks=args.kv_blocks,
            prefix_caching=args.prefix_caching,
            draft_ahead=args.draft_ahead, draft_deadline_s=args.draft_deadline_ms / 1e3,
            draft_push_chains=args.draft_push_chains,
            draft_ahead_backup=args.draft_ahead_backup,
            draft_ahead_spread=args.draft_ahead_spread,
            dynamic_speculation=args.dynamic_speculation,
            prefill_chunk_tokens=args.prefill_chunk_tokens,
            synthetic_hit_rate=args.synthetic_hit_rate,
            synthetic_hit_rate_spread=args.synthetic_hit_rate_spread,
            synthetic_acceptance_spread=args.synthetic_acceptance_spread,
            draft_stand_in=args.draft_stand_in,
            saguaro_scale=args.saguaro_scale,
            # hypotheses for up to 8 requests at the served k
            draft_ahead_slots=args.draft_ahead * (args.num_draft_tokens + 1)
            * min(args.max_requests, 8),
            synthetic_acceptance_length=args.synthetic_acceptance_length,
            synthetic_num_draft_tokens=None if args.synthetic_acceptance_length is None
            else args.num_draft_tokens,
            tls_cert=args.service_tls_cert, tls_key=args.service_tls_key,
            tls_root_cert=args.service_tls_root_cert,
            tls_server_name=args.service_tls_server_name,
            tls_client_cert=args.service_tls_client_cert,
            tls_client_key=args.service_tls_client_key,
        ),
        placement=PlacementConfig(
            pairs=args.pairs, address=args.address, num_cpus=args.num_cpus,
            num_gpus=args.num_gpus, start_timeout_s=args.start_timeout_s,
            restart_timeout_s=args.restart_timeout_s, ray_start_timeout_s=args.ray_start_timeout_s,
            draft_resources=_json("--draft-resources", args.draft_resources),
            target_resources=_json("--target-resources", args.target_resources),
        ),
        scheduler=SchedulerConfig(
            max_queue=args.max_queue, proposer=proposer, num_draft_tokens=args.num_draft_tokens
        ),
        host=args.host, port=args.port, http_port=args.http_port,
        metrics_port=None if args.metrics_port is not None and args.metrics_port < 0
        else args.metrics_port,
        grace_s=args.grace_s, drain_s=args.drain_s, max_workers=args.max_workers,
        max_concurrent_calls=args.max_concurrent_calls, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        max_request_bytes=args.max_request_bytes, api_key=_api_key(args),
    )  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """The orchestrator runs in a child process of its own session (`orchestrator.launch.supervisor`
    says why); this process relays signals to it."""
    if not is_child():
        try:  # bad flags, checkpoints and ports are refused here, before any child or Ray
            check_before_ray(serve_config(args))
        except ValueError as e:
            print(f"{PROG} serve: {e}", file=sys.stderr)
            return 2
        return run_in_child(args.argv, args.log_level)
    follow_parent()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        config = serve_config(args)
    except ValueError as e:
        print(f"{PROG} serve: {e}", file=sys.stderr)
        return 2
    from orchestrator.server import Orchestrator  # Ray is imported only to serve

    orchestrator = Orchestrator(config)
    try:
        port = orchestrator.start()
    except (ValueError, RuntimeError) as e:
        print(f"{PROG} serve: {e}", file=sys.stderr)
        return 2

    def announce() -> None:
        print(f"{PROG}: serving {config.model_name} on {config.host}:{port}", flush=True)
        if orchestrator.http_url is not None:
            print(f"{PROG}: OpenAI-compatible HTTP API on {orchestrator.http_url}", flush=True)

    orchestrator.serve_until_signal(announce)
    if orchestrator.ray_stuck:  # Ray's exit handler would wait 60 s for its stopped GCS
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    return 0
