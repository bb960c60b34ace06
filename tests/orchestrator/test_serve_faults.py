"""Faults of `specdec serve` on real processes: both services in Ray actor processes on CPU, tiny
local checkpoints, greedy requests streamed over the client API.

- A draft that stalls (SIGSTOP of its process): past the hub's deadline each step goes on at
  k = 0, requests keep streaming, and once the process runs again (SIGCONT) speculation resumes
  by itself, with no restart; greedy output equals target-only greedy throughout.
- The orchestrator's Serve stream to the target breaking mid-generation: the orchestrator opens
  it again and admits its requests from its records; they finish with the same greedy tokens.
- SIGKILL of the `specdec serve` process itself: the service processes and the Ray cluster it
  started (raylet, gcs_server, workers) are gone within a bounded time.

The counters of specdec:draft_fallback_*, specdec:serve_reconnects_total move accordingly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray

from orchestrator.launch.ray_start import descendants
from specdec.pb.specdec.v1 import generate_pb2_grpc
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.test_serve import (
    PROMPTS,
    Stack,
    eventually,
    oracle,
    request,
    serve_stack,
)

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 0.3  # the served default of --draft-deadline-ms
NUM_TOKENS = 120


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("faults"))
    with serve_stack(target, draft, 8, 16, draft_deadline_s=DEADLINE_S) as s:
        yield s


def state(pid: int) -> str:
    """The process's state letter (R, S, T for stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def counter(stack: Stack, name: str, **labels: str) -> float:
    return sum(
        value
        for (n, ls), value in stack.metrics().items()
        if n == f"specdec:{name}" and all((k, v) in ls for k, v in labels.items())
    )


