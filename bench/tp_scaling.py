"""The target's step time split over N GPUs (tensor parallelism) against one GPU, one machine.

For each N of --tp, in a child process of its own (all its device memory returned after): the
target of --pair (random weights at the released shapes, `e2e_models`) loaded with
`tensor_parallel=N` on cuda:0 .. cuda:N-1, requests prefilled to --ctx tokens of KV, then the
mean time of a CUDA graph decode step (n = 1) and verify step (n = k + 1) at each batch
(`runner_bench.runner_step_ms`: host work included, as a service's step has it), and the memory
each GPU holds with the model loaded and the graphs captured (nvidia-smi). The report gives
each N's times over N = 1's: two GPUs' bandwidth would give 0.5, less what the all-reduces
(two per layer) and the head's all-gather cost.

    PYTHONPATH=. python bench/tp_scaling.py --out bench/results        # GPU: 8B at N = 1, 2
    PYTHONPATH=. python bench/tp_scaling.py --smoke --out /tmp/tp      # CPU, tiny model, gloo
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench import e2e_models, provenance
from bench.e2e_inprocess import _load, environment
from bench.runner_bench import prefill, runner_step_ms

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def gpu_memory_mib() -> list[int]:
    """MiB in use on each GPU (every process's), from nvidia-smi; [] without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in out.split()]


def _dump_ranks_later(after_s: float) -> None:
    """After `after_s`, the other ranks (this process's children) dump their threads' stacks
    to stderr (SIGUSR1: `parallel._worker`), so that a size whose run hangs says where."""

    def dump() -> None:
        time.sleep(after_s)
        for child in multiprocessing.active_children():
            if child.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGUSR1)

    threading.Thread(target=dump, name="dump-ranks", daemon=True).start()


