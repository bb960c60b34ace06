"""The system benchmark through `specdec serve` and its Python client (`specdec.client`).

`specdec serve` runs as a child process on the same checkpoints and service settings as the
Pipeline rows (it starts a local Ray cluster and places both services on it; with one GPU both
share it). Requests are streamed by one thread per request through one `specdec.client.Client`:
B concurrent greedy requests of token-id prompts, `ignore_eos`, long enough for the warm-up and
the timed steps, cancelled once the window is measured.

The timed window of a row opens when every request has had `warmup` step responses and closes
when every request has had `warmup + steps` (or one finished); `/metrics` is scraped at both
ends. Per request, over the responses inside the window:
  time per output token = (t_last - t_first) / tokens committed after the first response,
  client step = (t_last - t_first) / steps after the first response (one response per step),
and each figure is the median over requests. The hub's step time is the window's
`specdec:step_seconds` sum / count delta (the StepReport's step_s); the orchestrator's overhead
per step is the client step minus the hub's step.

Time to first token: batch 1 on an idle server, for each of `ttft_prompt_lens`, the median of
`ttft_repeats` rounds after one warm-up round, as the client sees it (call to first token) and
as the server reports it (Timing.time_to_first_token_s); each config sends prompts of its own,
and with a paged KV cache each fresh prompt is followed by a turn resending its start (a
cached prefix; the tokens found cached are read from /metrics).

Imports no torch and no Ray: Ray is imported only inside the `specdec serve` process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from bench import e2e_timeline
from bench.e2e_driver import prompts
from bench.e2e_report import TARGET_ONLY_AGAIN, TTFT_PARTS
from bench.e2e_services import (
    REPO,
    Service,
    child_env,
    free_port,
    run_module,
    wait_serving,
)
from orchestrator.launch.ray_start import descendants
from specdec.client import Client

TARGET_ONLY = "target_only"
MARGIN_STEPS = 8  # max_tokens room beyond warm-up + timed steps at k + 1 tokens per step
TTFT_NEW_TOKENS = 2
TTFT_CACHED_SUFFIX = 64  # new tokens after a resent prompt's start (a cached prefix)
PREFIX_HITS = "specdec:prefix_cache_hits_total"  # prompt tokens the targets found cached
STOP_TIMEOUT_S = 90.0  # grace, the actors' stop and ray.shutdown()
# Where the services run: "shared", both on one GPU (`--num-gpus 1`: the local Ray cluster
# sees one GPU, and both actors take half of it); "split", one GPU each (two or more GPUs).
PLACEMENTS = ("shared", "split")
# The placement label of the draft stand-in's rows (BENCHMARKING ONLY): the target on one GPU
# (started as "shared", `--num-gpus 1`), the draft service on none
STAND_IN = "stand-in"


@dataclass
class Serve:
    """A running `specdec serve`: its process (leader of its own process group, so that
    everything it started can be killed with it), client address and /metrics URL."""

    service: Service
    metrics_url: str
    trace_dir: Path

    @property
    def address(self) -> str:
        return self.service.address


def mixed_spread(spread: float, mean: float, low: float, high: float) -> float:
    """The spread of a mixed-traffic row around `mean`: `spread`, narrowed to stay within
    [low, high] (h = 1 or L = 1 leave no room: every request then at the mean)."""
    return max(0.0, min(spread, mean - low, high - mean))


def serve_args(
    s: dict[str, Any],
    length: float | None,
    port: int,
    metrics_port: int,
    hit_rate: float | None = None,
    placement: str = "shared",
    dynamic: bool = False,
    stand_in: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`specdec serve` flags with the Pipeline rows' service settings; with `stand_in` (a
    times file), the draft is the BENCHMARKING ONLY stand-in (`draft_service.stand_in`);
    `extra`: more flags, last."""
    cpu = s["target_device"] == "cpu"
    flags = {
        "--target": s["paths"]["target"],
        "--draft": s["paths"]["draft"],
        "--device": "cpu" if cpu else "cuda",
        "--dtype": s["dtype"],
        "--max-requests": str(s["max_slots"]),
        "--max-seq-len": str(s["max_seq_len"]),
        "--proposer": "draft",
        "--num-draft-tokens": str(s["num_draft_tokens"]),
        "--host": "127.0.0.1",
        "--port": str(port),
        "--metrics-port": str(metrics_port),
        "--grace-s": "1",
    }
    out = ["serve", *(x for pair in flags.items() for x in pair)]
    tp = s.get("target_tp", 1)
    if tp > 1:
        out += ["--target-tensor-parallel", str(tp)]
    if s.get("kv_block_size"):
        out += ["--kv-block-size", str(s["kv_block_size"])]
    if cpu:  # the Triton interpreter would take about 1 s per step
        out += ["--sampler-impl", "torch", "--num-cpus", "4"]
    else:
        out += ["--cuda-graph-batch-sizes", *map(str, s["graph_sizes"])]
        if tp > 1:  # the target over tp GPUs, the draft (or its stand-in) on one more
            out += ["--num-gpus", str(tp + 1)]
        elif placement == "shared":
            out += ["--num-gpus", "1"]
    k = s["num_draft_tokens"]
    if length is not None:  # BENCHMARKING ONLY
        out += ["--synthetic-acceptance-length", str(length)]
        spread = mixed_spread(s.get("serve_acceptance_spread", 0.0), length, 1.0, k + 1.0)
        if spread:  # mixed traffic: each request its own L
            out += ["--synthetic-acceptance-spread", repr(spread)]  # exact: it may be at an end
    if hit_rate is not None:  # draft-ahead, its hit rate set: BENCHMARKING ONLY
        out += ["--draft-ahead", str(s["draft_ahead"]), "--synthetic-hit-rate", str(hit_rate)]
        spread = mixed_spread(s.get("serve_hit_rate_spread", 0.0), hit_rate, 0.0, 1.0)
        if spread:  # mixed traffic: each request its own hit rate
            out += ["--synthetic-hit-rate-spread", repr(spread)]
    if dynamic:
        out.append("--dynamic-speculation")
    if stand_in is not None:
        out += ["--draft-stand-in", str(stand_in)]
    return [*out, *extra]


