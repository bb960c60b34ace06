"""How the system benchmark drives requests: a small `Driver` protocol, so that the
orchestrator's client can be measured by the same loop later, and its lock-step
implementation over `bench.pipeline.Pipeline`.

A step's split (`StepOutcome.split`, seconds) comes from the services' own `StepTiming`:
transport is each call's round trip minus the service's time, a service's Python is its time
minus its device time, and the driver's Python is the step minus both round trips.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.pipeline import Pipeline
from specdec.sampling_params import SamplingParams
from specdec.serving.client import make_channel

GREEDY = SamplingParams(temperature=0.0)
SPLIT = (
    "draft_forward",
    "draft_python",
    "verify_forward",
    "sampler",
    "target_python",
    "transport",
    "driver",
)


@dataclass(slots=True)
class StepOutcome:
    """What one step committed per request, where its time went (empty if the driver cannot
    tell), and whether every forward of it replayed a CUDA graph."""

    tokens: dict[str, Sequence[int]]
    split: dict[str, float] = field(default_factory=dict)
    graphed: bool = False


class Driver(Protocol):
    def admit(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None: ...

    def step(self, num_draft_tokens: Mapping[str, int]) -> StepOutcome: ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    def close(self) -> None: ...


class PipelineDriver:
    """Lock-step propose → verify over the services' gRPC streams; target-only when `draft`
    is None (the draft is never called)."""

    def __init__(self, draft: str | None, target: str) -> None:
        self.channels = [make_channel(target)] + ([] if draft is None else [make_channel(draft)])
        self.pipeline = Pipeline(None if draft is None else self.channels[1], self.channels[0])

    def admit(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        self.pipeline.admit(request_id, prompt, sampling)

    def release(self, request_ids: Sequence[str]) -> None:
        self.pipeline.release(request_ids)

    def step(self, num_draft_tokens: Mapping[str, int]) -> StepOutcome:
        start = time.perf_counter()
        verdicts = self.pipeline.step(num_draft_tokens)
        wall = time.perf_counter() - start
        if verdicts.errors:
            i = min(verdicts.errors)
            raise RuntimeError(f"request {verdicts.request_ids[i]}: {verdicts.errors[i].message}")
        tokens = dict(zip(verdicts.request_ids, verdicts.token_ids, strict=True))
        trace = self.pipeline.last_step
        assert trace is not None
        v, p = trace.verify, trace.propose
        split = dict.fromkeys(SPLIT, 0.0)
        split["verify_forward"] = v.service.forward_s
        split["sampler"] = v.service.sampler_s
        split["target_python"] = v.service.service_s - v.service.forward_s - v.service.sampler_s
        split["transport"] = v.round_trip_s - v.service.service_s
        split["driver"] = wall - v.round_trip_s
        graphed = v.service.graphed
        if p is not None:
            split["draft_forward"] = p.service.forward_s
            split["draft_python"] = p.service.service_s - p.service.forward_s
            split["transport"] += p.round_trip_s - p.service.service_s
            split["driver"] -= p.round_trip_s
            graphed = graphed and p.service.graphed
        return StepOutcome(tokens, split, graphed)

    def close(self) -> None:
        self.pipeline.close()
        for channel in self.channels:
            channel.close()


def prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(batch)]


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int
    num_draft_tokens: int
    prompt_len: int
    vocab_size: int
    warmup: int
    steps: int


def measure(
    driver: Driver, work: Workload, tag: str, tick: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Warm-up steps, then `work.steps` timed steps of `work.batch` greedy requests."""
    rids = [f"{tag}-b{work.batch}-{i}" for i in range(work.batch)]
    ks = dict.fromkeys(rids, work.num_draft_tokens)
    for rid, prompt in zip(
        rids, prompts(work.batch, work.prompt_len, work.vocab_size, 0), strict=True
    ):
        driver.admit(rid, prompt, GREEDY)
    times, committed, graphed = [], 0, 0
    split = dict.fromkeys(SPLIT, 0.0)
    try:
        for _ in range(work.warmup):
            driver.step(ks)
        for _ in range(work.steps):
            start = time.perf_counter()
            out = driver.step(ks)
            times.append(time.perf_counter() - start)
            committed += sum(len(t) for t in out.tokens.values())
            graphed += out.graphed
            for name, seconds in out.split.items():
                split[name] += seconds
            if tick is not None:
                tick()
    finally:
        driver.release(rids)
    return summary(work, times, committed, graphed, split)


def summary(
    work: Workload, times: list[float], committed: int, graphed: int, split: dict[str, float]
) -> dict[str, Any]:
    wall = sum(times)
    ordered = sorted(times)
    return {
        "batch": work.batch,
        "num_draft_tokens": work.num_draft_tokens,
        "steps": len(times),
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "step_ms_mean": 1e3 * wall / len(times),
        "committed_tokens": committed,
        "tokens_per_s": committed / wall,
        "tokens_per_step_per_request": committed / (len(times) * work.batch),
        "time_per_output_token_ms": 1e3 * wall * work.batch / committed,
        "graphed_steps": graphed,
        "split_ms_mean": {name: 1e3 * s / len(times) for name, s in split.items()},
    }


def greedy_run(
    driver: Driver,
    work: Workload,
    tag: str,
    new_tokens: int,
    steps: list[list[int]] | None = None,
) -> list[list[int]]:
    """Each request's first `new_tokens` committed tokens (greedy); with `steps`, also each
    request's tokens committed per step, appended there (a replay needs the step boundaries)."""
    rids = [f"{tag}-{i}" for i in range(work.batch)]
    made: dict[str, list[int]] = {rid: [] for rid in rids}
    counts: dict[str, list[int]] = {rid: [] for rid in rids}
    for rid, prompt in zip(
        rids, prompts(work.batch, work.prompt_len, work.vocab_size, 1), strict=True
    ):
        driver.admit(rid, prompt, GREEDY)
    try:
        while any(len(t) < new_tokens for t in made.values()):
            ks = {rid: work.num_draft_tokens for rid, t in made.items() if len(t) < new_tokens}
            for rid, tokens in driver.step(ks).tokens.items():
                made[rid].extend(tokens)
                counts[rid].append(len(tokens))
    finally:
        driver.release(rids)
    if steps is not None:
        steps.extend(counts[rid] for rid in rids)
    return [made[rid][:new_tokens] for rid in rids]


def compare(
    work: Workload,
    plain: list[list[int]],
    spec: list[list[int]],
    spec_steps: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The greedy check's record: passed, and each request's first divergence; `spec_steps`
    (tokens committed per step by the speculative run, see `greedy_run`) is kept in it."""
    divergences = []
    for i, (a, b, prompt) in enumerate(
        zip(plain, spec, prompts(work.batch, work.prompt_len, work.vocab_size, 1), strict=True)
    ):
        j = next((j for j in range(len(a)) if a[j] != b[j]), None)
        if j is not None:
            divergences.append(
                {
                    "request": i,
                    "position": j,
                    "prompt": prompt,
                    "prefix": a[:j],
                    "target_only_token": a[j],
                    "speculative_token": b[j],
                }
            )
    return {
        "passed": not divergences,
        "batch": work.batch,
        "new_tokens": len(plain[0]),
        "num_draft_tokens": work.num_draft_tokens,
        "divergences": divergences,
        "target_only": plain,
        "speculative": spec,
        "speculative_steps": spec_steps,
    }
