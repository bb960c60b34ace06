"""What a served step pays to start a captured graph: per model (random bf16 weights, the
benchmark's Llama-3.2-1B draft and Llama-3.1-8B target), per step shape, and with programmatic
dependent launch on and off (SPECDEC_PDL, graphs captured under each):

- back to back: graph steps queued one after another (the runner benchmark's figure: the host's
  launch cost hides behind the GPU's work);
- alone: a synchronised GPU, then one graph step (`ModelRunner.graph_step`: the inputs' copies
  into the graph's buffers, then the launch), then a wait: what a served step pays each time it
  starts its forwards on an idle GPU, as the target's verify and the draft's pass ahead do;
- its host part: the `graph_step` call alone, and the replay (cudaGraphLaunch) alone.

"exposed" = alone - back to back: the start-up a served step adds to the device time.

Usage: PYTHONPATH=. python bench/experiments/graph_launch_probe.py --out DIR   (GPU)
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.runner_bench import MODELS, build, prefill, runner_step_ms
from specdec.runner import ModelRunner

STEPS = ((1, 1), (2, 1), (1, 5), (8, 1), (8, 5), (16, 1))
CTX = 256
REPEATS = 40


def alone(runner: ModelRunner, ids: list[str], n: int, dev: torch.device) -> dict[str, float]:
    """Median ms of REPEATS single graph steps on an idle GPU: the whole (call to done), the
    call's host time, and the replay's host time alone."""
    tokens = torch.randint(0, 1000, (len(ids), n), device=dev)
    whole, host, replay = [], [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize(dev)
        a = time.perf_counter()
        runner.graph_step(ids, tokens)
        b = time.perf_counter()
        torch.cuda.synchronize(dev)
        c = time.perf_counter()
        whole.append((c - a) * 1e3)
        host.append((b - a) * 1e3)
        for rid in ids:
            runner.truncate(rid, CTX)
    graphs = runner._graphs
    assert graphs is not None
    bs = graphs.padded_size(len(ids))
    graph = next(g for (size, width, head, *_), g in graphs._graphs.items()
                 if size == bs and width == n and head is None)  # fmt: skip
    for _ in range(REPEATS):
        torch.cuda.synchronize(dev)
        a = time.perf_counter()
        graph.graph.replay()
        b = time.perf_counter()
        torch.cuda.synchronize(dev)
        replay.append((b - a) * 1e3)
    return {
        "alone_ms": statistics.median(whole),
        "call_host_ms": statistics.median(host),
        "replay_host_ms": statistics.median(replay),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sizes = tuple(sorted({b for b, _ in STEPS}))
    slots = max(sizes)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(dev)}
    for name in ("Llama-3.2-1B", "Llama-3.1-8B"):
        hf = None
        for flag in ("1", "0"):
            os.environ["SPECDEC_PDL"] = flag
            hf, runner = build(name, MODELS[name], dev, CTX, slots, sizes, hf=hf)
            ids = prefill(runner, slots, CTX, dev)
            for b, n in STEPS:
                back = runner_step_ms(runner, ids[:b], n, CTX, True, dev, 50)
                row = {"back_to_back_ms": back, **alone(runner, ids[:b], n, dev)}
                row["exposed_ms"] = row["alone_ms"] - back
                results[f"{name} b{b} n{n} pdl={flag}"] = row
                print(f"{name} b{b} n{n} PDL {'on' if flag == '1' else 'off'}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)  # fmt: skip
            del runner
            gc.collect()
            torch.cuda.empty_cache()
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    path = args.out / f"graph_launch_{torch.cuda.get_device_name(dev).replace(' ', '_')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