def serve_env(trace_dir: Path | None = None) -> dict[str, str]:
    """The benchmark's environment for `specdec serve`: its own local Ray cluster (no
    RAY_ADDRESS), no TRITON_INTERPRET (tests set it; Ray would pass it to the actors), and,
    given `trace_dir`, the services' device activity traced there (bench.e2e_timeline)."""
    env = child_env()
    for name in ("RAY_ADDRESS", "TRITON_INTERPRET"):
        env.pop(name, None)
    return env if trace_dir is None else env | {"SPECDEC_GPU_TRACE": str(trace_dir)}


def stop_serve(service: Service, timeout_s: float = STOP_TIMEOUT_S) -> str:
    """SIGTERM (serve stops its actors and shuts its local Ray cluster down), then SIGKILL to
    the whole process group and to every process below it (the orchestrator and Ray's
    processes have a session of their own); swept either way. Says how it ended."""
    process = service.process
    below = descendants(process.pid)
    how = f"had exited (code {process.poll()})"
    if process.poll() is None:
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
        how = f"SIGTERM: exit code {process.poll()} after {time.monotonic() - start:.1f} s"
        if process.poll() is None:
            how = f"killed: still running {timeout_s:.0f} s after SIGTERM"
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in below:  # what is left of it: Ray's processes
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if process.poll() is None:
        process.wait()
    return how


def bench_settings(
    smoke: bool,
    paths: dict[str, str],
    max_slots: int,
    max_seq_len: int,
    num_draft_tokens: int,
    graph_sizes: Sequence[int],
    kv_block_size: int,
) -> dict[str, Any]:
    """`serving`'s settings for a benchmark of its own on `e2e_models`' checkpoints: float32
    on the CPU with `smoke`, else bfloat16 on CUDA with graphs of `graph_sizes`."""
    return {
        "paths": paths,
        "target_device": "cpu" if smoke else "cuda",
        "dtype": "float32" if smoke else "bfloat16",
        "max_slots": max_slots,
        "max_seq_len": max_seq_len,
        "num_draft_tokens": num_draft_tokens,
        "graph_sizes": list(graph_sizes),
        "kv_block_size": kv_block_size,
    }


