"""python -m draft_service --model DIR [--q-form sparse --support-size 32] [--port 50051]
python -m draft_service --proposer ngram --tokenizer DIR [--ngram-min 1 --ngram-max 4]"""

from __future__ import annotations

import argparse
import sys

from draft_service.config import DraftConfig
from draft_service.ngram import NgramConfig
from draft_service.server import start
from specdec.serving.cli import (
    add_runner_args,
    add_server_args,
    runner_config,
    serve,
    server_config,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__)
    add_server_args(parser, default_port=50051)
    add_runner_args(parser, required=False)
    parser.add_argument("--proposer", choices=["model", "ngram"], default="model")
    parser.add_argument("--tokenizer", help="tokenizer directory (n-gram proposer)")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--q-form", choices=["dense", "sparse"], default="sparse")
    parser.add_argument("--support-size", type=int, default=32)
    parser.add_argument("--max-num-draft-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    return serve(
        "draft_service",
        lambda: start(
            DraftConfig(
                proposer=args.proposer,
                runner=runner_config(args) if args.model else None,
                tokenizer_path=args.tokenizer,
                ngram=NgramConfig(args.ngram_min, args.ngram_max),
                q_form=args.q_form,
                support_size=args.support_size,
                max_num_draft_tokens=args.max_num_draft_tokens,
                server=server_config(args),
            )
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
