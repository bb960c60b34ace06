"""Service processes for the system benchmark, and the empty gRPC round trip it is held to.

Each service runs as `python -m draft_service` / `python -m target_service` from the source
tree (PYTHONPATH holds the repository root), logs to a file, and is stopped by SIGTERM, then
SIGKILL, whatever happens to the benchmark. Imports no torch.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.client import LockstepStream, make_channel

REPO = Path(__file__).resolve().parent.parent
ECHO_METHOD = "/specdec.bench.Echo/Echo"


def child_env() -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_module(
    module: str,
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    what: str | None = None,
) -> None:
    """`python -m module args` from the repository root to its end, its output in `log`;
    RuntimeError naming `what` (default: the module) with the log's last lines if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module, *args]
    with log.open("wb") as f:
        done = subprocess.run(cmd, cwd=REPO, env=env or child_env(), stdout=f, stderr=f,
                              timeout=timeout_s)  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{what or module} failed (code {done.returncode}):\n{tail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    address: str
    log: Path

    def log_tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def launch(name: str, module: str, args: list[str], log_dir: Path) -> Service:
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as f:
        f.write((" ".join(cmd) + "\n").encode())
        f.flush()
        process = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=f)
    return Service(name, process, f"127.0.0.1:{port}", log)


def wait_serving(service: Service, timeout_s: float) -> None:
    """Polls the standard health service until SERVING; RuntimeError with the log's tail if the
    process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    with make_channel(service.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited with code {service.process.returncode}:\n"
                    f"{service.log_tail()}"
                )
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"{service.name} not SERVING after {timeout_s:.0f} s:\n{service.log_tail()}")


def stop(service: Service, timeout_s: float = 30.0) -> None:
    if service.process.poll() is not None:
        return
    service.process.send_signal(signal.SIGTERM)
    try:
        service.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        service.process.kill()
        service.process.wait()


@contextmanager
def running(
    name: str, module: str, args: list[str], log_dir: Path, timeout_s: float, wait: bool = True
) -> Iterator[Service]:
    """A started service, SERVING unless `wait` is False (then the caller waits, and may start
    another meanwhile), stopped on the way out (errors and Ctrl-C included)."""
    service = launch(name, module, args, log_dir)
    try:
        if wait:
            wait_serving(service, timeout_s)
        yield service
    finally:
        stop(service)


def _echo_server(port: int) -> None:
    from concurrent import futures

    def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "specdec.bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def empty_round_trip(log_dir: Path, calls: int = 300) -> dict[str, float]:
    """An empty message's round trip over a lock-step bidirectional stream (as the services'
    Propose and Verify streams are used) to a trivial echo server in another process."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.e2e_services", "--echo-server", str(port)]
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "echo.log").open("wb") as f:
        process = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=f)
    echo = Service("echo server", process, f"127.0.0.1:{port}", log_dir / "echo.log")
    try:
        with make_channel(echo.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            method = channel.stream_stream(ECHO_METHOD)
            times = []
            with LockstepStream(method) as stream:
                for i in range(calls + 20):
                    start = time.perf_counter()
                    stream(b"")
                    if i >= 20:  # warm-up
                        times.append(time.perf_counter() - start)
    finally:
        stop(echo, timeout_s=5)
    times.sort()
    return {
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        "calls": calls,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--echo-server"]:
        _echo_server(int(sys.argv[2]))
