"""What a benchmark result names about where it ran: the commit, the device, the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def commit(short: bool = False) -> str:
    """SPECDEC_COMMIT where set (a copied tree, as on a device machine, may carry a stale .git),
    else the checkout's HEAD; "unknown" outside a checkout."""
    if os.environ.get("SPECDEC_COMMIT"):
        full = os.environ["SPECDEC_COMMIT"]
        return full[:7] if short else full
    with suppress(OSError, subprocess.CalledProcessError):
        args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    return "unknown"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """For file names: the GPU's name with underscores (NVIDIA_H200), or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


def machine(device: torch.device) -> str:
    """The device in words, for a report."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()} cores of {cpu_model()}"


def save(stem: Path, result: dict[str, Any], markdown: str) -> None:
    """`stem`.json (the results) and `stem`.md (the report), and the report on stdout."""
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