def measure(job: dict[str, Any]) -> None:
    """One N, in a child process: prints its step times ("n,b" → ms) and each GPU's memory as
    one JSON line before the ranks are stopped, so that a stop that hangs keeps the figures
    (the parent reports it); where the process waits is dumped to stderr before its time is
    up."""
    faulthandler.dump_traceback_later(max(1.0, job["timeout_s"] - 15), exit=False)
    _dump_ranks_later(max(1.0, job["timeout_s"] - 20))
    tp, batches, ctx = job["tp"], job["batches"], job["ctx"]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    t0 = time.perf_counter()
    sizes = [s for s in GRAPH_SIZES if s <= max(batches)]
    runner = _load(job["path"], device, job["dtype"], max(batches), ctx + 64, sizes, tp)
    load_s = time.perf_counter() - t0
    try:
        ids = prefill(runner, max(batches), ctx, dev)
        steps = {}
        for b in batches:
            for n in (1, job["k"] + 1):
                steps[f"{n},{b}"] = runner_step_ms(runner, ids[:b], n, ctx, True, dev, job["iters"])
        memory = gpu_memory_mib()
        row = {"tp": tp, "load_s": round(load_s, 1), "ms": steps, "gpu_memory_mib": memory}
        print(json.dumps(row), flush=True)
    finally:
        t0 = time.perf_counter()
        runner.close()  # the other ranks
        print(json.dumps({"close_s": round(time.perf_counter() - t0, 2)}), flush=True)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def child(job: dict[str, Any], job_file: str) -> dict[str, Any]:
    """Runs `measure` for one N in a process of its own; its row, with "error" where it
    failed (a model too big for one GPU, say: the other sizes still run) and "stop_hung"
    where it measured but did not end within the job's timeout_s."""
    cmd = [sys.executable, "-m", "bench.tp_scaling", "--child", job_file]
    repo = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=repo,
                              timeout=job["timeout_s"])  # fmt: skip
        out, err, failed = done.stdout, done.stderr, done.returncode != 0
        end = f"exit {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        out, err, failed = _text(exc.stdout), _text(exc.stderr), True
        end = f"killed after {job['timeout_s']:.0f} s"
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    row = next((x for x in lines if "ms" in x), None)
    if failed:
        print(f"N = {job['tp']} failed or hung:\n{err[-6000:]}", file=sys.stderr)
    if row is None:
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return {"tp": job["tp"], "error": tail[0]}
    closed = next((x["close_s"] for x in lines if "close_s" in x), None)
    row |= {"close_s": closed} if closed is not None else {"stop_hung": True}
    return row | {"process_end": end}  # "killed ..." past close_s: its exit hung


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    cache = Path(args.cache)
    device = "cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu"
    paths = e2e_models.build(cache, args.smoke, device, args.pair)
    dtype = "float32" if args.smoke else "bfloat16"
    rows = []
    for tp in tqdm(args.tp, desc="tensor-parallel sizes", unit="N"):
        job = {"tp": tp, "path": paths["target"], "dtype": dtype, "batches": args.batches,
               "ctx": args.ctx, "k": args.num_draft_tokens, "iters": args.iters,
               "timeout_s": args.child_timeout_s}  # fmt: skip
        with open(args.out / f"tp_scaling_N{tp}.job.json", "w") as f:
            json.dump(job, f)
        rows.append(child(job, f.name))
    env = environment() if torch.cuda.is_available() else {"gpu": "cpu"}
    settings = {"batches": args.batches, "ctx": args.ctx, "k": args.num_draft_tokens,
                "iters": args.iters, "dtype": dtype}  # fmt: skip
    return {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": provenance.commit(),
        "environment": env,
        "pair": args.pair,
        "target": e2e_models.PAIRS[args.pair][0] if not args.smoke else e2e_models.SMOKE_TARGET,
        "settings": settings,
        "rows": rows,
    }


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    base = next((r for r in result["rows"] if r["tp"] == 1 and "ms" in r), None)
    lines = [
        f"Target {result['target']} split over N GPUs ({result['environment']['gpu']}, commit "
        f"{result['commit'][:7]}, {result['date']}): mean ms of a CUDA graph step "
        f"(`ModelRunner.graph_step`, host work included), {s['ctx']} tokens of KV per "
        f"request, {s['dtype']}; in brackets, over N = 1.",
        "",
        "| N | batch | decode (n = 1) | verify (n = " + str(s["k"] + 1) + ") |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['tp']} | failed: {r['error']} | | |")
            continue
        for b in s["batches"]:
            cells = []
            for n in (1, s["k"] + 1):
                ms = r["ms"][f"{n},{b}"]
                ratio = f" ({ms / base['ms'][f'{n},{b}']:.2f}x)" if base and r is not base else ""
                cells.append(f"{ms:.3f}{ratio}")
            lines.append(f"| {r['tp']} | {b} | {cells[0]} | {cells[1]} |")
    lines += ["", "Memory in use per GPU with the model loaded and its graphs captured (MiB, "
              "nvidia-smi, every process):", ""]  # fmt: skip
    for r in (r for r in result["rows"] if "error" not in r):
        stop = "did not end (hung)" if r.get("stop_hung") else f"{r.get('close_s')} s"
        stop += f", process {r.get('process_end', '?')}"
        lines.append(f"- N = {r['tp']}: {r['gpu_memory_mib'] or 'no GPU'} (load {r['load_s']} s, "
                     f"stop {stop})")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--cache", default=str(e2e_models.DEFAULT_CACHE))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (gloo)")
    p.add_argument("--pair", choices=sorted(e2e_models.PAIRS), default=e2e_models.DEFAULT_PAIR)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="the sizes N compared")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ctx", type=int, default=1024, help="tokens of KV per request")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--child-timeout-s", type=float, default=900.0,
                   help="one size's whole run: load, steps and stop")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.ctx, args.iters, args.batches = min(args.ctx, 32), min(args.iters, 3), [1, 4]
    bad = [n for n in args.tp if n < 1]
    if bad or 1 not in args.tp:
        p.error("--tp takes sizes of at least 1, and 1 among them (the baseline)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        measure(json.loads(Path(args.child).read_text()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    name = result["environment"]["gpu"].replace(" ", "_")
    stem = args.out / f"tp_scaling_{args.pair}_{name}"
    provenance.save(stem, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
