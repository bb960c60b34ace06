"""What the OpenAI-compatible HTTP API costs per streamed token, against the gRPC API of the same
`specdec serve` (one in-process orchestrator, both ports).

    PYTHONPATH=. python bench/http_overhead.py --out bench/results/http_overhead_cpu.md

The tiny test checkpoints (tests/draft_service/models.py) on CPU: one verify step is cheap, so
the API's share of each token is as visible as it gets. Greedy requests, `ignore_eos`,
proposer off (one token per step, so one streamed event per token), one request at a time; each
prompt goes through gRPC (`specdec.client.Client.generate`) and HTTP (the `openai` client,
`stream=True`) in turn, after one warm-up request each. Per request, time per streamed
token = (t_last - t_first) / (tokens - 1) as the client sees it; the table gives the median
and p99 over requests, and the inter-token gaps' median and p99 over all tokens.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai

from orchestrator.config import PlacementConfig, SchedulerConfig, ServeConfig, ServiceConfig
from orchestrator.server import Orchestrator
from specdec.client import Client
from tests.draft_service.models import build_checkpoints

Stream = Callable[[list[int], int], Iterator[str]]


def _grpc(client: Client) -> Stream:
    def stream(prompt: list[int], n: int) -> Iterator[str]:
        for out in client.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True,
                                   proposer="off"):  # fmt: skip
            yield out.text

    return stream


def _http(client: openai.OpenAI, model: str) -> Stream:
    def stream(prompt: list[int], n: int) -> Iterator[str]:
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "speculation": {"proposer": "off"}},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices:
                yield chunk.choices[0].text

    return stream


def timed(stream: Stream, prompt: list[int], n: int) -> tuple[str, list[float]]:
    """The text and the arrival time of every streamed event carrying text."""
    text, times = "", []
    for delta in stream(prompt, n):
        if delta:
            times.append(time.perf_counter())
            text += delta
    return text, times


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _row(name: str, runs: list[list[float]]) -> str:
    per_token = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in runs]
    gaps = [(b - a) * 1e3 for t in runs for a, b in itertools.pairwise(t)]
    return (
        f"| {name} | {len(runs)} | {len(gaps) + len(runs)} | {statistics.median(per_token):.3f} "
        f"| {_p99(per_token):.3f} | {statistics.median(gaps):.3f} | {_p99(gaps):.3f} |"
    )


def _machine() -> str:
    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if names:
        model = names[0]
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({model})"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def measure(orchestrator: Orchestrator, prompts: list[list[int]], n: int, repeats: int) -> str:
    """The markdown table of both APIs over the same prompts."""
    model = orchestrator.config.model_name
    url = f"http://127.0.0.1:{orchestrator.http_port}/v1"
    http_client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with Client(f"127.0.0.1:{orchestrator.port}", timeout=300) as grpc_client, http_client:
        apis = {"gRPC (specdec.client)": _grpc(grpc_client),
                "HTTP (openai, SSE)": _http(http_client, model)}  # fmt: skip
        runs: dict[str, list[list[float]]] = {name: [] for name in apis}
        for stream in apis.values():
            timed(stream, prompts[0], n)  # warm-up
        for r in range(repeats):
            order = list(apis.items())[:: -1 if r % 2 else 1]  # neither API always goes first
            for prompt in prompts:
                texts = set()
                for name, stream in order:
                    text, times = timed(stream, prompt, n)
                    runs[name].append(times)
                    texts.add(text)
                assert len(texts) == 1, "both APIs stream the same greedy text"
    header = (
        "| API | requests | streamed events | median ms/token (per request) | p99 ms/token | "
        "median inter-token gap ms | p99 gap ms |\n|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *(_row(name, r) for name, r in runs.items())])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="markdown file to write the table to")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    args = parser.parse_args()
    prompts = [[5 + i, 6 + i, 7 + i, 8 + 2 * i] for i in range(8)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_checkpoints(Path(tmp))
        config = ServeConfig(
            ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=256,
                          sampler_impl="torch"),
            PlacementConfig(num_cpus=4), SchedulerConfig(proposer="off"),
            host="127.0.0.1", port=0, metrics_port=None, http_port=0, grace_s=1.0,
        )  # fmt: skip
        orchestrator = Orchestrator(config)
        orchestrator.start()
        try:
            table = measure(orchestrator, prompts, args.max_tokens, args.repeats)
        finally:
            orchestrator.stop(1.0)
    report = (
        f"# HTTP API overhead per streamed token\n\n`bench/http_overhead.py` at commit "
        f"{_commit()} on a {_machine()}: the tiny test checkpoints on CPU, greedy, proposer off "
        f"(one token per step and event), {len(prompts)} prompts x {args.repeats} passes, "
        f"{args.max_tokens} tokens each, one request at a time, both APIs on the same server "
        f"(alternating which goes first). Load average (1 min) {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after: the machine is shared.\n\n{table}\n"
    )
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
