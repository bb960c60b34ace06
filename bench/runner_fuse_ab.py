"""The norms and silu * up inside the skinny products' launches (`gemv.norm_linear`,
`gemv.gated_linear`) against the separate kernels, measured in one run: two runners per model
(random bf16 weights, Llama-3.2-1B and Llama-3.1-8B), CUDA graphs captured for each, four
interleaved rounds of graph steps at batch 1 and 8, decode and verify-5. Also reports how far
apart the two give the logits (the fused norm sums its squares in another order, so bits may
differ) and whether their argmax agrees.

Usage: PYTHONPATH=. python bench/runner_fuse_ab.py --out DIR   (GPU)
"""

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rejection_bench import out_dir
from bench.runner_bench import MODELS, build, copy_bandwidth, floor_ms, prefill, runner_step_ms


def unfuse(runner: object) -> None:
    """The separate launches: add + norm, then the product; silu * up, then the product."""
    model = runner._backend.model  # type: ignore[attr-defined]
    model._norm_linear = model._norm_then_linear
    model._gated_linear = model._silu_then_linear


def main() -> None:
    folder = out_dir()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev, 2**31)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name()}
    for name in ("Llama-3.2-1B", "Llama-3.1-8B"):
        hf, runners = None, {}
        for variant in ("fused", "separate"):
            hf, runner = build(name, MODELS[name], dev, 512, 8, (1, 8), hf=hf)
            if variant == "separate":
                unfuse(runner)
            ids = prefill(runner, 8, 512, dev)
            runners[variant] = (runner, ids)
            for b, n in ((1, 1), (1, 5), (8, 1), (8, 5)):  # capture this variant's graphs
                runner_step_ms(runner, ids[:b], n, 512, True, dev, 3)
        del hf
        gc.collect()
        logits = {}
        for variant, (runner, ids) in runners.items():
            logits[variant] = runner.graph_step(ids[:1], torch.arange(1, 6, device=dev)[None])
            logits[variant] = logits[variant].float().clone()
            runner.truncate(ids[0], 512)
        a, b_ = logits["fused"], logits["separate"]
        diff = ((a - b_).abs().max() / b_.abs().max()).item()
        argmax_same = torch.equal(a.argmax(-1), b_.argmax(-1))
        print(f"{name}: logits max |fused - separate| / max |separate| = {diff:.2e}, "
              f"argmax equal: {argmax_same}", flush=True)  # fmt: skip
        results[f"{name} logits"] = {"max_rel_diff": diff, "argmax_equal": argmax_same}
        for b, n in ((1, 1), (1, 5), (8, 1), (8, 5)):
            times: dict[str, list[float]] = {"fused": [], "separate": []}
            for _ in range(4):
                for variant in ("fused", "separate"):
                    runner, ids = runners[variant]
                    times[variant].append(runner_step_ms(runner, ids[:b], n, 512, True, dev, 50))
            floor = floor_ms(runners["fused"][0], b, n, 512, bandwidth)
            on, off = min(times["fused"]), min(times["separate"])
            print(f"{name} b{b} n{n}: floor {floor:.3f} ms, fused {on:.3f} ({on / floor:.3f}x), "
                  f"separate {off:.3f} ({off / floor:.3f}x)", flush=True)  # fmt: skip
            results[f"{name} b{b} n{n}"] = dict(floor=floor, **times)
        del runners
        gc.collect()
        torch.cuda.empty_cache()
    (folder / "runner_fuse_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
