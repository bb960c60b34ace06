"""Device activity spans for a timeline of the GPUs (diagnostics and benchmarks only).

With `SPECDEC_GPU_TRACE=DIR` in its environment, each process that runs model steps appends
one JSON line per timed span to `DIR/trace-<pid>.jsonl`: `[name, start, end]` in seconds of
the Unix clock, after a first line naming the process and its device. A span is the device
time between two `StepClock` marks (the forwards of a draft or verify step, the sampler), so
spans of processes on one host line up on one time axis.

On CUDA the spans come from the step's own timing events, read after the step's one
synchronisation; they are placed on the Unix clock through one event recorded at a known
host time when the trace starts (one synchronisation, once per process). Event times are
float32 milliseconds from that anchor: about 8 us resolution after two minutes, 60 us after
ten. On the CPU the marks are host times. Unset (the default), nothing is recorded and
nothing is added to a step. `bench/e2e_timeline.py` reads the files.

Host spans (`host`, named "host:<what>") mark where a service's host thread waited or worked
on the critical path between device steps: the hub waiting for drafts, the draft answering an
ask and running its pass ahead. They are perf_counter intervals placed on the same clock. The
interpreter's garbage collections are host spans too ("host:gc"): a collection holds every
thread of the process.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, ClassVar

import torch

ENV = "SPECDEC_GPU_TRACE"


class Trace:
    """One process's span file; `for_device` gives the process's trace, or None when off."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _by_device: ClassVar[dict[str, Trace]] = {}

    def __init__(self, directory: Path, device: torch.device) -> None:
        self.device = device
        self._anchor: torch.cuda.Event | None = None
        self._anchor_s = time.time() - time.perf_counter()  # CPU marks are perf_counter times
        self._host_s = self._anchor_s  # perf_counter → Unix clock, for host spans on any device
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.synchronize()
                self._anchor = torch.cuda.Event(enable_timing=True)
                self._anchor.record()
                torch.cuda.synchronize()
                self._anchor_s = time.time()
        directory.mkdir(parents=True, exist_ok=True)
        name = f"trace-{os.getpid()}-{str(device).replace(':', '')}.jsonl"
        self._file: IO[str] = (directory / name).open("a", buffering=1)  # a line at a time
        self._file.write(json.dumps({"pid": os.getpid(), **_describe(device)}) + "\n")
        _GC.trace = self  # the process's collections go to its latest trace
        if _GC not in gc.callbacks:
            gc.callbacks.append(_GC)

    @classmethod
    def for_device(cls, device: torch.device) -> Trace | None:
        directory = os.environ.get(ENV)
        if not directory:
            return None
        key = str(device)
        with cls._lock:
            if key not in cls._by_device:
                cls._by_device[key] = cls(Path(directory), device)
            return cls._by_device[key]

    def span(
        self, name: str, start: torch.cuda.Event | float, end: torch.cuda.Event | float
    ) -> None:
        """Writes a span between two completed marks (events on CUDA, perf_counter on CPU)."""
        if isinstance(start, float) and isinstance(end, float):
            a, b = self._anchor_s + start, self._anchor_s + end
        else:
            assert self._anchor is not None and not isinstance(start, float)
            assert not isinstance(end, float)
            a = self._anchor_s + self._anchor.elapsed_time(start) / 1e3
            b = self._anchor_s + self._anchor.elapsed_time(end) / 1e3
        self._file.write(json.dumps([name, round(a, 6), round(b, 6)]) + "\n")

    def host(self, name: str, start: float, end: float) -> None:
        """Writes the host span "host:`name`" between two perf_counter times."""
        a, b = self._host_s + start, self._host_s + end
        self._file.write(json.dumps([f"host:{name}", round(a, 6), round(b, 6)]) + "\n")


class _GcSpans:
    """Each garbage collection, start to stop, as the host span "gc" of `trace`."""

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.trace is not None and self._start:
            self.trace.host("gc", self._start, time.perf_counter())


_GC = _GcSpans()


def trace_of(runner: object) -> Trace | None:
    """The trace of `runner`'s device where tracing is on (None otherwise, or without one)."""
    device = getattr(runner, "device", None) if os.environ.get(ENV) else None
    return Trace.for_device(device) if isinstance(device, torch.device) else None


def host_span(trace: Trace | None, name: str, start: float) -> None:
    """A host span from `start` (perf_counter) to now, where a trace is on."""
    if trace is not None:
        trace.host(name, start, time.perf_counter())


def _describe(device: torch.device) -> dict[str, str]:
    """The device's name and a host-wide identity (the GPU's UUID; CUDA_VISIBLE_DEVICES
    renumbers GPUs per process, so indexes do not say which processes share one)."""
    if device.type != "cuda":
        return {"device": str(device), "gpu": "cpu", "name": "cpu"}
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "")) or f"{props.name}-{getattr(props, 'pci_bus_id', device)}"
    return {"device": str(device), "gpu": uuid, "name": props.name}
