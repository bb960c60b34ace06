"""python -m target_service --model DIR [--draft-address HOST:PORT] [--port 50052] ..."""

from __future__ import annotations

import argparse
import logging
import sys

from specdec.errors import SpecdecError
from specdec.serving.cli import add_runner_args, add_server_args, runner_config, server_config
from target_service.config import TargetConfig
from target_service.server import start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_server_args(parser, default_port=50052)
    add_runner_args(parser)
    parser.add_argument("--max-num-draft-tokens", type=int, default=16)
    parser.add_argument("--draft-address", help="check this draft's tokenizer at start-up")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = TargetConfig(
            runner=runner_config(args),
            server=server_config(args),
            max_num_draft_tokens=args.max_num_draft_tokens,
            draft_address=args.draft_address,
        )
        server, _ = start(config)
    except (ValueError, SpecdecError) as e:
        print(f"target_service: {e}", file=sys.stderr)
        return 2
    server.serve_until_signal()
    return 0


if __name__ == "__main__":
    sys.exit(main())