@contextmanager
def serving(
    s: dict[str, Any],
    length: float | None,
    log_dir: Path,
    timeout_s: float,
    stopped: Callable[[str], None] = lambda how: None,
    hit_rate: float | None = None,
    placement: str = "shared",
    dynamic: bool = False,
    stand_in: Path | None = None,
    extra: Sequence[str] = (),
    name: str | None = None,
) -> Iterator[Serve]:
    """`specdec serve` started, SERVING (grpc.health.v1), and stopped on every way out
    (`stopped` is told how); with `hit_rate`, draft-ahead at that synthetic hit rate; with
    `stand_in`, the draft stand-in (BENCHMARKING ONLY)."""
    port, metrics_port = free_port(), free_port()
    if name is None:
        name = f"serve_{placement}_{'plain' if length is None else f'L{length:g}'}"
        name += "" if hit_rate is None else f"_ahead_h{hit_rate:g}"
        name += "_dynamic" if dynamic else ""
        name += "_standin" if stand_in is not None else ""
    trace_dir = log_dir / f"trace_{name}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    flags = serve_args(s, length, port, metrics_port, hit_rate, placement, dynamic, stand_in,
                       extra)  # fmt: skip
    cmd = [sys.executable, "-m", "orchestrator", *flags]
    with log.open("wb") as f:
        f.write((" ".join(cmd) + "\n").encode())
        f.flush()
        process = subprocess.Popen(
            cmd, cwd=REPO, env=serve_env(trace_dir), stdout=f, stderr=f, start_new_session=True
        )
    service = Service(name, process, f"127.0.0.1:{port}", log)
    try:
        wait_serving(service, timeout_s)
        yield Serve(service, f"http://127.0.0.1:{metrics_port}/metrics", trace_dir)
    finally:
        stopped(f"{name}: {stop_serve(service)}")


def scrape(url: str) -> dict[str, float]:
    """/metrics as name → value, summed over label sets (the series read here have one); a
    histogram's buckets also as name{le=bound}."""
    with urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """`scrape`'s reading of a /metrics text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
        le = re.search(r'le="([^"]*)"', series) if name.endswith("_bucket") else None
        if le is not None:
            key = bucket(name, float(le.group(1)))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def bucket(name: str, le: float) -> str:
    """The key `parse_metrics` gives a histogram bucket's series, e.g. name{le=0}."""
    return f"{name}{{le={le:g}}}"


HUB_PARTS = ("step", "draft", "transport", "verify", "sampler")
AHEAD_COUNTS = ("hits", "misses", "backups", "pushed")


def hub_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per hub step between two scrapes: the whole step and its parts (draft and
    transport are averaged over all steps, including those without a draft)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("specdec:step_seconds_count")
    if steps <= 0:
        raise RuntimeError("the hub ran no step inside the timed window.")
    # steps in which requests that should have drafted ran at k = 0: the draft missed its
    # deadline or was down (a healthy benchmark has none)
    out = {"steps": steps, "fallback_steps": delta("specdec:draft_fallback_steps_total")}
    # draft-ahead: asks answered from chains, asks whose chains missed, and misses answered
    # with a backup proposal of no drafts (the step did not wait for them)
    for count in AHEAD_COUNTS:
        out[f"ahead_{count}"] = delta(f"specdec:draft_ahead_{count}_total")
    for part in HUB_PARTS:
        metric = "specdec:step_seconds" if part == "step" else f"specdec:step_{part}_seconds"
        out[part] = 1e3 * delta(f"{metric}_sum") / steps
    # the k of the steps that served draft requests (dynamic speculation's choice): its mean,
    # and the share of those steps that drafted nothing
    k_steps = delta("specdec:step_num_draft_tokens_count")
    if k_steps > 0:
        out["k_mean"] = delta("specdec:step_num_draft_tokens_sum") / k_steps
        out["k0_share"] = delta(bucket("specdec:step_num_draft_tokens_bucket", 0)) / k_steps
    return out


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the orchestrator holds no request (cancelled ones are released first) and the hubs
    have stopped stepping: a finished request's release reaches its hub at the next step
    boundary, so a step for it may still be running when the orchestrator holds nothing."""
    deadline = time.monotonic() + timeout_s
    held = ("specdec:num_requests_running", "specdec:num_requests_waiting")
    steps = None
    while time.monotonic() < deadline:
        m = scrape(url)
        if all(m.get(name, 0.0) == 0 for name in held):
            if steps == m.get("specdec:steps_total"):
                return
            steps = m.get("specdec:steps_total")
        time.sleep(0.05)
    raise RuntimeError(f"requests still running {timeout_s:.0f} s after a row ended.")


@dataclass
class Stream:
    """One request's responses as the client saw them: arrival time, tokens and steps."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    finished: bool = False
    done: bool = False
    error: BaseException | None = None

    @property
    def num_steps(self) -> int:
        return sum(self.steps)


