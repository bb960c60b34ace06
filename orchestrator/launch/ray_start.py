"""Starting a local Ray cluster on a slow machine: attempts until a deadline, each failed one
cleaned up before the next.

`ray.init` gives its raylet a fixed 30 s to register with the GCS, which a loaded 2-core machine
misses ("timed out during startup"), and waits a fixed time for the GCS to write its port file
("Timed out waiting for file"); the failed attempt then leaves the processes it started (GCS
server, raylet, dashboard, monitors) running, since `ray.shutdown()` knows of a node only once
`ray.init` returned. So each attempt notes this process's descendants first, and a failure stops
everything that appeared since: `ray.shutdown()`, then SIGTERM, then SIGKILL after STOP_GRACE_S.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
# ray.init's words when its raylet is late, and when its GCS did not write its port file in time
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
STOP_GRACE_S = 5.0


def descendants(pid: int | None = None) -> set[int]:
    """The process ids below `pid` (default: this process), from /proc."""
    return descendants_of({os.getpid() if pid is None else pid})


def descendants_of(roots: set[int]) -> set[int]:
    """The process ids below any of `roots`, from one pass over /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the (command) field
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead: only its exit status is left for us to reap
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def stop_processes(pids: set[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each, SIGKILL to those still alive after `grace_s`; reaps our children."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            _reap(pids)
            time.sleep(0.05)
        _reap(pids)
        if not any(_alive(p) for p in pids):
            return


def _reap(pids: set[int]) -> None:
    """Collects the exit status of those of `pids` that are this process's own children."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def start_local_cluster(
    init: Callable[..., Any],
    shutdown: Callable[[], None],
    timeout_s: float,
    **init_args: Any,
) -> int:
    """Calls `init(**init_args)` until it succeeds or `timeout_s` has passed; returns the
    attempts it took. A failed attempt's processes are stopped before anything else happens;
    an error other than Ray's start-up timeout is raised at once."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        before = descendants()
        try:
            init(**init_args)
            return attempt
        except Exception as e:
            shutdown()
            stop_processes(descendants() - before)
            if not any(words in str(e) for words in STARTUP_TIMEOUTS):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"The local Ray cluster did not start within --ray-start-timeout "
                    f"{timeout_s:g} s ({attempt} attempt(s); Ray: {e}). On a loaded machine, "
                    f"raise --ray-start-timeout, or start Ray first (`ray start --head`) and "
                    f"pass --address."
                ) from e
            # Ray's own words name its GCS and raylet, which read as a failure; the retry is routine
            log.debug("Ray start-up attempt %d: %s", attempt, e)
            log.warning("the local Ray cluster was slow to start (attempt %d timed out); stopped "
                        "what it started, trying again (%.0f s left)", attempt, left)  # fmt: skip
