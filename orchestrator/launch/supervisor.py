"""`specdec serve` as two processes: a parent that only relays signals, and the orchestrator in
a child process with a session of its own.

Why: the local Ray cluster's processes (GCS, raylet, dashboard, monitors) are started by the
orchestrator and so share its process group. `timeout`, a shell's job control and
`kill -- -PGID` signal the whole group, and Ray blocks only SIGINT in its processes: a SIGTERM
to the group stopped the GCS and the raylet at once, the services (Ray actors) and every
request in flight with them, and the orchestrator's stop then waited 60 s for the dead GCS
until Ray ended the process. In a session of its own the orchestrator and Ray's processes are
out of the group's reach; the parent forwards SIGTERM, SIGINT and SIGHUP to the orchestrator
alone, which drains and stops Ray itself, and exits with the orchestrator's exit code. The
child gets SIGTERM should the parent die (PR_SET_PDEATHSIG), and Ray's processes die with
the child (Ray's own fate sharing).

At default verbosity the child's environment also quiets grpc core's INFO lines. gRPC's fork
handlers, whose "skipping fork() handlers" line showed each time Ray started a process, are off
in specdec's programs (`specdec/forking.py` says why); the child inherits that setting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import site
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import orchestrator

PARENT_ENV = "SPECDEC_SERVE_PARENT"  # set in the child: the parent's process id
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def is_child() -> bool:
    return PARENT_ENV in os.environ


def child_env(log_level: str) -> dict[str, str]:
    """The orchestrator's environment: this package importable as here (a source tree is put
    on PYTHONPATH; an installed one is found as usual), the parent named,
    grpc core's INFO lines off unless DEBUG (or the user set GRPC_VERBOSITY), and Ray's
    auto-init off (RAY_ENABLE_AUTO_CONNECT=0, unless the user set it)."""
    env = os.environ | {PARENT_ENV: str(os.getpid())}
    root = Path(orchestrator.__file__).resolve().parents[1]  # the tree that holds the package
    installed = {Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages())}
    if root not in installed:  # run from a source tree: the child imports the same tree
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{root}{os.pathsep}{path}" if path else str(root)
    if logging.getLevelName(log_level.upper()) != logging.DEBUG:
        env.setdefault("GRPC_VERBOSITY", "ERROR")
    # no Ray call starts a cluster of its own: the orchestrator starts or joins one explicitly,
    # and a call made after its cluster was stopped from outside must fail, not start another
    env.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    return env


def run_in_child(argv: Sequence[str], log_level: str) -> int:
    """Runs `python -m orchestrator ARGV` in a new session, forwarding signals to it; returns
    its exit code (128 + N where signal N ended it), except that an abort during a stop this
    process forwarded is exit code 1 with a line saying why (`stop_code`)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *argv],
        env=child_env(log_level),
        start_new_session=True,
    )
    stopping = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if process.poll() is None:
            process.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    code = process.wait()  # retried across the signals' handlers (PEP 475)
    return stop_code(code, bool(stopping))


def stop_code(code: int, stopping: bool) -> int:
    """The command's exit code for the orchestrator's `code` (Popen's: -N where signal N ended
    it). Ray's core worker aborts its process (SIGABRT) when Ray's own processes, the raylet
    and the GCS, are gone under it: a SIGTERM to every process of a systemd unit or a session
    stops them while the orchestrator still drains. That stop is then what the user asked
    for, not a crash: exit code 1 and a line saying so, as where Ray did not answer the stop.
    Any other signal, or an abort outside a stop, keeps 128 + N."""
    if code == -signal.SIGABRT and stopping:
        print(
            "specdec serve: the orchestrator was aborted during the stop (SIGABRT): Ray's core "
            "worker does so when Ray's own processes (raylet, GCS) were stopped under it, as a "
            "SIGTERM to every process of the unit or session does. Exit code 1.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return code if code >= 0 else 128 - code


def follow_parent() -> None:
    """In the child: SIGTERM (the graceful stop) when the parent dies (Linux); at once if it
    already has. The variable naming the parent is dropped, so that Ray's processes (and a
    `specdec serve` started from one) do not take themselves for this child."""
    parent = os.environ.pop(PARENT_ENV, None)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if str(os.getppid()) != parent:
        os.kill(os.getpid(), signal.SIGTERM)
