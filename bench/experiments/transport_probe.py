"""Why a gRPC round trip costs what it does on a host: an empty bidirectional-stream round trip
(the services' lock-step form) between two processes, under variations of one thing at a time.

    PYTHONPATH=. python bench/experiments/transport_probe.py [--trips 2000] [--out bench/results]

Variants: the plain case; a unary call instead; the server process with CUDA initialised; both
processes pinned to their own cores; a server thread pool of one; grpc.aio on both ends; a
server thread spinning on Python work (GIL contention, as an engine thread would cause), with
the interpreter's default 5 ms GIL switch interval and with 100 us. Each
variant's server runs in a fresh child process; trips are timed in the parent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.client import LockstepStream

VARIANTS = (
    "plain", "unary", "server_cuda", "pinned", "one_worker", "aio", "gil_spinner",
    "gil_spinner_switch_100us", "switch_100us", "gpu_work", "gpu_work_poll",
    "gpu_work_aio",
)  # fmt: skip
GPU_WORK_S = 4e-3  # device time a gpu_work server spends per message, about an 8B verify step
SWITCH_S = 1e-4  # the interpreter's GIL switch interval in the *_switch_100us variants


class _Echo(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, work: str = "") -> None:
        self._work = work

    def Verify(
        self, request_iterator: Iterator[common_pb2.DraftBlock], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        for _ in request_iterator:
            start = time.perf_counter()
            if self._work:
                _gpu_work(self._work == "gpu_work_poll")
            response = target_pb2.VerifyResponse()
            response.timing.service_s = time.perf_counter() - start
            yield response


def _gpu_work(poll: bool) -> None:
    """GPU_WORK_S of device time, then a wait for it: a stream synchronize, or polling an
    event with short sleeps (which surely lets other threads have the GIL)."""
    import torch

    torch.cuda._sleep(int(GPU_WORK_S * _CYCLES_PER_S))
    if not poll:
        torch.cuda.current_stream().synchronize()
        return
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        time.sleep(20e-6)

    def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo()


class _AioEcho(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, work: bool = False) -> None:
        self._work = work

    async def Verify(  # type: ignore[override]
        self, request_iterator: AsyncIterator[common_pb2.DraftBlock], context: object
    ) -> AsyncIterator[target_pb2.VerifyResponse]:
        async for _ in request_iterator:
            start = time.perf_counter()
            if self._work:
                _gpu_work(poll=False)  # blocks the event loop: nothing else runs in lock-step
            response = target_pb2.VerifyResponse()
            response.timing.service_s = time.perf_counter() - start
            yield response


def _serve(variant: str, port_out: mp.connection.Connection) -> None:  # child process
    if variant.endswith("switch_100us"):
        sys.setswitchinterval(SWITCH_S)
    if variant == "pinned" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {2 % (os.cpu_count() or 1)})
    if variant == "server_cuda":
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
    if variant.startswith("gil_spinner"):
        threading.Thread(target=_spin, daemon=True).start()
    if variant in ("aio", "gpu_work_aio"):
        if variant == "gpu_work_aio":
            _calibrate()
        asyncio.run(_serve_aio(port_out, variant == "gpu_work_aio"))
        return
    workers = 1 if variant == "one_worker" else 16
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    work = variant if variant.startswith("gpu_work") else ""
    if work:
        _calibrate()
    target_pb2_grpc.add_TargetServiceServicer_to_server(_Echo(work), server)
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


_CYCLES_PER_S = 1.5e9


def _calibrate() -> None:
    """Cycles per second of torch.cuda._sleep on this GPU."""
    import torch

    global _CYCLES_PER_S
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    _CYCLES_PER_S = 10**7 / (start.elapsed_time(end) / 1e3)


def _spin() -> None:
    x = 0
    while True:  # pure Python: holds the GIL except at the interpreter's switch interval
        x += 1


async def _serve_aio(port_out: mp.connection.Connection, work: bool) -> None:
    server = grpc.aio.server()
    target_pb2_grpc.add_TargetServiceServicer_to_server(_AioEcho(work), server)
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _time_sync(variant: str, address: str, trips: int) -> list[float]:
    if variant == "pinned" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {4 % (os.cpu_count() or 1)})
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        times = []
        if variant == "unary":
            call = lambda: stub.GetModelInfo(common_pb2.GetModelInfoRequest())
        else:
            stream = LockstepStream(stub.Verify)
            call = lambda: stream(common_pb2.DraftBlock())
        for _ in range(trips + 50):
            start = time.perf_counter()
            response = call()
            elapsed = time.perf_counter() - start
            service = response.timing.service_s if variant.startswith("gpu_work") else 0.0
            times.append(elapsed - service)  # the round trip less the server's own time
        if variant != "unary":
            stream.close()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return times[50:]


async def _time_aio(address: str, trips: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = target_pb2_grpc.TargetServiceStub(channel).Verify()
        times = []
        for _ in range(trips + 50):
            start = time.perf_counter()
            await call.write(common_pb2.DraftBlock())
            response = await call.read()
            times.append(time.perf_counter() - start - response.timing.service_s)
        await call.done_writing()
    return times[50:]


def measure(variant: str, trips: int) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(variant, child), daemon=True)
    proc.start()
    try:
        address = f"127.0.0.1:{parent.recv()}"
        grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
        if variant in ("aio", "gpu_work_aio"):
            times = asyncio.run(_time_aio(address, trips))
        else:
            times = _time_sync(variant, address, trips)
    finally:
        proc.kill()
        proc.join()
    ordered = sorted(times)
    return {"variant": variant, "trips": trips, "ms_median": 1e3 * statistics.median(times),
            "ms_p10": 1e3 * ordered[len(ordered) // 10],
            "ms_p90": 1e3 * ordered[9 * len(ordered) // 10]}  # fmt: skip


def host() -> dict[str, object]:
    info: dict[str, object] = {"cores": os.cpu_count(), "python": platform.python_version(),
                               "grpcio": grpc.__version__}  # fmt: skip
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        mhz = [float(ln.split(":", 1)[1]) for ln in lines if ln.startswith("cpu MHz")]
        info["cpu"] = names[0] if names else "?"
        info["mhz_min_max"] = (min(mhz), max(mhz)) if mhz else None
    governor = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    info["governor"] = governor.read_text().strip() if governor.exists() else None
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=1000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        rows.append(measure(variant, args.trips))
        print(json.dumps(rows[-1]), flush=True)
    result = {"host": host(), "rows": rows}
    print(json.dumps(result["host"]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transport_probe.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
