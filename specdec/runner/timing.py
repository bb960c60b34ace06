"""Where a step's time went, without adding host synchronisations.

On CUDA a `StepClock` records events on the current stream; their durations are read after
the step's one synchronisation (the one that reads its results), when every event has already
completed, so reading them waits for nothing. On the CPU the work is synchronous and the marks
are wall-clock times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.runner.trace import Trace


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Device time of a step's model forwards and of its sampler, in seconds, and whether the
    forwards replayed captured CUDA graphs (False when any of them ran eagerly on a runner that
    has graphs, or on a runner without them)."""

    forward_s: float = 0.0
    sampler_s: float = 0.0
    graphed: bool = False


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[torch.cuda.Event | float] = []
        self._trace = Trace.for_device(device)

    def mark(self) -> int:
        """Records a mark after the work queued so far; returns its index."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def seconds(self, start: int, end: int, span: str | None = None) -> float:
        """Time between two marks; on CUDA call it only after the step's synchronisation.
        With a trace on (`specdec.runner.trace`), writes the interval as the span `span`."""
        a, b = self._marks[start], self._marks[end]
        if span is not None and self._trace is not None:
            self._trace.span(span, a, b)
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        assert isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event)
        return a.elapsed_time(b) / 1000.0
