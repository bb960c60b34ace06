"""gRPC's fork handlers are off in specdec's programs (specdec/forking.py): with them on
(grpcio's default), a child forked while other threads are in gRPC aborts now and then before
it execs. A CI run lost
Ray's dashboard ("return code -6") and then its whole local cluster to that (2026-11-26)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VAR = "GRPC_ENABLE_FORK_SUPPORT"

# A gRPC server kept busy by three client threads while the main thread forks children the way
# Ray starts its processes (subprocess with a preexec_fn: a real fork, whose handlers run);
# prints each child's exit code that is not 0. Run with grpcio's default, 2 to 33 children in 400
# aborted (exit -6) on a 2-core machine.
FORKS = textwrap.dedent("""
    import sys
    import {first}  # noqa: F401
    import subprocess
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    done = threading.Event()

    def ask():
        with grpc.insecure_channel(f"127.0.0.1:{{port}}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not done.is_set():
                stub.Check(health_pb2.HealthCheckRequest())

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    codes = [subprocess.Popen(["true"], preexec_fn=lambda: None).wait() for _ in range({n})]
    done.set()
    for t in threads:
        t.join()
    print([c for c in codes if c != 0])
""")


def _env(**extra: str) -> dict[str, str]:
    """This environment without the variable, this tree importable, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k != VAR} | {"PYTHONPATH": str(ROOT), **extra}


def _run(first: str, n: int) -> str:
    env = _env()
    done = subprocess.run([sys.executable, "-c", FORKS.format(first=first, n=n)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_children_forked_beside_a_busy_grpc_server_do_not_abort() -> None:
    got = _run("orchestrator", 400)
    assert got == "[]", "children that did not exit 0 (-6: aborted after the fork)"


@pytest.mark.parametrize("package", ["orchestrator", "draft_service", "target_service", "bench"])
def test_each_program_s_package_sets_it_before_grpc_loads(package: str) -> None:
    """`specdec` (the command's orchestrator.cli.main), `python -m draft_service`,
    `python -m target_service` and the benchmarks import their package first."""
    code = f"import sys, os, {package}; print('grpc' in sys.modules, os.environ.get('{VAR}'))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    assert out == ["False", "0"]


def test_the_setting_reaches_children_and_a_users_own_is_kept() -> None:
    show = f"import os; print(os.environ.get('{VAR}'))"
    for given, want in ((None, "0"), ("1", "1")):
        env = _env() if given is None else _env(**{VAR: given})
        # a child of the importing process sees the same value (Ray's processes are such children)
        code = f"import orchestrator; {show}; import subprocess, sys; " \
               f"subprocess.run([sys.executable, '-c', {show!r}])"  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()  # fmt: skip
        assert out == [want, want]


def test_the_client_library_leaves_a_users_environment_alone() -> None:
    code = f"import os, specdec.client; print(os.environ.get('{VAR}'))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()  # fmt: skip
    assert out == ["None"]
