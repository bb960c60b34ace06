"""Device activity spans (specdec.runner.trace): off by default, and on, each span is the
interval its StepClock measured, placed on the Unix clock inside the host's own bounds."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import e2e_timeline
from specdec.runner import trace
from specdec.runner.timing import StepClock


@pytest.fixture
def traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    monkeypatch.setattr(trace.Trace, "_by_device", {})
    yield tmp_path


def _timed(device: torch.device) -> tuple[float, float, float]:
    """A clock around some work: (host time before, measured seconds, host time after)."""
    x = torch.randn(512, 512, device=device)
    clock = StepClock(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    before = time.time()
    clock.mark()
    for _ in range(20):
        x = (x @ x).tanh()
    clock.mark()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = time.time()
    return before, clock.seconds(0, 1, "work"), after


def _check(directory: Path, device: torch.device) -> None:
    before, seconds, after = _timed(device)
    [process] = e2e_timeline.read(directory)
    assert process["device"] == str(device)
    [[name, start, end]] = process["spans"]
    assert name == "work"
    assert end - start == pytest.approx(seconds, abs=2e-5)
    slack = 1e-3  # the anchor's own synchronisation
    assert before - slack <= start <= end <= after + slack
    assert seconds > 0


def test_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.ENV, raising=False)
    monkeypatch.setattr(trace.Trace, "_by_device", {})
    _timed(torch.device("cpu"))
    assert trace.Trace._by_device == {}
    assert not list(tmp_path.iterdir())


def test_cpu_span(traced: Path) -> None:
    _check(traced, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_span(traced: Path) -> None:
    _check(traced, torch.device("cuda", torch.cuda.current_device()))
    [process] = e2e_timeline.read(traced)
    assert process["gpu"] != "cpu"


def test_a_host_span_is_the_perf_counter_interval_on_the_same_clock(traced: Path) -> None:
    class Runner:
        device = torch.device("cpu")

    t = trace.trace_of(Runner())
    assert t is not None and trace.trace_of(object()) is None  # no device: no trace
    before = time.time()
    start = time.perf_counter()
    time.sleep(0.01)
    trace.host_span(t, "wait for drafts", start)
    after = time.time()
    [process] = e2e_timeline.read(traced)
    [[name, a, b]] = process["spans"]
    assert name == "host:wait for drafts"
    assert before - 1e-3 <= a < b <= after + 1e-3 and b - a >= 0.01


def test_no_host_span_without_a_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.ENV, raising=False)

    class Runner:
        device = torch.device("cpu")

    assert trace.trace_of(Runner()) is None
    trace.host_span(None, "answer", time.perf_counter())  # nothing to write, nothing raised


def test_a_garbage_collection_is_a_host_span(traced: Path) -> None:
    """With a trace on, each collection of the process is the host span "gc" (it holds every
    thread), inside the host's bounds; a later trace takes the spans over."""

    class Runner:
        device = torch.device("cpu")

    assert trace.trace_of(Runner()) is not None
    before = time.time()
    gc.collect()
    after = time.time()
    [process] = e2e_timeline.read(traced)
    spans = [s for s in process["spans"] if s[0] == "host:gc"]
    assert spans, "the collection was not traced"
    assert all(before - 1e-3 <= a <= b <= after + 1e-3 for _, a, b in spans)
