"""Programmatic dependent launch on and off (SPECDEC_PDL, specdec/gdc.py), measured in one run:
two runners per model (random bf16 weights, Llama-3.2-1B and Llama-3.1-8B), CUDA graphs captured
under each setting, four interleaved rounds of graph steps at batch 1 and 8, decode and verify-5.
Also checks that both give the same logits bit for bit.

Usage: PYTHONPATH=. python bench/runner_pdl_ab.py --out DIR   (GPU)
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rejection_bench import out_dir
from bench.runner_bench import MODELS, build, copy_bandwidth, floor_ms, prefill, runner_step_ms


def main() -> None:
    folder = out_dir()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev, 2**31)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results = {}
    for name in ("Llama-3.2-1B", "Llama-3.1-8B"):
        hf, runners = None, {}
        for flag in ("1", "0"):
            os.environ["SPECDEC_PDL"] = flag
            hf, runner = build(name, MODELS[name], dev, 512, 8, (1, 8), hf=hf)
            ids = prefill(runner, 8, 512, dev)
            runners[flag] = (runner, ids)
            for b, n in ((1, 1), (1, 5), (8, 1)):  # capture the graphs under this setting
                runner_step_ms(runner, ids[:b], n, 512, True, dev, 3)
        del hf
        gc.collect()
        logits = {}
        for flag, (runner, ids) in runners.items():
            os.environ["SPECDEC_PDL"] = flag
            logits[flag] = runner.graph_step(ids[:1], torch.arange(1, 6, device=dev)[None]).clone()
            runner.truncate(ids[0], 512)
        same = torch.equal(logits["1"], logits["0"])
        print(f"{name}: logits equal with PDL on and off: {same}", flush=True)
        for b, n in ((1, 1), (1, 5), (8, 1), (8, 5)):
            times: dict[str, list[float]] = {"1": [], "0": []}
            for _ in range(4):
                for flag in ("1", "0"):
                    os.environ["SPECDEC_PDL"] = flag
                    runner, ids = runners[flag]
                    times[flag].append(runner_step_ms(runner, ids[:b], n, 512, True, dev, 50))
            floor = floor_ms(runners["1"][0], b, n, 512, bandwidth)
            on, off = min(times["1"]), min(times["0"])
            print(f"{name} b{b} n{n}: floor {floor:.3f} ms, PDL on {on:.3f} ({on / floor:.3f}x), "
                  f"off {off:.3f} ({off / floor:.3f}x)", flush=True)  # fmt: skip
            results[f"{name} b{b} n{n}"] = dict(floor=floor, on=times["1"], off=times["0"])
        results[f"{name} logits equal"] = same
        del runners
        gc.collect()
        torch.cuda.empty_cache()
    (folder / "runner_pdl_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
