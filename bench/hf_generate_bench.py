"""The runner's baseline in one run: transformers' eager `generate` per token vs the runner's
graph-replayed decode step, same random bf16 weights, batch 1, 512-token prompt (GPU).

Per token = (time of generate with 1 + N new tokens - time with 1 new token) / N, so the prompt's
prefill is left out. Usage: python bench/hf_generate_bench.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runner_bench import MODELS, SMOKE, build, prefill, runner_step_ms


def generate_ms_per_token(hf: Any, ctx: int, new: int, dev: torch.device) -> float:
    prompt = torch.randint(0, 1000, (1, ctx), device=dev)

    def run(tokens: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    run(4)  # warm-up
    short = min(run(1) for _ in range(3))
    long = min(run(1 + new) for _ in range(3))
    return (long - short) / new


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if args.smoke else "cuda")
    models = {"smoke": SMOKE} if args.smoke else MODELS
    ctx = 32 if args.smoke else 512
    rows = []
    for name, spec in models.items():
        hf, runner = build(name, spec, dev, ctx, 1, (1,) if dev.type == "cuda" else ())
        hf.generation_config.pad_token_id = 0
        ids = prefill(runner, 1, ctx, dev)
        ours = runner_step_ms(runner, ids, 1, ctx, dev.type == "cuda", dev, iters=20)
        theirs = generate_ms_per_token(hf, ctx, args.new_tokens, dev)
        rows.append({"model": name, "runner_decode_ms": ours, "hf_generate_ms_per_token": theirs,
                     "speedup": theirs / ours})  # fmt: skip
        print(f"{name}: runner {ours:.3f} ms, HF generate {theirs:.3f} ms/token, "
              f"{theirs / ours:.1f}x", flush=True)  # fmt: skip
        del hf, runner
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    (args.out / "hf_generate.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