def _consume(
    client: Client,
    prompt: Sequence[int],
    params: dict[str, Any],
    rec: Stream,
    cond: threading.Condition,
    stop: threading.Event,
) -> None:
    stream = client.generate(prompt, **params)
    try:
        for out in stream:
            t = time.perf_counter()
            with cond:
                rec.times.append(t)
                rec.tokens.append(len(out.token_ids))
                rec.steps.append(len(out.steps))
                rec.finished = out.finished
                cond.notify_all()
            if stop.is_set():
                break
    except BaseException as e:  # reported by the row
        rec.error = e
    finally:
        close = getattr(stream, "close", None)  # a generator: closing it cancels the call
        if close is not None:
            close()
        with cond:
            rec.done = True
            cond.notify_all()


@contextmanager
def streaming(
    address: str, requests: Sequence[tuple[Any, dict[str, Any]]], timeout_s: float
) -> Iterator[tuple[Client, list[Stream], threading.Condition]]:
    """A client of `address`, and a thread per (prompt, generate parameters) consuming its
    stream into a `Stream` (notifying the condition at each response); stopped and joined on
    the way out, then the first stream's error, if any, raised."""
    with Client(address) as client, _streams(client, requests, timeout_s) as (recs, cond):
        yield client, recs, cond


@contextmanager
def _streams(
    client: Client, requests: Sequence[tuple[Any, dict[str, Any]]], timeout_s: float
) -> Iterator[tuple[list[Stream], threading.Condition]]:
    recs = [Stream() for _ in requests]
    cond, stop = threading.Condition(), threading.Event()
    threads = [
        threading.Thread(target=_consume, args=(client, p, kw, rec, cond, stop), daemon=True)
        for (p, kw), rec in zip(requests, recs, strict=True)
    ]
    for t in threads:
        t.start()
    try:
        yield recs, cond
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=timeout_s)
    errors = [r.error for r in recs if r.error is not None]
    if errors:
        raise RuntimeError(f"a stream failed: {errors[0]}")


def wait_until(
    cond: threading.Condition, done: Callable[[], bool], deadline: float, what: str
) -> None:
    """Waits (holding `cond`, as its notifier's check needs) until `done()`; RuntimeError
    naming `what` past the monotonic `deadline`."""
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} in time")
        cond.wait(1.0)


def window_figures(rec: Stream, t0: float, t1: float) -> dict[str, Any] | None:
    """A request's client-side figures over its responses inside (t0, t1]."""
    inside = [i for i, t in enumerate(rec.times) if t0 < t <= t1]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    span = rec.times[last] - rec.times[first]
    tokens = sum(rec.tokens[first + 1 : last + 1])
    steps = sum(rec.steps[first + 1 : last + 1])
    if tokens <= 0 or steps <= 0:
        return None
    # each response's wait per token it brought: the time per output token it gave
    gaps = [(rec.times[i] - rec.times[i - 1], rec.tokens[i]) for i in inside[1:]]
    token_gaps = [1e3 * gap / n for gap, n in gaps if n > 0]
    return {
        "tpot_ms": 1e3 * span / tokens,
        "step_ms": 1e3 * span / steps,
        "tokens": tokens,
        "steps": steps,
        "responses": len(inside),
        "span_s": span,
        "gaps_ms": [1e3 * (rec.times[i] - rec.times[i - 1]) for i in inside[1:]],
        "token_gaps_ms": token_gaps,
    }


@dataclass(frozen=True, slots=True)
class RowSpec:
    placement: str
    config: str
    proposer: str  # "off" or "draft"
    num_draft_tokens: int
    synthetic_length: float | None
    batch: int


