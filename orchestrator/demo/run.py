"""`specdec demo`: a real pair trained on this machine, served by `specdec serve`, queried.

Builds (once; cached, see `models`) a small Llama target and a smaller distilled draft on
the standard library's sources, starts the orchestrator in this process (a local Ray cluster,
the draft and target services as actors, the client API and /metrics on free loopback ports),
streams greedy completions of a few Python prompts through `specdec.client`, once with the
draft proposing k tokens per step and once with speculation off, and prints acceptance and
tokens/s for both, read from /metrics (differences of the counters around each run).
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from specdec.limits import MAX_NUM_DRAFT_TOKENS

# Each prompt ends where a line ends, before its newline: the tokenizer merges a newline with
# the next line's indentation, so a prompt ending in "\n" ends inside a token the model
# rarely saw end there, and its continuation loses the indentation.
PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
    "def read_config(filename):\n    with open(filename) as f:",
)
QUICK_PROMPTS = PROMPTS[:2]
# the counters the figures are read from, as /metrics names them
DRAFTS = "specdec:spec_decode_num_drafts_total"
DRAFT_TOKENS = "specdec:spec_decode_num_draft_tokens_total"
ACCEPTED = "specdec:spec_decode_num_accepted_tokens_total"
GENERATED = "specdec:generation_tokens_total"
LATENCY_SUM = "specdec:e2e_request_latency_seconds_sum"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (name, labels) -> value


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="a tiny pair trained in seconds, two prompts (CI)")
    add("-k", "--num-draft-tokens", dest="num_draft_tokens", type=int, default=4,
        help="draft tokens per step")  # fmt: skip
    add("--max-tokens", type=int, default=None, help="per completion (default: 96, --quick 24)")
    add("--cache-dir", type=Path, default=None, help="default: ~/.cache/specdec")
    add("--no-progress", action="store_true", help="no training progress bars")
    add("--serve", action="store_true", help="keep serving after the demo, until Ctrl-C")


@dataclass(frozen=True, slots=True)
class Figures:
    """One run's figures, from the difference of two /metrics scrapes."""

    proposer: str
    drafts: float
    draft_tokens: float
    accepted: float
    tokens: float
    seconds: float  # sum of the requests' end-to-end latencies (they ran one at a time)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def scrape(url: str) -> Samples:
    """Every sample of a /metrics page by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def figures_between(before: Samples, after: Samples, proposer: str) -> Figures:
    def total(samples: Samples, name: str, labels: set[tuple[str, str]]) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and labels <= ls)

    def delta(name: str, **labels: str) -> float:
        want = set(labels.items())
        return total(after, name, want) - total(before, name, want)

    return Figures(
        proposer,
        delta(DRAFTS, proposer=proposer),
        delta(DRAFT_TOKENS, proposer=proposer),
        delta(ACCEPTED, proposer=proposer),
        delta(GENERATED),
        delta(LATENCY_SUM),
    )


@dataclass(frozen=True, slots=True)
class DemoRun:
    """One proposer's run: its figures (from /metrics), and what the client received."""

    figures: Figures
    texts: tuple[str, ...]
    usages: tuple[Any, ...]  # specdec.client.Usage of each request


