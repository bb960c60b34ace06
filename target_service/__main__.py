"""python -m target_service --model DIR [--draft-address HOST:PORT] [--port 50052] ..."""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from pathlib import Path

from specdec.serving.cli import (
    add_runner_args,
    add_server_args,
    default_of,
    runner_config,
    serve,
    server_config,
)
from specdec.serving.flags import (
    add_k_limit_flag,
    add_prefill_chunk_flag,
    add_synthetic_length_flag,
    add_synthetic_spread_flag,
    add_target_flags,
)
from target_service.config import TargetConfig
from target_service.server import start
from target_service.synthetic import SyntheticAcceptance

log = logging.getLogger("target_service")
BENCHMARK_ONLY = "BENCHMARKING ONLY: output is NOT distributed as the target's."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    d = partial(default_of, TargetConfig)
    add_server_args(parser, default_port=50052)
    add_runner_args(parser)
    add_k_limit_flag(parser, d)
    add_prefill_chunk_flag(parser, d)
    parser.add_argument(
        "--max-support-size",
        type=int,
        default=d("max_support_size"),
        help="largest sparse-q support (ids per draft token) accepted",
    )
    parser.add_argument("--draft-address", help="check this draft's tokenizer at start-up")
    parser.add_argument(
        "--draft-wait-s",
        type=float,
        default=d("draft_wait_s"),
        help="how long to wait for the draft at --draft-address",
    )
    parser.add_argument(
        "--draft-tls-root-cert",
        type=Path,
        default=d("draft_tls_root_cert"),
        help="PEM CA the draft's certificate must chain to: TLS to the draft",
    )
    parser.add_argument(
        "--draft-tls-server-name",
        default=d("draft_tls_server_name"),
        help="the name the draft's certificate must carry (default: the address's host)",
    )
    for part in ("cert", "key"):
        parser.add_argument(
            f"--draft-tls-client-{part}",
            type=Path,
            default=d(f"draft_tls_client_{part}"),
            help=f"PEM client {part} presented to a draft that requires one (mutual TLS)",
        )
    add_target_flags(parser, d)
    g = parser.add_argument_group(
        "synthetic acceptance", f"{BENCHMARK_ONLY} Their k is --synthetic-num-draft-tokens."
    )
    rates = g.add_mutually_exclusive_group()
    add_synthetic_length_flag(rates)  # for k = --synthetic-num-draft-tokens
    rates.add_argument(
        "--synthetic-rates",
        metavar="R1,R2,...",
        help=f"per-position acceptance rates, non-increasing. {BENCHMARK_ONLY}",
    )
    add_synthetic_spread_flag(g)
    g.add_argument(
        "--synthetic-num-draft-tokens",
        type=int,
        metavar="K",
        help="number of draft tokens the rates apply to (default: the number of --synthetic-rates)",
    )
    return parser


def synthetic(args: argparse.Namespace) -> SyntheticAcceptance | None:
    """The synthetic acceptance the flags ask for, or None; ValueError if they are incomplete."""
    length, k = args.synthetic_acceptance_length, args.synthetic_num_draft_tokens
    if args.synthetic_rates is not None:
        try:
            rates = tuple(float(r) for r in args.synthetic_rates.split(","))
        except ValueError as exc:
            raise ValueError(
                f"--synthetic-rates must be comma-separated numbers, got {args.synthetic_rates!r}."
            ) from exc
        if args.synthetic_acceptance_spread:
            raise ValueError(
                "--synthetic-acceptance-spread spreads --synthetic-acceptance-length; it does "
                "not apply to --synthetic-rates."
            )
        return SyntheticAcceptance(len(rates) if k is None else k, rates=rates)
    if length is not None:
        if k is None:
            raise ValueError(
                "--synthetic-acceptance-length needs --synthetic-num-draft-tokens (the k it "
                "applies to)."
            )
        return SyntheticAcceptance(
            k, mean_acceptance_length=length, length_spread=args.synthetic_acceptance_spread
        )
    if args.synthetic_acceptance_spread:
        raise ValueError("--synthetic-acceptance-spread needs --synthetic-acceptance-length.")
    if k is not None:
        raise ValueError(
            "--synthetic-num-draft-tokens needs --synthetic-acceptance-length or --synthetic-rates."
        )
    return None


def target_config(args: argparse.Namespace) -> TargetConfig:
    config = TargetConfig(
        runner=runner_config(args),
        server=server_config(args),
        max_num_draft_tokens=args.max_num_draft_tokens,
        max_support_size=args.max_support_size,
        draft_address=args.draft_address,
        draft_wait_s=args.draft_wait_s,
        draft_deadline_s=args.draft_deadline_ms / 1e3,
        draft_push_chains=args.draft_push_chains,
        draft_tls_root_cert=args.draft_tls_root_cert,
        draft_tls_server_name=args.draft_tls_server_name,
        draft_tls_client_cert=args.draft_tls_client_cert,
        draft_tls_client_key=args.draft_tls_client_key,
        sampler_impl=args.sampler_impl,
        synthetic=synthetic(args),
        dynamic_speculation=args.dynamic_speculation,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )
    if config.synthetic is not None:
        log.warning(
            "synthetic acceptance is on (rates %s for k = %d): %s",
            config.synthetic.unconditional_rates(),
            config.synthetic.num_draft_tokens,
            BENCHMARK_ONLY,
        )
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve("target_service", lambda: start(target_config(args)))


if __name__ == "__main__":
    sys.exit(main())
