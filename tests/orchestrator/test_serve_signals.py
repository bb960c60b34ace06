"""`specdec serve` started as a user starts it, stopped as `timeout`, systemd and Kubernetes stop
it: SIGTERM to the process or to its whole process group, with a request in flight. The request
finishes, the exit code is 0 within the grace period plus a few seconds, none of its processes
(Ray's included) is left, and nothing on its stderr at default verbosity reads as an error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.ray_start import _alive, descendants
from specdec.client import Client

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5.0
START_S = 180.0
# lines a clean start and stop must not print at default verbosity
MISLEADING = [
    r"fork_posix",
    r"skipping fork\(\) handlers",
    r"Token authentication",
    r"Failed to get node info",
    r"Deadline Exceeded",
    r"GCS",
    r"ERROR",
    r"Traceback",
    r"\] .*E\d{4} ",  # glog error lines: E1125 22:57:00.763 ...
    r"WARNING",
]


def _start(checkpoints: tuple[Path, Path], log: Path) -> tuple[subprocess.Popen[str], str]:
    target, draft = checkpoints
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "specdec", "serve", "--target", str(target), "--draft",
           str(draft), "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len", "128",
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grace-s",
           str(GRACE_S), "--num-cpus", "4"]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once SERVING
    if "serving target on 127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"specdec serve did not start: {line!r}\n{log.read_text()}")
    return proc, line.strip().rsplit(" ", 1)[-1]


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_drains_the_request_in_flight_and_exits_cleanly(
    checkpoints: tuple[Path, Path], tmp_path: Path, to: str
) -> None:
    log = tmp_path / "stderr.log"
    proc, address = _start(checkpoints, log)
    try:
        processes = descendants(proc.pid)
        assert len(processes) >= 5, "the orchestrator, Ray's processes and the two services"
        with Client(address) as client:
            assert len(client.complete([5, 6, 7, 8], max_tokens=8, ignore_eos=True).token_ids) == 8
            after_signal = 0
            signalled_at = None
            # proposer off: one token a step, so the request is still running at the signal
            for delta in client.generate([5, 6, 7, 8], max_tokens=120, temperature=0.0,
                                         ignore_eos=True, proposer="off"):  # fmt: skip
                if signalled_at is None:
                    signalled_at = time.monotonic()
                    if to == "group":
                        os.killpg(proc.pid, signal.SIGTERM)
                    else:
                        os.kill(proc.pid, signal.SIGTERM)
                else:
                    after_signal += len(delta.token_ids)
                final = delta
        assert signalled_at is not None
        assert final.finish_reason == "length" and after_signal > 0, "drained, not cut off"
        code = proc.wait(timeout=GRACE_S + 30)
        took = time.monotonic() - signalled_at
        print(f"SIGTERM to the {to}: exit code {code} after {took:.1f} s")
        assert code == 0
        assert took < GRACE_S + 5.0
        deadline = time.monotonic() + 10.0  # a killed worker's parent may reap it a bit later
        while left := [p for p in processes if _alive(p)]:
            assert time.monotonic() < deadline, f"processes left behind: {left}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    for pattern in MISLEADING:
        assert not re.search(pattern, text), f"{pattern!r} in stderr:\n{text}"
    assert "signal 15: stopping" in text, text


def test_debug_shows_ray_s_and_grpc_core_s_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from orchestrator.placement import ray_logging_level
    from orchestrator.supervisor import child_env

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    assert child_env("INFO")["GRPC_VERBOSITY"] == "ERROR"
    assert "GRPC_VERBOSITY" not in child_env("DEBUG")
    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")
    assert child_env("INFO")["GRPC_VERBOSITY"] == "INFO", "the user's own setting wins"
    root = logging.getLogger()
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    monkeypatch.setattr(root, "level", logging.INFO)
    monkeypatch.setattr(notice, "level", logging.NOTSET)
    assert ray_logging_level() == logging.WARNING and notice.level == logging.ERROR
    root.setLevel(logging.DEBUG)
    assert ray_logging_level() == logging.DEBUG and notice.level == logging.NOTSET
    root.setLevel(logging.WARNING)
    assert ray_logging_level() == logging.WARNING
