"""One oversized request against a real `specdec serve` (its own process, a local Ray cluster on
CPU) while 32 streams run: an over-long text is refused before tokenising in at most 100 ms, a
20 MB message is refused unparsed well inside the old 30 s stall (at most 2 s here; measured
100-250 ms, BENCHMARKS.md has the figures against the 100 ms goal), the streams' p99 time per
token stays within 5x of a run without it (the goal, 1.5x, is measured and reported in
BENCHMARKS.md; this bound catches the old stall), and the server's peak RSS grows by at most
100 MiB.
Before the limits a 20 MB text prompt was tokenised in full holding the GIL: every stream
stalled for ~30 s and the server went from 341 MiB to 4.45 GiB.

The oversized requests are sent from a process of their own, so that building them does not
stall this process's clients and their timestamps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specdec.message_limits import max_prompt_chars, request_bytes
from specdec.pb.specdec.v1 import generate_pb2 as pb
from specdec.pb.specdec.v1 import generate_pb2_grpc
from tests.draft_service.models import build_checkpoints

MAX_SEQ_LEN = 256
STREAMS = 32
TOKENS = 40
ROOT = Path(__file__).resolve().parents[2]
SENDER = """
import json, sys, time, grpc
from specdec.pb.specdec.v1 import generate_pb2 as pb, generate_pb2_grpc
address, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
line = "def f(x): return x\\n"
requests = [pb.GenerateRequest(text=(line * (n // len(line) + 1))[:n], max_tokens=4) for n in sizes]
with grpc.insecure_channel(address) as channel:
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    print("ready", flush=True)
    sys.stdin.readline()
    out = []
    for request in requests:
        start = time.perf_counter()
        try:
            stub.Complete(request, timeout=60)
            code, details = "OK", ""
        except grpc.RpcError as e:
            code, details = e.code().name, e.details()
        out.append([code, details, time.perf_counter() - start])
print(json.dumps(out), flush=True)
"""


@dataclass
class Serve:
    process: subprocess.Popen[str]
    address: str


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("limits"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "orchestrator", "serve", "--target", str(target), "--draft",
        str(draft), "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len",
        str(MAX_SEQ_LEN), "--max-requests", str(STREAMS), "-k", "3", "--host", "127.0.0.1",
        "--port", "0", "--metrics-port", "-1", "--num-cpus", "4", "--grace-s", "1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()  # "specdec: serving NAME on HOST:PORT" once warm
    match = re.search(r"serving \S+ on (\S+)$", line.strip())
    try:
        assert match, f"specdec serve did not come up: {line!r}"
        yield Serve(process, match.group(1))
    finally:
        process.terminate()
        process.wait(60)


def orchestrator_pid(pid: int) -> int:
    """`specdec serve` runs the orchestrator in its one child process
    (`orchestrator.launch.supervisor`)."""
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match
    return int(match.group(1)) / 1024


def per_token_times(address: str, streams: int = STREAMS) -> list[float]:
    """Each streamed response's gap since the stream's last one, divided by its tokens."""
    times: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5 + i % 7, 6, 7, 8]), max_tokens=TOKENS, ignore_eos=True,
            temperature=0.0,
        )  # fmt: skip
        mine, last = [], None
        try:
            with grpc.insecure_channel(address) as channel:
                for r in generate_pb2_grpc.GenerateServiceStub(channel).Generate(request):
                    now = time.perf_counter()
                    if last is not None and r.token_ids:
                        mine.append((now - last) / len(r.token_ids))
                    last = now
        except BaseException as e:
            errors.append(e)
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]
    return times


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Sender:
    """A process of its own, connected and holding its requests (text of `sizes` characters)
    before `send` asks it to send them one after the other."""

    def __init__(self, address: str, sizes: list[int]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", SENDER, address, *map(str, sizes)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert self._process.stdout is not None
        assert self._process.stdout.readline().strip() == "ready"

    def send(self) -> list[tuple[str, str, float]]:
        out, _ = self._process.communicate("go\n", timeout=120)
        return [tuple(r) for r in json.loads(out.strip().splitlines()[-1])]  # type: ignore[misc]


def measured(address: str, hostile: Sender | None) -> tuple[float, list[tuple[str, str, float]]]:
    """The p99 time per token of STREAMS streams, and the refusals of `hostile`'s requests sent
    0.5 s after the streams started."""
    refusals: list[tuple[str, str, float]] = []

    def send() -> None:
        assert hostile is not None
        time.sleep(0.5)
        refusals.extend(hostile.send())

    sender = threading.Thread(target=send) if hostile is not None else None
    if sender is not None:
        sender.start()
    p = p99(per_token_times(address))
    if sender is not None:
        sender.join(300)
    return p, refusals


@pytest.mark.slow  # a timing measurement of the whole system: run on a machine of its own
def test_oversized_prompts_are_refused_fast_and_cost_the_others_nothing(serve: Serve) -> None:
    per_token_times(serve.address, 4)  # warm: first-call costs stay out of the baseline
    sizes = [20 * 1024 * 1024, max_prompt_chars(MAX_SEQ_LEN) + 1]  # 20 MB; 1 over the chars
    baselines, loaded, refusals = [], [], []
    peak_before = peak_rss_mib(orchestrator_pid(serve.process.pid))
    for _ in range(2):  # alternated, so that the machine's other load falls on both
        baselines.append(measured(serve.address, None)[0])
        p, refused = measured(serve.address, Sender(serve.address, sizes))
        loaded.append(p)
        refusals += refused
    growth = peak_rss_mib(orchestrator_pid(serve.process.pid)) - peak_before
    print(f"p99 s/token without {baselines}, with the oversized requests {loaded}; refusals "
          f"{refusals}; peak RSS growth {growth:.1f} MiB")  # fmt: skip
    for code, details, seconds in refusals[1::2]:  # read, refused before tokenising
        assert code == "INVALID_ARGUMENT"
        assert "prompt text must be at most 8192 characters" in details
        assert seconds <= 0.1
    # the 1.5x goal is a benchmark figure (BENCHMARKS.md), not asserted: on a 2-core machine the
    # runs without the requests alone vary 2x, and one CI run measured 1.9x. This bound catches a
    # return of the stall (every stream held ~30 s: about 100x the p99 of 0.1-0.45 s)
    assert sum(loaded) <= 5 * sum(baselines)
    assert growth <= 100
    for code, details, _ in refusals[0::2]:  # 20 MB: gRPC refuses it unparsed
        assert code == "RESOURCE_EXHAUSTED" and str(request_bytes(MAX_SEQ_LEN)) in details
    # grpc core decides within 2 ms of the message's arrival (GRPC_TRACE=http) but writes the
    # status some 100-200 ms later on this machine, so the 100 ms goal is not met yet: that
    # figure is measured and reported (BENCHMARKS.md), not asserted; this bound catches a return
    # of the stall (the whole message read or tokenised: 30 s before the limits)
    assert max(seconds for _, _, seconds in refusals[0::2]) <= 2.0