def measure_row(
    serve: Serve,
    spec: RowSpec,
    s: dict[str, Any],
    max_tokens: int,
    timeout_s: float,
) -> dict[str, Any]:
    """B concurrent streams; the client's and the hub's figures over the timed window."""
    warmup, steps = s["warmup"], s["serve_steps"]
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "proposer": spec.proposer,
    }
    if spec.proposer != "off":
        params["num_draft_tokens"] = spec.num_draft_tokens
    batch_prompts = prompts(spec.batch, s["prompt_len"], s["vocab_size"], 0)
    recs = [Stream() for _ in batch_prompts]
    cond, stop = threading.Condition(), threading.Event()
    wait_idle(serve.metrics_url)
    with Client(serve.address) as client:
        threads = []
        for i, (p, rec) in enumerate(zip(batch_prompts, recs, strict=True)):
            rid = {"request_id": f"{spec.config}-b{spec.batch}-{i}"}
            args = (client, p, params | rid, rec, cond, stop)
            threads.append(threading.Thread(target=_consume, args=args, daemon=True))
        for t in threads:
            t.start()
        try:
            _wait(cond, recs, lambda r: r.num_steps >= warmup, timeout_s, serve)
            before, t0, wall0 = _scrape_at(serve.metrics_url)
            _wait(cond, recs, lambda r: r.num_steps >= warmup + steps, timeout_s, serve)
            after, t1, wall1 = _scrape_at(serve.metrics_url)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=timeout_s)
    for r in recs:
        if r.error is not None:
            raise RuntimeError(f"{spec.config} batch {spec.batch}: {r.error}")
    row = summarise(spec, recs, t0, t1, hub_ms(before, after))
    row["gpus"] = e2e_timeline.window(serve.trace_dir, wall0, wall1, spec.batch == 1)
    return row


def _wait(
    cond: threading.Condition,
    recs: list[Stream],
    reached: Callable[[Stream], bool],
    timeout_s: float,
    serve: Serve,
) -> None:
    """Until every request has `reached`, or one ended (finished, failed or cancelled)."""
    with cond:
        ok = cond.wait_for(
            lambda: any(r.done or r.finished for r in recs) or all(map(reached, recs)),
            timeout=timeout_s,
        )
    if not ok:
        raise RuntimeError(f"no progress in {timeout_s:.0f} s:\n{serve.service.log_tail()}")
    for r in recs:
        if r.error is not None:
            raise RuntimeError(f"a request failed: {r.error}\n{serve.service.log_tail()}")


def _scrape_at(url: str) -> tuple[dict[str, float], float, float]:
    """A scrape and the time it stands for (the middle of the HTTP call), on the
    perf_counter clock and on the Unix clock (the device traces')."""
    start, wall = time.perf_counter(), time.time()
    metrics = scrape(url)
    half = (time.perf_counter() - start) / 2
    return metrics, start + half, wall + half


def summarise(
    spec: RowSpec, recs: list[Stream], t0: float, t1: float, hub: dict[str, float]
) -> dict[str, Any]:
    per = [f for f in (window_figures(r, t0, t1) for r in recs) if f is not None]
    if len(per) < len(recs):
        raise RuntimeError(
            f"{spec.config} batch {spec.batch}: {len(recs) - len(per)} request(s) had fewer "
            "than two responses in the timed window."
        )
    client_step = statistics.median(f["step_ms"] for f in per)
    tokens = sum(f["tokens"] for f in per)
    gaps = sorted(g for f in per for g in f["gaps_ms"])
    token_gaps = sorted(g for f in per for g in f["token_gaps_ms"])
    return {
        "placement": spec.placement,
        "config": spec.config,
        "proposer": spec.proposer,
        "synthetic_length": spec.synthetic_length,
        "batch": spec.batch,
        "num_draft_tokens": spec.num_draft_tokens if spec.proposer != "off" else 0,
        "window_s": t1 - t0,
        "client_responses_median": statistics.median(f["responses"] for f in per),
        "hub_steps": hub["steps"],
        "fallback_steps": hub["fallback_steps"],
        "draft_ahead": {count: hub[f"ahead_{count}"] for count in AHEAD_COUNTS},
        "tpot_ms_median": statistics.median(f["tpot_ms"] for f in per),
        "tpot_ms_max": max(f["tpot_ms"] for f in per),
        "tpot_ms_p99": token_gaps[int(0.99 * (len(token_gaps) - 1))] if token_gaps else None,
        "client_step_ms_median": client_step,
        "steps_per_s": 1e3 / client_step,
        "tokens_per_s": tokens / (t1 - t0),
        "tokens_per_step_per_request": tokens / sum(f["steps"] for f in per),
        # bursts (responses held back, then delivered together) show as a low p10
        "gap_ms": {f"p{q}": gaps[int(q / 100 * (len(gaps) - 1))] for q in (10, 50, 90)},
        # the parts, and the steps' mean k and share at k = 0 where draft requests ran
        "hub_ms": {part: hub[part] for part in (*HUB_PARTS, "k_mean", "k0_share") if part in hub},
        "overhead_ms_per_step": client_step - hub["step"],
    }


