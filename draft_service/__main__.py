"""python -m draft_service --model DIR [--q-form sparse --support-size 32] [--port 50051]
python -m draft_service --proposer ngram --tokenizer DIR [--ngram-min 1 --ngram-max 4]"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from draft_service.config import DraftConfig
from draft_service.server import start
from specdec.serving.cli import (
    add_runner_args,
    add_server_args,
    default_of,
    runner_config,
    serve,
    server_config,
)
from specdec.serving.flags import (
    add_draft_flags,
    add_k_limit_flag,
    add_prefill_chunk_flag,
    add_synthetic_hit_rate_flag,
)
from specdec.serving.ngram import NgramConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__)
    d = partial(default_of, DraftConfig)
    add_server_args(parser, default_port=50051)
    add_runner_args(parser, required=False)
    parser.add_argument("--proposer", choices=["model", "ngram"], default=d("proposer"))
    parser.add_argument("--tokenizer", help="tokenizer directory (n-gram proposer)")
    parser.add_argument("--ngram-min", type=int, default=default_of(NgramConfig, "min_n"))
    parser.add_argument("--ngram-max", type=int, default=default_of(NgramConfig, "max_n"))
    add_k_limit_flag(parser, d)
    add_prefill_chunk_flag(parser, d)
    parser.add_argument("--max-requests", type=int, default=d("max_requests"), help="n-gram only")
    add_draft_flags(parser, d)
    parser.add_argument("--draft-ahead-slots", type=int, default=d("draft_ahead_slots"),
                        help="of --max-slots, the KV slots kept for draft-ahead")  # fmt: skip
    add_synthetic_hit_rate_flag(parser, d)
    parser.add_argument("--stand-in", metavar="TIMES_JSON", default=d("stand_in"),
                        help="BENCHMARKING ONLY: no model and no GPU; each forward waits the "
                             "time measured by `python -m draft_service.stand_in` (greedy "
                             "requests only, with the target's synthetic acceptance)")  # fmt: skip
    return parser


def draft_config(args: argparse.Namespace) -> DraftConfig:
    return DraftConfig(
        proposer=args.proposer,
        runner=runner_config(args) if args.model else None,
        tokenizer_path=args.tokenizer,
        ngram=NgramConfig(args.ngram_min, args.ngram_max),
        q_form=args.q_form,
        support_size=args.support_size,
        max_num_draft_tokens=args.max_num_draft_tokens,
        max_requests=args.max_requests,
        draft_ahead=args.draft_ahead,
        draft_ahead_slots=args.draft_ahead_slots,
        draft_ahead_backup=args.draft_ahead_backup,
        draft_ahead_spread=args.draft_ahead_spread,
        saguaro_scale=args.saguaro_scale,
        synthetic_hit_rate=args.synthetic_hit_rate,
        synthetic_hit_rate_spread=args.synthetic_hit_rate_spread,
        stand_in=args.stand_in,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        server=server_config(args),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve("draft_service", lambda: start(draft_config(args)))


if __name__ == "__main__":
    sys.exit(main())