def stream_prompts(
    address: str, prompts: tuple[str, ...], proposer: str, args: argparse.Namespace, out: TextIO
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """Streams each prompt's greedy completion to `out`; returns the texts and usages."""
    from specdec.client import Client

    texts, usages = [], []
    with Client(address, timeout=300.0) as client:
        for prompt in prompts:
            out.write(f"\n--- {proposer} ---\n{prompt}")
            text = ""
            for piece in client.generate(
                prompt,
                max_tokens=args.max_tokens or (24 if args.quick else 96),
                temperature=0.0,
                proposer=proposer,
                num_draft_tokens=args.num_draft_tokens if proposer == "draft" else None,
            ):
                out.write(piece.text)
                out.flush()
                text += piece.text
                if piece.usage is not None:
                    usages.append(piece.usage)
            texts.append(text)
            out.write("\n")
    return tuple(texts), tuple(usages)


def report(runs: list[Figures], metrics_url: str, k: int, out: TextIO) -> None:
    out.write(
        f"\n{'proposer':<10}{'acceptance rate':>17}{'mean acc. length':>18}{'tokens/s':>10}\n"
    )
    for f in runs:
        rate = "-" if f.acceptance_rate is None else f"{f.acceptance_rate:.3f}"
        length = "-" if f.mean_acceptance_length is None else f"{f.mean_acceptance_length:.3f}"
        out.write(f"{f.proposer:<10}{rate:>17}{length:>18}{f.tokens_per_s:>10.1f}\n")
    out.write(
        f"greedy, k = {k}; tokens/s = generated tokens / summed request latency; "
        f"figures read from {metrics_url}\n"
    )


def describe(pair: Any, budget: Any) -> str:
    """One line per model: what it is and how it was trained (from the build's record)."""
    t, d = pair.training["target"], pair.training["draft"]
    shape = {name: getattr(budget, name) for name in ("target", "draft")}
    return (
        f"models in {pair.root} (trained on this machine on the standard library's sources, "
        f"in {pair.training['total_seconds']:.0f} s):\n"
        f"  target: Llama, {shape['target'].layers} layers x {shape['target'].hidden}, "
        f"{t['parameters'] / 1e6:.2f} M parameters, {t['steps']} steps in {t['seconds']:.0f} s, "
        f"loss {t['final_loss']:.2f}\n"
        f"  draft:  Llama, {shape['draft'].layers} layer(s) x {shape['draft'].hidden}, "
        f"{d['parameters'] / 1e6:.2f} M parameters, distilled from the target, "
        f"{d['steps']} steps in {d['seconds']:.0f} s\n"
    )


def serve_config(pair: Any, k: int) -> Any:
    """The pair on CPU, the client API and /metrics on free loopback ports."""
    from orchestrator.config import PlacementConfig, SchedulerConfig, ServeConfig, ServiceConfig

    return ServeConfig(
        services=ServiceConfig(
            target=str(pair.target), draft=str(pair.draft), device="cpu", max_requests=2,
            max_num_draft_tokens=max(k, 1),
        ),
        placement=PlacementConfig(num_gpus=0),
        scheduler=SchedulerConfig(proposer="draft", num_draft_tokens=k),
        host="127.0.0.1", port=0, metrics_port=0, grace_s=1.0,
    )  # fmt: skip


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> list[DemoRun]:
    """The whole demo; returns each proposer's run (the figures it printed among them)."""
    from orchestrator.demo.models import DemoBudget, build_demo_models
    from orchestrator.server import Orchestrator

    if not 1 <= args.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
        k, top = args.num_draft_tokens, MAX_NUM_DRAFT_TOKENS
        raise ValueError(f"--num-draft-tokens must be in [1, {top}], got {k}.")
    if args.max_tokens is not None and not 1 <= args.max_tokens <= 100:
        raise ValueError(f"--max-tokens must be in [1, 100], got {args.max_tokens}.")
    budget = DemoBudget.ci() if args.quick else DemoBudget()
    pair = build_demo_models(args.cache_dir, budget=budget, progress=not args.no_progress)
    out.write(describe(pair, budget))
    prompts = QUICK_PROMPTS if args.quick else PROMPTS
    orchestrator = Orchestrator(serve_config(pair, args.num_draft_tokens))
    try:
        address = f"127.0.0.1:{orchestrator.start()}"
        url = f"http://127.0.0.1:{orchestrator.metrics_port}/metrics"
        runs = []
        for proposer in ("draft", "off"):
            before = scrape(url)
            texts, usages = stream_prompts(address, prompts, proposer, args, out)
            runs.append(DemoRun(figures_between(before, scrape(url), proposer), texts, usages))
        report([r.figures for r in runs], url, args.num_draft_tokens, out)
        if args.serve:
            orchestrator.serve_until_signal(lambda: out.write(
                f"serving until Ctrl-C: the client API on {address}, metrics at {url}\n"
            ))  # fmt: skip
    finally:
        orchestrator.stop(1.0)
    return runs


def run_demo(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    try:
        run(args)
    except ValueError as e:
        print(f"specdec demo: {e}", file=sys.stderr)
        return 2
    return 0