def ttft_prompts(config: str, n: int, i: int, vocab: int) -> tuple[list[int], list[int]]:
    """Round `i`'s prompts of `n` tokens for `config`: a fresh one, of this config's own (another
    config's would be in a paged target's prefix cache), and a turn that resends its first
    n - TTFT_CACHED_SUFFIX tokens with new ones after them (a cached prefix)."""
    fresh, other = prompts(2, n, vocab, zlib.crc32(f"ttft/{config}/{n}/{i}".encode()))
    suffix = min(TTFT_CACHED_SUFFIX, n - 1)
    return fresh, fresh[: n - suffix] + other[:suffix]


def ttft_one(
    serve: Serve,
    client: Client,
    prompt: list[int],
    proposer: str,
    k: int,
    rid: str,
    timeout_s: float,
) -> dict[str, Any]:
    """One request on an idle server through `client` (connected: its channel's connect is
    not timed): the client's call to first token, the server's parts and the prompt tokens
    the targets' prefix caches held (/metrics)."""
    params: dict[str, Any] = {
        "max_tokens": TTFT_NEW_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "proposer": proposer,
        "timeout": timeout_s,
    }
    if proposer != "off":
        params["num_draft_tokens"] = k
    wait_idle(serve.metrics_url)
    hits = scrape(serve.metrics_url).get(PREFIX_HITS, 0.0)
    first, timing = None, None
    start = time.perf_counter()
    for out in client.generate(prompt, request_id=rid, **params):
        if first is None and out.token_ids:
            first = time.perf_counter()
        if out.timing is not None:
            timing = out.timing
    if first is None or timing is None:
        raise RuntimeError(f"{rid}: no token or no timing in the responses.")
    wait_idle(serve.metrics_url)  # the step reports that count the hits have arrived
    return {
        "client_ms": 1e3 * (first - start),
        "server_ms": 1e3 * timing.time_to_first_token_s,
        "parts_ms": ttft_parts_ms(timing),
        "prefix_hit_tokens": int(scrape(serve.metrics_url).get(PREFIX_HITS, 0.0) - hits),
    }


def measure_ttft(
    serve: Serve,
    configs: Sequence[tuple[str, str]],
    lengths: Sequence[int],
    repeats: int,
    k: int,
    vocab: int,
    timeout_s: float,
    cached: bool,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Any]]:
    """Batch 1 on an idle server, per prompt length: one warm-up round, then `repeats` timed
    rounds, each sending every (config, proposer) in turn a fresh prompt and, with `cached`,
    then a turn resending its start (`ttft_prompts`). A row per (config, length, prefix): the
    medians over the timed rounds."""
    samples: dict[tuple[str, str, int, bool], list[dict[str, Any]]] = {}
    with Client(serve.address) as client:  # one channel, connected by the first warm-up
        for n in lengths:
            for i in range(repeats + 1):  # round 0 is the warm-up
                for config, proposer in configs:
                    fresh, turn = ttft_prompts(config, n, i, vocab)
                    for hit, prompt in ((False, fresh), (True, turn))[: 2 if cached else 1]:
                        rid = f"ttft-{config}-{n}-{'cached' if hit else 'fresh'}-{i}"
                        one = ttft_one(serve, client, prompt, proposer, k, rid, timeout_s)
                        if i:
                            samples.setdefault((config, proposer, n, hit), []).append(one)
                tick(1)
    rows = []
    for (config, proposer, n, hit), got in samples.items():
        rows.append({
            "config": config, "proposer": proposer, "prompt_len": n, "cached_prefix": hit,
            "cached_tokens": n - min(TTFT_CACHED_SUFFIX, n - 1) if hit else 0,
            "repeats": len(got),
            "client_ms_median": statistics.median(g["client_ms"] for g in got),
            "client_ms_max": max(g["client_ms"] for g in got),
            "server_ms_median": statistics.median(g["server_ms"] for g in got),
            "prefix_hit_tokens_min": min(g["prefix_hit_tokens"] for g in got),
            "parts_ms_median": {p: statistics.median(g["parts_ms"][p] for g in got)
                                for p in TTFT_PARTS},
        })  # fmt: skip
    return rows


def ttft_parts_ms(timing: Any) -> dict[str, float]:
    admission = timing.admission_s - timing.queue_s
    return {
        "queue": 1e3 * timing.queue_s,
        "handoff": 1e3 * (admission - timing.prefill_s),
        "prefill": 1e3 * timing.prefill_s,
        "first_step": 1e3 * (timing.time_to_first_token_s - timing.admission_s),
    }


