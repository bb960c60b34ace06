"""A local Ray cluster's start-up on a slow machine (`orchestrator.launch.ray_start`): a failed
attempt leaves none of its processes behind, attempts go on until the deadline, which ends with
a message saying what to do; and `specdec serve` comes up on a machine whose CPUs are saturated.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch.ray_start import descendants, start_local_cluster

# ray.init's words (a CI run's, 2026-11-26)
LATE = ("The current node timed out during startup. This could happen because some of the raylet "
        "failed to startup or the GCS has become overloaded.")  # fmt: skip
# and when its GCS server had not written its port file in time (another CI run's)
NO_PORT_FILE = ("Timed out waiting for file /tmp/ray/session_2026-11-26_10-54-50_462944_9624/"
                "gcs_server_port_e1405b")  # fmt: skip


class FakeRay:
    """`init` starts a process tree as Ray's would (a child with a grandchild), then fails
    with Ray's start-up timeout `failures` times; `shutdown` counts its calls."""

    def __init__(self, failures: int, error: str = LATE) -> None:
        self.failures, self.error = failures, error
        self.started: list[set[int]] = []
        self.shutdowns = 0
        self.kwargs: list[dict[str, Any]] = []

    def init(self, **kwargs: Any) -> None:
        self.kwargs.append(kwargs)
        before = descendants()
        subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])
        deadline = time.monotonic() + 5
        while len(descendants() - before) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the shell has started both sleeps
        self.started.append(descendants() - before)
        if len(self.started) <= self.failures:
            raise Exception(self.error)

    def shutdown(self) -> None:
        self.shutdowns += 1


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.parametrize("error", [LATE, NO_PORT_FILE], ids=["raylet late", "no GCS port file"])
def test_a_failed_attempt_is_stopped_before_the_next_one(
    caplog: pytest.LogCaptureFixture, error: str
) -> None:
    ray = FakeRay(failures=2, error=error)
    with caplog.at_level(logging.INFO, logger="orchestrator.launch.ray_start"):
        attempts = start_local_cluster(ray.init, ray.shutdown, 60.0, num_cpus=2)
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(shown) == 2 and all("trying again" in line for line in shown), shown
    # a routine retry does not repeat Ray's words, which name its GCS and raylet as if failed
    assert not any(word in line for line in shown for word in ("GCS", "raylet")), shown
    assert attempts == 3 and ray.shutdowns == 2 and ray.kwargs == [{"num_cpus": 2}] * 3
    failed, kept = ray.started[:2], ray.started[2]
    assert all(len(pids) == 3 for pids in ray.started)  # sh and its two sleeps
    assert not _alive(failed[0] | failed[1]), "a failed attempt's processes are gone"
    assert _alive(kept) == kept, "the attempt that started is left running"
    from orchestrator.launch.ray_start import stop_processes

    stop_processes(kept)
    assert not _alive(kept)


def test_attempts_end_at_the_deadline_with_what_to_do() -> None:
    ray = FakeRay(failures=1000)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start within --ray-start-timeout 1 s \("):
        start_local_cluster(ray.init, ray.shutdown, 1.0)
    assert time.monotonic() - start < 20
    assert len(ray.started) >= 1 and ray.shutdowns == len(ray.started)
    assert not _alive(set().union(*ray.started))


def test_another_error_is_raised_at_once_and_cleaned_up() -> None:
    ray = FakeRay(failures=1, error="no space left on device")
    with pytest.raises(Exception, match="no space left on device"):
        start_local_cluster(ray.init, ray.shutdown, 60.0)
    assert len(ray.started) == 1 and not _alive(ray.started[0])


@contextmanager
def saturated_cpus(seconds: float) -> Iterator[None]:
    """Two busy-looping processes per CPU, each ending on its own after `seconds`."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    busy = [
        subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


@pytest.mark.slow  # a Ray cluster and both services started on saturated CPUs: minutes
def test_serve_comes_up_while_the_cpus_are_saturated(checkpoints: tuple[Path, Path]) -> None:
    import ray

    from orchestrator.config import PlacementConfig, ServeConfig, ServiceConfig
    from orchestrator.server import Orchestrator
    from specdec.client import Client

    target, draft = checkpoints
    config = ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=64, sampler_impl="torch"),
        PlacementConfig(num_cpus=4, ray_start_timeout_s=300.0),
        host="127.0.0.1", port=0, metrics_port=None, grace_s=1.0,
    )  # fmt: skip
    orchestrator = Orchestrator(config)
    with saturated_cpus(45.0):  # Ray's first start-up window (30 s) runs saturated
        start = time.monotonic()
        port = orchestrator.start()
        print(f"specdec serve came up in {time.monotonic() - start:.1f} s on saturated CPUs")
    try:
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            assert client.health()
            out = client.complete([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert len(out.token_ids) == 4
    finally:
        orchestrator.stop(1.0)
    assert not ray.is_initialized()
