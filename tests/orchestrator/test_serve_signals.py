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

from orchestrator.launch.ray_start import _alive, descendants
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


def _start(
    checkpoints: tuple[Path, Path], log: Path, grace_s: float = GRACE_S, http: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """`specdec serve` on free ports; its client address (with `http`, then the OpenAI-compatible
    API's base URL after a space)."""
    target, draft = checkpoints
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "orchestrator", "serve", "--target", str(target), "--draft",
           str(draft), "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len", "256",
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grace-s",
           str(grace_s), "--num-cpus", "4"]  # fmt: skip
    if http:
        cmd += ["--http-port", "0"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once SERVING
    if "serving target on 127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"specdec serve did not start: {line!r}\n{log.read_text()}")
    address = line.strip().rsplit(" ", 1)[-1]
    if http:
        line = proc.stdout.readline()  # "specdec: OpenAI-compatible HTTP API on URL"
        assert "OpenAI-compatible HTTP API on http://127.0.0.1:" in line, line
        address += " " + line.strip().rsplit(" ", 1)[-1]
    return proc, address


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_drains_the_request_in_flight_and_exits_cleanly(
    checkpoints: tuple[Path, Path], tmp_path: Path, to: str
) -> None:
    log = tmp_path / "stderr.log"
    # the process variant also serves the OpenAI-compatible HTTP API and streams through it
    proc, address = _start(checkpoints, log, http=to == "process")
    address, _, base_url = address.partition(" ")
    try:
        processes = descendants(proc.pid)
        assert len(processes) >= 5, "the orchestrator, Ray's processes and the two services"
        with Client(address) as client:
            assert len(client.complete([5, 6, 7, 8], max_tokens=8, ignore_eos=True).token_ids) == 8
            if base_url:
                openai = pytest.importorskip("openai")
                api = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
                chunks = api.completions.create(model="target", prompt="w5 w6 w7 w8", max_tokens=8,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})  # fmt: skip
                text = "".join(c.choices[0].text for c in chunks)
                want = client.complete("w5 w6 w7 w8", max_tokens=8, temperature=0.0,
                                       ignore_eos=True).text  # fmt: skip
                assert text == want and text
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

    from orchestrator.launch.placement import ray_logging_level
    from orchestrator.launch.supervisor import child_env

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    assert child_env("INFO")["GRPC_VERBOSITY"] == "ERROR"
    assert child_env("INFO")["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT), "this tree"
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


def test_a_request_still_running_when_the_grace_period_ends_is_cancelled(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """--grace-s 0.5: the scheduler ends what still runs right away; the stream ends with
    finish reason "cancelled" and the tokens so far, and serve exits 0."""
    proc, address = _start(checkpoints, tmp_path / "stderr.log", grace_s=0.5)
    try:
        processes = descendants(proc.pid)
        tokens, final = 0, None
        with Client(address) as client:
            for delta in client.generate([5, 6, 7, 8], max_tokens=240, temperature=0.0,
                                         ignore_eos=True, proposer="off"):  # fmt: skip
                if final is None and tokens == 0:
                    os.killpg(proc.pid, signal.SIGTERM)
                tokens += len(delta.token_ids)
                final = delta
        assert final is not None and final.finish_reason == "cancelled" and 0 < tokens < 240
        assert proc.wait(timeout=30) == 0
        _all_gone(processes, 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _all_gone(processes: set[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while left := [p for p in processes if _alive(p)]:
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.1)


def test_the_orchestrator_stops_when_its_parent_is_killed(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    proc, _ = _start(checkpoints, tmp_path / "stderr.log")
    processes = descendants(proc.pid)
    proc.kill()  # SIGKILL: nothing relayed; the orchestrator gets SIGTERM from the kernel
    proc.wait()
    _all_gone(processes, GRACE_S + 30.0)
    assert "signal 15: stopping" in (tmp_path / "stderr.log").read_text()


@pytest.mark.slow  # waits out the deadline by design: about 30 s
def test_sigterm_to_every_process_of_the_unit_ends_within_the_deadline(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """As systemd's default KillMode=control-group: SIGTERM to the parent and, at once, to the
    orchestrator's session (Ray's GCS, raylet and monitors). Ray's calls would wait 60 s for
    its stopped GCS; the stop gives Ray min(grace, 5) + RAY_STOP_S, stops the rest itself and
    exits 1 with a warning."""
    from orchestrator.server import RAY_STOP_S

    log = tmp_path / "stderr.log"
    proc, _ = _start(checkpoints, log)
    try:
        processes = descendants(proc.pid)
        (child,) = _children(proc.pid)
        start = time.monotonic()
        os.killpg(child, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGTERM)
        deadline = min(GRACE_S, 5.0) + RAY_STOP_S + 5.0  # + stop_processes' SIGKILL grace
        code = proc.wait(timeout=deadline + 15.0)
        took = time.monotonic() - start
        print(f"SIGTERM to every process: exit code {code} after {took:.1f} s")
        assert took < deadline + 5.0
        _all_gone(processes, 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"its stderr ends:\n{text[-2500:]}")  # shown with -s, or where the test fails
    assert code in (0, 1), f"exit code {code}; its stderr ends:\n{text[-3000:]}"
    if code == 1:  # Ray did not answer the stop, or its core worker aborted: said so
        said = ("Ray did not answer within", "aborted during the stop")
        assert any(line in text for line in said), text[-3000:]