def max_tokens_for(s: dict[str, Any]) -> int:
    """Enough tokens for the warm-up and timed steps even if every draft token is accepted."""
    return (s["warmup"] + s["serve_steps"] + MARGIN_STEPS) * (s["num_draft_tokens"] + 1)


def seq_len_needed(s: dict[str, Any]) -> int:
    """The longest sequence a serve row or TTFT request may reach (the services' max_seq_len
    must hold it, plus a step of k + 1 tokens)."""
    k = s["num_draft_tokens"]
    rows = s["prompt_len"] + max_tokens_for(s)
    ttft = max(s["ttft_prompt_lens"]) + TTFT_NEW_TOKENS
    return max(rows, ttft) + k + 1


def placements(result: dict[str, Any]) -> list[str]:
    """The serve rows' placements: as asked, else "shared" and, with two GPUs or more, "split"."""
    s, gpus = result["settings"], result["environment"]["gpu_count"]
    tp = s.get("target_tp", 1)
    if tp > 1 and s["target_device"] == "cpu":  # processes, no GPUs to place
        return ["shared"]
    if tp > 1:  # a tensor-parallel target is never shared with its draft
        if (s.get("serve_placements") or ["split"]) != ["split"] or gpus < tp + 1:
            raise ValueError(
                f"--target-tensor-parallel {tp} runs the split placement only, on "
                f"{tp + 1} GPUs; this machine has {gpus}."
            )
        return ["split"]
    two = s["target_device"] != "cpu" and gpus >= 2
    wanted = s.get("serve_placements") or (list(PLACEMENTS) if two else ["shared"])
    if "split" in wanted and not two:
        raise ValueError(f"the split placement needs two GPUs; this machine has {gpus}.")
    return wanted


def section(
    result: dict[str, Any],
    log_dir: Path,
    timeout_s: float,
    phase: Callable[[str], None],
    tick: Callable[[int], None],
) -> None:
    """The serve rows and TTFT into result["serve"], as they are measured: per placement, one
    `specdec serve` per synthetic length, lock-step, then one per draft-ahead hit rate;
    target-only rows (proposer off: k = 0, so no acceptance test runs) and TTFT on the very
    first."""
    s = result["settings"]
    out = result["serve"]
    out["placements"] = placements(result)
    k = s["num_draft_tokens"]
    max_tokens = max_tokens_for(s)
    first = True
    for placement in out["placements"]:
        for length in s["serve_lengths"]:
            lockstep = f"lockstep_L{length:g}"
            for config, hit_rate, dynamic, extra in serve_starts(s, length):
                phase(f"starting specdec serve ({placement} {config})")
                name = None
                if extra:
                    name = f"serve_{placement}_L{length:g}_ahead_h{hit_rate:g}_nopush"
                with serving(s, length, log_dir, timeout_s, out["stops"].append, hit_rate,
                             placement, dynamic, extra=extra, name=name) as serve:  # fmt: skip
                    with Client(serve.address) as client:
                        served = client.model_info()[0]
                    max_tokens = min(max_tokens, served.max_seq_len - s["prompt_len"])
                    specs = [(TARGET_ONLY, "off")] if first else []
                    for name, proposer in [*specs, (config, "draft")]:
                        for b in s["batches"]:
                            phase(f"serve {placement} {name} batch {b}")
                            spec = RowSpec(placement, name, proposer, k,
                                           None if proposer == "off" else length, b)  # fmt: skip
                            out["rows"].append(measure_row(serve, spec, s, max_tokens, timeout_s))
                            tick(s["serve_steps"])
                    if first:
                        phase("serve TTFT")
                        out["ttft"] += measure_ttft(
                            serve, [(TARGET_ONLY, "off"), (lockstep, "draft")],
                            s["ttft_prompt_lens"], s["ttft_repeats"], k, s["vocab_size"],
                            timeout_s, cached=bool(s.get("kv_block_size")), tick=tick,
                        )  # fmt: skip
                    first = False
    stand_ins = stand_in_starts(s)
    if stand_ins:
        phase("measuring the draft's forwards for the stand-in")
        times = measure_stand_in(s, log_dir, timeout_s)
        out["stand_in"] = json.loads(times.read_text())
        for length in s["serve_lengths"]:
            for config, hit_rate, dynamic in stand_ins:
                config += f"_L{length:g}"
                phase(f"starting specdec serve (stand-in {config})")
                with serving(s, length, log_dir, timeout_s, out["stops"].append, hit_rate,
                             "shared", dynamic, stand_in=times) as serve:  # fmt: skip
                    for b in s["batches"]:
                        phase(f"serve stand-in {config} batch {b}")
                        spec = RowSpec(STAND_IN, config, "draft", k, length, b)
                        out["rows"].append(measure_row(serve, spec, s, max_tokens, timeout_s))
                        tick(s["serve_steps"])
    if s.get("serve_target_only_again"):
        # the first start's settings and placement: only the time between the two differs
        placement, length = out["placements"][0], s["serve_lengths"][0]
        phase(f"starting specdec serve ({placement}, the target alone again)")
        with serving(s, length, log_dir, timeout_s, out["stops"].append, None, placement,
                     name=f"serve_{placement}_target_only_again") as serve:  # fmt: skip
            for b in s["batches"]:
                phase(f"serve {placement} {TARGET_ONLY_AGAIN} batch {b}")
                spec = RowSpec(placement, TARGET_ONLY_AGAIN, "off", k, None, b)
                out["rows"].append(measure_row(serve, spec, s, max_tokens, timeout_s))
                tick(s["serve_steps"])


