"""python -m target_service --model DIR [--draft-address HOST:PORT] [--port 50052] ..."""

from __future__ import annotations

import argparse
import sys

from specdec.serving.cli import (
    add_runner_args,
    add_server_args,
    runner_config,
    serve,
    server_config,
)
from target_service.config import TargetConfig
from target_service.server import start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_server_args(parser, default_port=50052)
    add_runner_args(parser)
    parser.add_argument("--max-num-draft-tokens", type=int, default=16)
    parser.add_argument("--draft-address", help="check this draft's tokenizer at start-up")
    args = parser.parse_args(argv)
    return serve(
        "target_service",
        lambda: start(
            TargetConfig(
                runner=runner_config(args),
                server=server_config(args),
                max_num_draft_tokens=args.max_num_draft_tokens,
                draft_address=args.draft_address,
            )
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
