"""The `specdec` command: `serve` (the orchestrator, `orchestrator.cli.serve`), `generate` (a
client), `demo`.

    specdec serve --target DIR --draft DIR [-k 4] [--pairs 1] [--port 50050] [--http-port 8000]
    specdec serve --config serve.toml          # keys are the flags' names
    specdec generate "def fibonacci(" --address localhost:50050
    specdec demo

`python -m orchestrator` is the same command. A flag given on the command line wins over the
same key in --config.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.cli.generate import add_generate_args, run_generate
from orchestrator.cli.serve import PROG, add_serve_args, run_serve
from orchestrator.demo.run import add_demo_args, run_demo


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def version() -> str:
    """The installed package's version (its metadata), or "unknown" when run from a tree."""
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def read_config_file(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's keys as argparse destinations; ValueError for an unknown key."""
    text = path.read_text()
    raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a table (TOML) or an object (JSON).")
    known = {a.dest for a in parser._actions} - {"help", "config", "func"}
    out = {}
    for key, value in raw.items():
        dest = "num_draft_tokens" if key == "k" else key.replace("-", "_")
        if dest not in known:
            raise ValueError(f"{path}: unknown key {key!r}; keys are the flags' names.")
        out[dest] = value
    return out


Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]


def _commands() -> list[Command]:
    return [
        ("serve", "run the orchestrator and its services", add_serve_args, run_serve),
        ("generate", "stream a completion from a running server", add_generate_args,
         run_generate),
        ("demo", "train or load a tiny pair, serve it, query it", add_demo_args, run_demo),
    ]  # fmt: skip


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `specdec` parser and its subcommands' parsers by name."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Exact speculative decoding: draft and target services on separate GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name, help_text, add, run in _commands():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)  # fmt: skip
        add(p)
        p.set_defaults(func=run)
        commands[name] = p
    return parser, commands


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses twice when --config is given: its keys become defaults that flags override."""
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    sub = commands[args.command]
    try:
        sub.set_defaults(**read_config_file(args.config, sub))
    except (OSError, ValueError) as e:
        sub.error(str(e))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