class Streams:
    """Workers streaming greedy requests back to back until `stop`; every finished request is
    kept with the arrival time of each of its responses."""

    def __init__(self, stack: Stack, prompt: list[int], workers: int):
        self.stack, self.prompt = stack, prompt
        self.done: list[tuple[list[int], list[Any]]] = []
        self.arrivals: list[float] = []  # every response's, all workers
        self.errors: list[BaseException] = []
        self.current = [0] * workers  # tokens of each worker's request in flight
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,)) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self, worker: int) -> None:
        while not self._stop.is_set():
            tokens: list[int] = []
            steps: list[Any] = []
            try:
                for r in self.stack.stub.Generate(request(self.prompt, NUM_TOKENS, "draft", 3)):
                    self.arrivals.append(time.monotonic())
                    tokens += r.token_ids
                    steps += r.steps
                    self.current[worker] = len(tokens)
            except BaseException as e:
                self.errors.append(e)
                return
            self.done.append((tokens, steps))

    def tokens_since(self, t: float) -> int:
        return sum(1 for a in self.arrivals if a >= t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def spans(ks: list[int]) -> bool:
    """Drafting, then target-only, then drafting again, in one request's steps."""
    if 0 not in ks[1:]:
        return False
    first_zero = ks.index(0, 1)
    return any(ks[1:first_zero]) and any(ks[first_zero:])


def test_stalled_draft_falls_back_then_resumes(stack: Stack) -> None:
    """SIGSTOP the draft's process mid-generation: after one step's deadline requests go on at
    k = 0 (the deadline counter moves, draft_up stays 1: nothing restarts); SIGCONT: the hub
    resynchronises the draft and speculation resumes inside requests that span the stall.
    Every request's greedy output equals target-only greedy decoding."""
    prompt = list(PROMPTS[0])
    expected = oracle(stack.target_dir, tuple(prompt), NUM_TOKENS)
    pair = stack.orchestrator.placement.pairs[0]
    draft_pid = ray.get(pair.draft.pid.remote(), timeout=30)
    deadline_steps = counter(stack, "draft_fallback_steps_total", reason="deadline")
    streams = Streams(stack, prompt, workers=3)
    try:
        # every worker mid-request, so that its request spans the stall
        eventually(lambda: all(20 <= n <= NUM_TOKENS // 2 for n in streams.current), 120)
        stopped_at = time.monotonic()
        os.kill(draft_pid, signal.SIGSTOP)
        try:
            eventually(lambda: state(draft_pid) == "T", 10)
            eventually(
                lambda: (
                    counter(stack, "draft_fallback_steps_total", reason="deadline") > deadline_steps
                ),
                30,
            )
            fell_back_s = time.monotonic() - stopped_at
            mark = time.monotonic()
            eventually(lambda: streams.tokens_since(mark) >= 30, 60)  # progress while stopped
            progress_s = time.monotonic() - mark
            assert counter(stack, "draft_up") == 1, "a stalled draft is not taken for down"
        finally:
            os.kill(draft_pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        drafts = counter(stack, "spec_decode_num_drafts_total", proposer="draft")
        eventually(
            lambda: counter(stack, "spec_decode_num_drafts_total", proposer="draft") > drafts, 60
        )
        resume_s = time.monotonic() - resumed_at
        stalled = counter(stack, "draft_fallback_steps_total", reason="deadline")
        steps_then = counter(stack, "steps_total")
        finished = len(streams.done)
        eventually(lambda: bool(streams.errors) or len(streams.done) >= finished + 6, 120)
        assert not streams.errors, streams.errors
        ks = [[s.num_draft_tokens for s in st] for _, st in streams.done]
        assert any(spans(k) for k in ks), ks
        # a loaded 2-core machine may delay the draft past the deadline now and then
        late = counter(stack, "draft_fallback_steps_total", reason="deadline") - stalled
        assert late <= 0.1 * (counter(stack, "steps_total") - steps_then), "speculation resumed"
    finally:
        streams.stop()
    assert not streams.errors, streams.errors
    assert streams.done and all(tokens == expected for tokens, _ in streams.done)
    for _, steps in streams.done:
        assert [s.step for s in steps] == list(range(len(steps))), "no step lost or repeated"
    assert counter(stack, "draft_fallback_requests_total", reason="deadline") >= 3
    assert counter(stack, "service_restarts_total", role="draft") == 0
    stopped = [a for a in streams.arrivals if stopped_at <= a]
    gap = max(b - a for a, b in zip([stopped_at, *stopped], stopped, strict=False))
    print(  # the figures the test's report quotes
        f"\nstall: first fallback step counted {fell_back_s:.2f} s after SIGSTOP, longest gap "
        f"between responses {gap:.2f} s, 30 tokens at k = 0 in {progress_s:.2f} s, drafting "
        f"again {resume_s:.2f} s after SIGCONT"
    )


def test_broken_serve_stream_reconnects_without_losing_tokens(stack: Stack) -> None:
    """Cancel the orchestrator's Serve stream to the target mid-generation (as a broken
    connection would end it): the orchestrator opens it again, admits its running requests from
    its records, and each finishes with target-only greedy output, steps numbered on without a
    gap or a repeat."""
    prompt = list(PROMPTS[1])
    n = 150
    expected = oracle(stack.target_dir, tuple(prompt), n)
    reconnects = counter(stack, "serve_reconnects_total")
    results: dict[str, Any] = {}
    started = threading.Barrier(4)

    def run(proposer: str) -> None:
        tokens: list[int] = []
        steps: list[Any] = []
        try:
            calls = stack.stub.Generate(request(prompt, n, proposer, 3, request_id=proposer))
            first = next(calls)
            tokens, steps = list(first.token_ids), list(first.steps)
            started.wait()
            for r in calls:
                tokens += r.token_ids
                steps += r.steps
            results[proposer] = (tokens, [s.step for s in steps])
        except BaseException as e:
            results[proposer] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in ("draft", "ngram", "off")]
    for t in threads:
        t.start()
    started.wait()
    broke_at = time.monotonic()
    stack.orchestrator.clients[0]._call.cancel()
    eventually(lambda: counter(stack, "serve_reconnects_total") > reconnects, 60)
    reconnect_s = time.monotonic() - broke_at
    for t in threads:
        t.join(180)
    for proposer in ("draft", "ngram", "off"):
        got = results[proposer]
        assert not isinstance(got, BaseException), f"{proposer}: {got!r}"
        tokens, steps = got
        assert tokens == expected, proposer
        assert steps == list(range(len(steps))), f"{proposer}: steps {steps}"
    assert counter(stack, "service_restarts_total", role="target") == 0
    print(f"\nstream break: Serve stream open again after {reconnect_s:.2f} s")


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(pid)
    return out


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    return "?"


LEFT_BOUND_S = 30.0  # every process the killed orchestrator started is gone within this


def test_sigkill_of_serve_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL the orchestrator's process of `specdec serve` (the child the command runs it in,
    `orchestrator.launch.supervisor`) while it streams: the stream fails, the command exits, and
    every process below it (the service actors, raylet, gcs_server and Ray's helpers) ends within
    LEFT_BOUND_S. (A SIGKILL of the command's own process stops the orchestrator as SIGTERM
    does: tests/orchestrator/test_serve_signals.py.)"""
    target, draft = build_checkpoints(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "orchestrator", "serve", "--target", str(target), "--draft",
           str(draft), "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len", "256",
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
           "--num-cpus", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    below: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once SERVING
        assert "serving target on 127.0.0.1:" in line, line
        address = line.strip().rsplit(" ", 1)[-1]
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            calls = stub.Generate(request(list(PROMPTS[0]), 200, "draft", 3))
            next(calls)  # generating
            below = descendants(proc.pid)
            roles = {_command(p) for p in below}
            assert any("raylet" in c for c in roles) and any("gcs_server" in c for c in roles)
            [orchestrator] = [p for p in below if "-m orchestrator serve" in _command(p)]
            os.kill(orchestrator, signal.SIGKILL)
            assert proc.wait(10) != 0, "the command exits with its orchestrator"
            killed_at = time.monotonic()
            left = _alive(below)
            while left and time.monotonic() - killed_at < LEFT_BOUND_S:
                time.sleep(0.2)  # polling /proc: no event tells that a process elsewhere ended
                left = _alive(below)
            gone_s = time.monotonic() - killed_at
            with pytest.raises(grpc.RpcError):
                list(calls)
        assert not left, "left running: " + "; ".join(_command(p) for p in left)
        print(f"\nSIGKILL of serve: {len(below)} processes below it, all gone in {gone_s:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(below):  # this test's own processes only
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
