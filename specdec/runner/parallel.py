"""Tensor parallelism: one model split over N ranks of one node, served by rank 0.

Rank 0 is the service's own process and its `ParallelRunner` is the runner the engine drives.
It starts ranks 1 .. N-1 as processes of its own (spawned, each on GPU r of those this process
sees, or on the CPU), and every call that runs the model or changes KV state (`MIRRORED`) is
sent to them over a pipe before rank 0 makes it: each rank then makes the same call on its part
of the model (`model.Shard`), so the activations' all-reduces and the logits' all-gather meet
in the same order on every rank, and every rank's KV slots hold the same requests. Only rank 0
reads the outputs: the sampler (a step's `head`) runs there alone, so its randomness is drawn
once; the other ranks replay graphs of their own, captured at the same calls (one per rank-0
head, so the collectives captured match call for call).

The collectives run through torch.distributed: NCCL between GPUs, gloo on the CPU. The ranks
die together: a rank started here is killed by the kernel when rank 0 ends (PR_SET_PDEATHSIG),
and rank 0 ends its process when another rank exits (`on_rank_death`), so that whatever
restarts a failed service restarts the whole group, and nothing waits forever on a collective
that a dead rank will never join.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch

from specdec.errors import CacheFullError, CheckpointError, InvalidInputError, UnknownRequestError
from specdec.runner.config import ForwardItem, RunnerConfig
from specdec.runner.model import Shard
from specdec.runner.runner import ModelRunner

log = logging.getLogger(__name__)

# the runner's calls every rank makes, in rank 0's order
MIRRORED = (
    "add_request", "release", "truncate", "fork", "swap", "forward", "graph_step", "ragged_step",
    "take_prefix",
)  # fmt: skip
START_TIMEOUT_S = 600.0  # for the ranks to join and load their parts
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one collective's wait for a slow rank
RANK_LOST_EXIT = 70  # rank 0's exit status when another rank died (EX_SOFTWARE)
# what a runner call raises from its checks, before any work on the device: every rank meets
# it in the same call (their KV state is the same) and the ranks stay in step. Any other error
# may come after some of a call's collectives, on one rank only: the group ends
ALIKE = (InvalidInputError, CacheFullError, UnknownRequestError, ValueError, NotImplementedError)


def rank_config(config: RunnerConfig, rank: int) -> RunnerConfig:
    """Rank `rank`'s runner config: on CUDA its own GPU, the `rank`-th from the configured one
    ("cuda" or "cuda:0": GPUs 0 .. N-1 of those visible; "cuda:1": 1 .. N)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        return replace(config, device=f"cuda:{(device.index or 0) + rank}")
    return config


def _store(world: int, port: int = 0) -> Any:
    """The ranks' rendezvous: rank 0 serves it on a port the kernel picks (port 0), so that two
    targets starting on one node cannot pick the same; the others connect to its port."""
    import torch.distributed as dist

    timeout = timedelta(seconds=START_TIMEOUT_S)
    if port == 0:
        return dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world, False, timeout)


def _join(rank: int, world: int, store: Any, device: torch.device) -> Any:
    """Joins the ranks' process group; returns it."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
        timeout=COLLECTIVE_TIMEOUT, device_id=device if cuda else None,
    )  # fmt: skip
    return dist.group.WORLD


def _die_with_parent() -> None:
    """The kernel kills this process when its parent (rank 0) ends, however it ends."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


