"""What each GPU did during a serve row: busy fractions and a timeline, from the services'
device activity spans (`SPECDEC_GPU_TRACE`, written by `specdec.runner.trace`).

Spans are the device time between a step's timing marks: the draft's steps ("draft"), its
passes ahead of the verdict ("ahead"), the target's verify forwards ("verify"), sampler
("sampler") and prefills ("prefill"). A GPU's busy fraction over a window is the length of the
union of its spans inside the window over the window's length; work outside the marked parts
(the draft's bonus-guess step, copies to the host) is not counted. Processes are grouped by GPU
through the GPU's UUID, so two services sharing one GPU make one lane.

Imports no torch.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRAFT_SPANS, TARGET_SPANS = {"draft", "ahead"}, {"verify", "sampler", "prefill"}
TIMELINE_S = 1.0
COLORS = {"draft": "C0", "ahead": "C9", "verify": "C3", "sampler": "C1", "prefill": "C5",
          "host:wait for drafts": "0.55", "host:answer": "C2", "host:pass ahead": "C4",
          "host:send": "C8", "host:gc": "C6", "host:after the verify": "0.8",
          "host:read the draft's answer": "C7"}  # fmt: skip
HOST = "host:"  # host spans (`specdec.runner.trace.Trace.host`): a lane of their own, not busy
HOST_LANE = "host of "  # such a lane's name: "host of <roles> (<device>)"


def read(directory: Path) -> list[dict[str, Any]]:
    """Every process's spans under `directory`: [{"pid", "device", "gpu", "name", "spans"}]."""
    out = []
    for path in sorted(directory.glob("trace-*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        spans = []
        for line in lines[1:]:
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written as we read
                break
        out.append(json.loads(lines[0]) | {"spans": spans})
    return out


def lanes(processes: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """Spans by GPU, each GPU named by the roles of the work on it: "GPU n" is the n-th of the
    run's GPUs in UUID order (not necessarily nvidia-smi's index); "CPU" holds the work of
    services without a GPU (the draft stand-in's, on a GPU machine)."""
    by_gpu: dict[str, list[list[Any]]] = {}
    hosts = []  # (gpu, the process's device spans, its host spans)
    for p in processes:
        device = [s for s in p["spans"] if not s[0].startswith(HOST)]
        by_gpu.setdefault(p["gpu"], []).extend(device)
        hosts.append((p["gpu"], device, [s for s in p["spans"] if s[0].startswith(HOST)]))
    number = {gpu: i for i, gpu in enumerate(sorted(g for g in by_gpu if g != "cpu"))}
    out = {}
    for gpu, spans in by_gpu.items():
        out[f"{_where(gpu, number)} ({_roles(spans)})"] = sorted(spans, key=lambda s: s[1])
    for gpu, device, host in hosts:  # each process's host spans after the device lanes
        if host:
            lane = f"{HOST_LANE}{_roles(device)} ({_where(gpu, number)})"
            out.setdefault(lane, []).extend(sorted(host, key=lambda s: s[1]))
    return out


def _where(gpu: str, number: dict[str, int]) -> str:
    return "CPU" if gpu == "cpu" else f"GPU {number[gpu]}"


def _roles(spans: list[list[Any]]) -> str:
    names = {s[0] for s in spans}
    roles = [r for r, kinds in (("draft", DRAFT_SPANS), ("target", TARGET_SPANS)) if names & kinds]
    return " + ".join(roles) or "idle"


def busy(spans: list[list[Any]], t0: float, t1: float) -> float:
    """Fraction of (t0, t1) covered by the union of `spans`."""
    covered, end = 0.0, t0
    for _, a, b in sorted(spans, key=lambda s: s[1]):
        a, b = max(a, end), min(b, t1)
        if b > a:
            covered += b - a
            end = b
    return covered / (t1 - t0) if t1 > t0 else 0.0


def window(directory: Path, t0: float, t1: float, keep_timeline: bool) -> dict[str, Any]:
    """Busy fraction per GPU over (t0, t1) and, with `keep_timeline`, the spans of the
    window's first TIMELINE_S seconds (times from t0)."""
    found = lanes(read(directory))
    by_name: dict[str, list[Any]] = {}  # a host span name's spans, over every lane
    for lane, s in found.items():
        if lane.startswith(HOST_LANE):
            for x in s:
                by_name.setdefault(x[0], []).append(x)
    out: dict[str, Any] = {
        "busy": {gpu: busy(s, t0, t1) for gpu, s in found.items() if not gpu.startswith(HOST_LANE)},
        # each host span's share of the window, e.g. "wait for drafts": the hub's waits; a
        # name in several services' lanes ("gc") counts the union of theirs
        "host": {name[len(HOST):]: busy(s, t0, t1) for name, s in sorted(by_name.items())},
        # and its median length in ms, over the spans that begin in the window
        "host_ms": {
            name[len(HOST):]: 1e3 * statistics.median(lengths)
            for name, s in sorted(by_name.items())
            if (lengths := [b - a for _, a, b in s if t0 <= a < t1])
        },
    }  # fmt: skip
    if keep_timeline:
        end = min(t1, t0 + TIMELINE_S)
        out["timeline"] = {
            gpu: [[n, round(a - t0, 6), round(b - t0, 6)] for n, a, b in s if b > t0 and a < end]
            for gpu, s in found.items()
        }
    return out


def plot(
    rows: list[dict[str, Any]], title: str, path: Path, label: Callable[[dict[str, Any]], str]
) -> bool:
    """One panel per row (a GPU per lane, titled by `label(row)`), the first TIMELINE_S s of
    its window and a zoom on its first 60 ms beside it; False where matplotlib is missing or no
    row has a timeline."""
    rows = [r for r in rows if r.get("gpus", {}).get("timeline")]
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 1.1 + 1.0 * len(rows) * 1.3),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 1]})  # fmt: skip
    for (ax_all, ax_zoom), r in zip(axes, rows, strict=True):
        timeline = r["gpus"]["timeline"]
        for ax, span_s in ((ax_all, TIMELINE_S), (ax_zoom, 0.06)):
            for lane, (name, spans) in enumerate(timeline.items()):
                # a host span's parts ("host:ahead: fork", inside "host:pass ahead") are only
                # in the shares: drawn, they would hide the span they divide
                drawn = [s for s in spans if s[1] < span_s and ": " not in s[0][len(HOST) :]]
                bars = [(a * 1e3, (b - a) * 1e3) for _, a, b in drawn]
                colors = [COLORS.get(n, "k") for n, _, _ in drawn]
                high = 0.4 if name.startswith(HOST_LANE) else 0.8  # host lanes: thinner bars
                ax.broken_barh(bars, (lane - high / 2, high), facecolors=colors, linewidth=0)
            ax.set_yticks(range(len(timeline)), list(timeline))
            ax.set_xlim(0, span_s * 1e3)
            ax.set_ylim(-0.6, len(timeline) - 0.4)
            ax.tick_params(labelsize=7)
        busy = ", ".join(f"{g.split(' (')[0]} {f:.0%}" for g, f in r["gpus"]["busy"].items())
        ax_all.set_title(f"{label(r)}, batch {r['batch']}: "
                         f"{r['tokens_per_s']:.0f} tokens/s; busy {busy}", fontsize=8,
                         loc="left")  # fmt: skip
        ax_zoom.set_title("first 60 ms", fontsize=8, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("ms from the window's start")
    handles = [Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(COLORS), fontsize=7)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
