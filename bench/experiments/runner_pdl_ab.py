"""Programmatic dependent launch on and off (SPECDEC_PDL, specdec/gdc.py), measured in one run:
two runners per model (random bf16 weights, Llama-3.2-1B and Llama-3.1-8B), CUDA graphs captured
under each setting, four interleaved rounds of graph steps at batch 1 and 8, decode and verify-5.
Also checks that both give the same logits bit for bit.

With --wide: the 1B only, at batch 32 x 5 tokens and 64 x 1 and x 5, where the runner turns PDL
off above gdc.PDL_MAX_TOKENS tokens per step (so "on" there shows what that rule leaves).

Usage: PYTHONPATH=. python bench/experiments/runner_pdl_ab.py --out DIR [--wide]   (GPU)
"""

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.runner_bench import (
    MODELS,
    build,
    copy_bandwidth,
    floor_ms,
    interleaved_ms,
    prefill,
    runner_step_ms,
)


def set_pdl(flag: str) -> None:
    os.environ["SPECDEC_PDL"] = flag


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wide", action="store_true", help="1B at batch 32 and 64")
    args = parser.parse_args()
    folder: Path = args.out
    folder.mkdir(parents=True, exist_ok=True)
    models = ("Llama-3.2-1B",) if args.wide else ("Llama-3.2-1B", "Llama-3.1-8B")
    slots, sizes = (64, (32, 64)) if args.wide else (8, (1, 8))
    steps = ((32, 5), (64, 1), (64, 5)) if args.wide else ((1, 1), (1, 5), (8, 1), (8, 5))
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev, 2**31)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results: dict[str, object] = {}
    for name in models:
        hf, runners = None, {}
        for flag in ("1", "0"):
            os.environ["SPECDEC_PDL"] = flag
            hf, runner = build(name, MODELS[name], dev, 512, slots, sizes, hf=hf)
            ids = prefill(runner, slots, 512, dev)
            runners[flag] = (runner, ids)
            for b, n in steps:  # capture the graphs under this setting
                runner_step_ms(runner, ids[:b], n, 512, True, dev, 3)
        del hf
        gc.collect()
        logits = {}
        for flag, (runner, ids) in runners.items():
            os.environ["SPECDEC_PDL"] = flag
            out = runner.graph_step(ids[:1], torch.arange(1, 6, device=dev)[None])
            assert isinstance(out, torch.Tensor)
            logits[flag] = out.clone()
            runner.truncate(ids[0], 512)
        same = torch.equal(logits["1"], logits["0"])
        print(f"{name}: logits equal with PDL on and off: {same}", flush=True)
        for b, n in steps:
            times = interleaved_ms(runners, b, n, dev, set_pdl)
            floor = floor_ms(runners["1"][0], b, n, 512, bandwidth)
            on, off = min(times["1"]), min(times["0"])
            print(f"{name} b{b} n{n}: floor {floor:.3f} ms, PDL on {on:.3f} ({on / floor:.3f}x), "
                  f"off {off:.3f} ({off / floor:.3f}x)", flush=True)  # fmt: skip
            results[f"{name} b{b} n{n}"] = dict(floor=floor, on=times["1"], off=times["0"])
        results[f"{name} logits equal"] = same
        del runners
        gc.collect()
        torch.cuda.empty_cache()
    file = "runner_pdl_ab_wide.json" if args.wide else "runner_pdl_ab.json"
    (folder / file).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