def stand_in_starts(s: dict[str, Any]) -> list[tuple[str, float | None, bool]]:
    """BENCHMARKING ONLY: the stand-in's `specdec serve` starts of one synthetic length, in
    order: (config name less its length, draft-ahead hit rate, dynamic speculation)."""
    starts: list[tuple[str, float | None, bool]] = []
    if s.get("serve_stand_in_lockstep"):
        starts.append(("standin_lockstep", None, False))
    starts += [(f"standin_ahead_h{h:g}", h, False) for h in s.get("serve_stand_in", [])]
    if s.get("serve_stand_in_dynamic"):
        starts.append(("standin_dynamic", None, True))
    return starts


def measure_stand_in(s: dict[str, Any], log_dir: Path, timeout_s: float) -> Path:
    """BENCHMARKING ONLY: the draft's forward times on this machine's GPU for the stand-in
    (`python -m draft_service.stand_in`, a child process with the GPU to itself); the file."""
    out = log_dir / "stand_in_times.json"
    cpu = s["target_device"] == "cpu"
    args = ["--model", s["paths"]["draft"], "--device", "cpu" if cpu else "cuda",
            "--dtype", s["dtype"], "--max-slots", str(s["max_slots"]),
            "--max-seq-len", str(s["max_seq_len"]),
            "--cuda-graph-batch-sizes", *map(str, s["graph_sizes"]),
            "--guesses", str(s["draft_ahead"] + 1), "--out", str(out)]  # fmt: skip
    log = log_dir / "stand_in_times.log"
    run_module("draft_service.stand_in", args, log, serve_env(), timeout_s,
               "measuring the stand-in's times")  # fmt: skip
    return out


def serve_starts(
    s: dict[str, Any], length: float
) -> list[tuple[str, float | None, bool, list[str]]]:
    """The `specdec serve` starts of one synthetic length, in order: (config name, draft-ahead
    hit rate, dynamic speculation, more flags). Lock-step; then per hit rate draft-ahead, and
    with serve_no_push the same without pushed chains (the A/B in one run); then dynamic."""
    starts: list[tuple[str, float | None, bool, list[str]]] = [
        (f"lockstep_L{length:g}", None, False, [])
    ]
    for h in s.get("serve_hit_rates", []):
        starts.append((f"ahead_h{h:g}_L{length:g}", h, False, []))
        if s.get("serve_no_push"):
            starts.append((f"ahead_nopush_h{h:g}_L{length:g}", h, False,
                           ["--no-draft-push-chains"]))  # fmt: skip
    if s.get("serve_dynamic"):
        starts.append((f"dynamic_L{length:g}", None, True, []))
    return starts


def progress_units(s: dict[str, Any]) -> int:
    """Progress ticks of `section` (placements as asked, else two: an estimate)."""
    per_length = len(serve_starts(s, 1.0))
    n = len(s.get("serve_placements") or PLACEMENTS)
    stand_in = len(stand_in_starts(s))
    per_length_rows = n * per_length + stand_in
    again = bool(s.get("serve_target_only_again"))
    rows = len(s["batches"]) * (1 + again + len(s["serve_lengths"]) * per_length_rows)
    return rows * s["serve_steps"] + len(s["ttft_prompt_lens"]) * (s["ttft_repeats"] + 1)