class _NoHead:
    """A worker's stand-in for one of rank 0's heads: keys its own graphs, computes nothing."""

    def __call__(self, logits: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()


def _worker(
    config: RunnerConfig,
    rank: int,
    world: int,
    port: int,
    commands: multiprocessing.connection.Connection,
    ready: Any,
) -> None:
    """Rank `rank` (> 0): joins, loads its part, then makes rank 0's calls until told to stop."""
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it waits
    try:
        config = rank_config(config, rank)
        device = config.torch_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the node's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        group = _join(rank, world, _store(world, port), device)
        runner = ModelRunner.load_rank(config, Shard(rank, world, group))
    except BaseException as exc:
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    ready.put((rank, None))
    heads: dict[object, _NoHead] = {}
    while True:
        try:
            name, args, kwargs = commands.recv()
        except EOFError:  # rank 0 is gone
            _end_rank(None, 0)
        if name == "stop":  # rank 0 ends the group with every rank: see `_leave_group`
            try:
                runner.release_graphs()  # their collectives hold the communicators
            finally:
                _end_rank(runner.device, 0, leave=True)
        if name in ("graph_step", "ragged_step"):
            key = kwargs.pop("head_key")
            kwargs["head"] = None if key is None else heads.setdefault(key, _NoHead())
        args = tuple(_from_host(a, runner.device) for a in args)
        kwargs = {k: _from_host(v, runner.device) for k, v in kwargs.items()}
        try:
            getattr(runner, name)(*args, **kwargs)
        except ALIKE as exc:  # rank 0 meets the same error in the same call and reports it
            log.debug("%s failed on rank %d: %s", name, rank, exc)
        except BaseException:  # perhaps after some collectives: the group cannot go on
            log.exception("%s failed on rank %d: the group ends", name, rank)
            os._exit(RANK_LOST_EXIT)


def _end_rank(device: torch.device | None, status: int, leave: bool = False) -> NoReturn:
    """Ends a rank > 0 at once: its device's work finished first (`device`: its last
    collectives, whose peers on rank 0 have been issued), then, with `leave` (rank 0's stop),
    the group's orderly end made together with rank 0 (bounded: see `_leave_group`), else no
    teardown at all (rank 0 is gone: an orderly end would wait for it for ever). The kernel
    frees what the process held."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    if leave:
        _leave_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


LEAVE_TIMEOUT_S = 10.0  # for each way out of the group: the orderly end, then the abort


def _bounded(call: Callable[[], None], name: str) -> str | None:
    """Runs `call` in a daemon thread for at most LEAVE_TIMEOUT_S; None if it returned, else
    why not."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported by the caller
            failed.append(exc)
        done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(LEAVE_TIMEOUT_S):
        return f"did not return within {LEAVE_TIMEOUT_S:.0f} s"
    return f"failed: {failed[0]}" if failed else None


def _leave_group(orderly: bool = True) -> None:
    """Leaves the process group. `orderly`: every rank is leaving at the same time (rank 0
    sent each its stop): NCCL's orderly end (ncclCommFinalize, inside destroy_process_group)
    returns only when every rank makes it together, so each rank makes it at once, without
    waiting for the others to exit first (rank 0 joining its ranks before its own destroy
    hung both on two H100s). Not `orderly` (ranks killed or gone), or an orderly end that
    does not return within LEAVE_TIMEOUT_S: the communicators are aborted, which frees this
    rank's part alone. An abort that fails or does not return is logged as an error: the
    process still belongs to the group, so a new `launch` in it is refused, saying so.
    Destroy the CUDA graphs first (`ModelRunner.release_graphs`): NCCL's end, orderly or
    aborted, waits for every graph that captured one of its collectives (on 2 x H200 both ends
    timed out, and the end left waiting aborted the process once the graphs were freed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    if orderly:
        why = _bounded(dist.destroy_process_group, "tp-leave")
        if why is None:
            return
        log.warning("the tensor-parallel group's orderly end %s; aborting it", why)
    why = _bounded(dist.distributed_c10d._abort_process_group, "tp-abort")
    if why is not None:
        log.error("the tensor-parallel group's NCCL abort %s; this process cannot start "
                  "another group", why)  # fmt: skip


def _finish_device(device: torch.device, ranks: list[_Rank], wait_s: float) -> bool:
    """Whether this rank's queued device work (its last collectives) finished within
    `wait_s`; False at once if another rank ended meanwhile (a collective it never joins
    would wait for NCCL's own timeout)."""
    if device.type != "cuda":
        return True
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + wait_s
    while not event.query():
        if time.monotonic() > deadline or not all(r.process.is_alive() for r in ranks):
            return False
        time.sleep(0.001)
    return True


@dataclass(frozen=True, slots=True)
class _Sent:
    """A tensor as sent to another rank: its values (a NumPy array pickles as bytes, where a
    CPU tensor would travel as shared memory and a file descriptor) and whether it was on the
    device, so that the other rank checks what rank 0 checks (`ModelRunner._step` checks token
    ids on the host only) and the ranks fail alike."""

    values: Any  # np.ndarray
    on_device: bool


def _to_host(value: Any) -> Any:
    """`value` with every tensor in it as `_Sent`, to be sent to another rank."""
    if isinstance(value, torch.Tensor):
        return _Sent(value.detach().cpu().numpy(), value.device.type != "cpu")
    if isinstance(value, ForwardItem) and isinstance(value.token_ids, torch.Tensor):
        # as a tensor, with where it was: a paged cache reads ids it gets on the host only
        return replace(value, token_ids=_to_host(value.token_ids))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def _from_host(value: Any, device: torch.device) -> Any:
    """`_to_host` undone on a rank whose device is `device`."""
    if isinstance(value, _Sent):
        t = torch.from_numpy(np.ascontiguousarray(value.values))
        return t.to(device) if value.on_device else t
    if isinstance(value, ForwardItem) and isinstance(value.token_ids, _Sent):
        return replace(value, token_ids=_from_host(value.token_ids, device))
    if isinstance(value, (list, tuple)):
        return type(value)(_from_host(v, device) for v in value)
    return value


@dataclass(slots=True)
class _Rank:
    rank: int
    process: Any  # multiprocessing.Process
    commands: multiprocessing.connection.Connection


def _exit_group() -> None:
    os._exit(RANK_LOST_EXIT)


class ParallelRunner(ModelRunner):
    """Rank 0's runner: a ModelRunner over rank 0's part whose `MIRRORED` calls every other
    rank makes too (`launch` builds it). One call at a time: a lock keeps the ranks' order."""

    def _attach(self, ranks: list[_Rank], on_rank_death: Callable[[], None]) -> None:
        self._ranks = ranks
        self._inside = False
        self._lock = threading.RLock()
        self._heads: dict[tuple[object, ...], int] = {}
        self._closing = False
        self._on_rank_death = on_rank_death
        # before multiprocessing's own exit hook (atexit runs the last registered first), which
        # ends daemon processes: a clean exit stops the ranks here instead of the watcher
        # taking their end for a lost rank
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @property
    def world(self) -> int:
        return len(self._ranks) + 1

    def _watch(self) -> None:
        sentinels = {r.process.sentinel: r for r in self._ranks}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        r = sentinels[ended[0]]  # type: ignore[index]
        log.error(
            "tensor-parallel rank %d (pid %s) exited with status %s: the model's other ranks "
            "cannot go on without it, so this service ends and is restarted as a whole",
            r.rank, r.process.pid, r.process.exitcode,
        )  # fmt: skip
        self._on_rank_death()

    def _head_key(self, head: object, head_inputs: Sequence[torch.Tensor]) -> int | None:
        """The other ranks' stand-in for this head and input layout (their graphs are keyed
        as rank 0's are); None for no head and no inputs."""
        layout = tuple((tuple(x.shape[1:]), x.dtype) for x in head_inputs)
        if head is None and not layout:
            return None
        return self._heads.setdefault((head, layout), len(self._heads))

    def _send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name in ("graph_step", "ragged_step"):
            names = ("request_ids", "token_ids", "head", "head_inputs")[: len(args)]
            bound = dict(zip(names, args, strict=True))
            bound |= kwargs
            key = self._head_key(bound.pop("head", None), bound.pop("head_inputs", ()))
            args, kwargs = (), {**bound, "head_key": key}
        message = (name, _to_host(args), {k: _to_host(v) for k, v in kwargs.items()})
        for r in self._ranks:
            r.commands.send(message)

    def _mirror(self, name: str, *args: Any, **kwargs: Any) -> Any:
        base = getattr(ModelRunner, name)
        with self._lock:
            if self._inside:  # a mirrored call made inside another: the ranks make it too
                return base(self, *args, **kwargs)
            self._send(name, args, kwargs)
            self._inside = True
            try:
                return base(self, *args, **kwargs)
            except ALIKE:
                raise
            except BaseException:  # perhaps after some collectives: the ranks are out of step
                log.exception("%s failed on rank 0: the tensor-parallel group ends", name)
                self._on_rank_death()
                raise
            finally:
                self._inside = False

    def close(self, wait_s: float = 30.0) -> None:
        """Stops the other ranks (each killed if it has not ended within `wait_s`) and leaves
        the process group. Bounded: a call stuck in a collective (holding the lock past
        `wait_s`) or device work that does not finish gets the ranks killed instead."""
        locked = self._lock.acquire(timeout=wait_s)
        try:
            if self._closing:
                return
            atexit.unregister(self.close)
            finished = locked and _finish_device(self.device, self._ranks, wait_s)
            self._closing = True  # from here a rank's end is this stop, not a loss
            stopped = finished
            for r in self._ranks:
                if finished:
                    try:
                        r.commands.send(("stop", (), {}))
                    except OSError:  # it is gone already: no orderly end with it
                        stopped = False
            if finished:  # a graph that captured a collective holds its communicator:
                self.release_graphs()  # NCCL's end, orderly or aborted, waits for it (not
                # released with work unfinished: that abort may wait out its bound, logged)
            if stopped:  # the ranks leave the group now too, each on its stop
                _leave_group(orderly=True)
            for r in self._ranks:
                r.process.join(wait_s if finished else 0)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join(wait_s)
            if not finished:
                log.warning("tensor-parallel ranks killed at close: work on the device or a "
                            "call in flight did not finish within %.0f s", wait_s)  # fmt: skip
            if not stopped:
                _leave_group(orderly=False)
        finally:
            if locked:
                self._lock.release()


def _mirrored(name: str) -> Callable[..., Any]:
    def call(self: ParallelRunner, *args: Any, **kwargs: Any) -> Any:
        return self._mirror(name, *args, **kwargs)

    base = getattr(ModelRunner, name)
    call.__name__, call.__qualname__, call.__doc__ = name, f"ParallelRunner.{name}", base.__doc__
    return call


for _name in MIRRORED:  # the one list of the calls every rank makes
    setattr(ParallelRunner, _name, _mirrored(_name))


def check_launchable(config: RunnerConfig) -> None:
    """CheckpointError if `config`'s checkpoint cannot be split over its ranks, or ValueError
    if there are not that many GPUs; before any process starts or any weight is read."""
    from specdec.runner.loader import check_tensor_parallel_checkpoint

    check_tensor_parallel_checkpoint(config)
    device = torch.device(config.device)
    if device.type == "cuda":
        have, last = torch.cuda.device_count(), (device.index or 0) + config.tensor_parallel
        if have < last:
            raise ValueError(
                f"tensor_parallel={config.tensor_parallel} from {device} needs GPUs up to "
                f"cuda:{last - 1}; this process sees {have}."
            )


def launch(config: RunnerConfig, on_rank_death: Callable[[], None] = _exit_group) -> ParallelRunner:
    """Starts ranks 1 .. N-1, loads rank 0's part here, and returns rank 0's runner once every
    rank has its part; CheckpointError (naming the rank) if one could not load it.
    `on_rank_death` runs when a rank exits later (default: this process exits).

    Call it from the main thread: the kernel ends the ranks when the thread that started them
    ends (PR_SET_PDEATHSIG follows the thread, not the process)."""
    import torch.distributed as dist

    if threading.current_thread() is not threading.main_thread():
        log.warning("tensor-parallel ranks started from thread %r end when it ends",
                    threading.current_thread().name)  # fmt: skip
    check_launchable(config)
    world = config.tensor_parallel
    if dist.is_initialized():
        raise RuntimeError(
            "This process already belongs to a torch.distributed group (another tensor-parallel "
            "runner's, or one whose NCCL abort failed at close: see the error logged then)."
        )
    store = _store(world)
    port = int(store.port)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    ranks = []
    for rank in range(1, world):
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_worker, args=(config, rank, world, port, receive, ready),
            name=f"specdec-tp-rank{rank}", daemon=True,
        )  # fmt: skip
        process.start()
        receive.close()
        ranks.append(_Rank(rank, process, send))
    try:
        config0 = rank_config(config, 0)
        group = _wait_joined(ranks, ready, lambda: _join(0, world, store, config0.torch_device))
        runner = ParallelRunner.load_rank(config0, Shard(0, world, group))
        assert isinstance(runner, ParallelRunner)
        _wait_ready(ranks, ready)
    except BaseException:
        for r in ranks:
            r.process.kill()
        _leave_group(orderly=False)
        raise
    runner._attach(ranks, on_rank_death)
    log.info("tensor parallelism over %d ranks (%s)", world, config.device)
    return runner


def _wait_joined(ranks: list[_Rank], ready: Any, join: Callable[[], Any]) -> Any:
    """Runs `join` (which waits for every rank) and returns its result, unless a rank fails
    first: then CheckpointError with that rank's error."""
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(join())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="tp-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.1)
        _check_ranks(ranks, ready, deadline)
    if failure:
        raise failure[0]
    return result[0]


def _wait_ready(ranks: list[_Rank], ready: Any) -> None:
    """Waits until every rank has loaded its part; CheckpointError for the first that failed."""
    deadline = time.monotonic() + START_TIMEOUT_S
    loaded: set[int] = set()
    while len(loaded) < len(ranks):
        try:
            rank, error = ready.get(timeout=0.1)
        except Exception:  # queue.Empty
            _check_ranks(ranks, ready, deadline)
            continue
        if error is not None:
            raise CheckpointError(f"Tensor-parallel rank {rank} could not start: {error}")
        loaded.add(rank)


def _check_ranks(ranks: list[_Rank], ready: Any, deadline: float) -> None:
    for r in ranks:
        if not r.process.is_alive():
            message = f"exited with status {r.process.exitcode}"
            try:
                rank, error = ready.get(timeout=1.0)  # its own words, if it sent them
                if error is not None:
                    r, message = next(x for x in ranks if x.rank == rank), error
            except Exception:
                pass
            raise CheckpointError(f"Tensor-parallel rank {r.rank} could not start: {message}")
    if time.monotonic() > deadline:
        raise CheckpointError(
            f"The tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s."
        )
