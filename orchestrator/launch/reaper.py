"""Ends the local Ray cluster of a `specdec serve` that died without stopping it (SIGKILL, an
out-of-memory kill).

Ray ties its GCS server and raylet to the process that started them, but not the rest: with
`specdec serve` SIGKILLed, the raylet's DashboardAgent and RuntimeEnvAgent were still running
30 s later (and any worker the raylet had not reaped yet). So a serve that starts a local
cluster also starts this reaper, a small process of its own (`start_reaper`) that:
- holds the read end of a pipe whose write end only the serve process has: end of file means
  the serve process has ended, however it ended, or closed it after stopping Ray itself;
- every SNAPSHOT_S notes the processes Ray started (those that appeared below the serve
  process while it started the cluster) and everything below them, with their start times
  (once their parent is gone they are re-parented and that tree cannot be read any more);
- on end of file, SIGTERMs what it noted and is still the same process (same start time), then
  SIGKILLs what is left after STOP_GRACE_S, and exits.

It ignores SIGINT, so that Ctrl-C in a terminal (sent to the whole process group) leaves it to
clean up after the serve process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from orchestrator.launch.ray_start import descendants_of

SNAPSHOT_S = 1.0  # a pass over /proc costs ~10 ms of CPU on a busy machine
STOP_GRACE_S = 3.0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if it has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _snapshot(roots: set[int]) -> dict[int, int]:
    pids = (roots | descendants_of(roots)) - {os.getpid()}
    return {p: t for p in pids if (t := _start_time(p)) is not None}


def _same(noted: dict[int, int]) -> set[int]:
    """The noted processes still running (not ended, their ids not reused)."""
    return {p for p, t in noted.items() if _start_time(p) == t}


def reap(roots: set[int], pipe: IO[bytes]) -> int:
    """Watches `roots` and the processes below them until `pipe` ends, then stops them;
    returns how many it had to signal."""
    noted = _snapshot(roots)
    while True:
        ready, _, _ = select.select([pipe], [], [], SNAPSHOT_S)
        if ready and not pipe.read(1):
            break
        noted = {p: t for p, t in noted.items() if _start_time(p) == t}
        noted.update(_snapshot(set(noted)))
    left = _same(noted)
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 1.0)):
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _same({p: noted[p] for p in left}) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _same({p: noted[p] for p in left}):
            break
    return len(left)


def start_reaper(roots: set[int]) -> subprocess.Popen[bytes]:
    """Starts the reaper of the processes `roots` (Ray's, started by this process) and those
    below them; close its stdin after stopping Ray."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.launch.reaper", *map(str, sorted(roots))],
        stdin=subprocess.PIPE,
        start_new_session=False,
        close_fds=True,
    )


def stop_reaper(reaper: subprocess.Popen[bytes], timeout_s: float = STOP_GRACE_S + 5.0) -> None:
    """Tells the reaper that Ray was stopped (it cleans up what is left) and waits for it."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout_s)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap({int(pid) for pid in sys.argv[1:]}, sys.stdin.buffer)


if __name__ == "__main__":
    main()
