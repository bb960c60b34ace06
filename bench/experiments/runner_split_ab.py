"""Split-K in the skinny products (`gemv.skinny_shape`'s split_k, the 1B's down projection) on
and off, measured in one run: two runners per model (random bf16 weights, Llama-3.2-1B and
Llama-3.1-8B), CUDA graphs captured under each rule, four interleaved rounds of graph steps at
batch 1 and 8, decode and verify-5. Also reports how far apart their logits are (split sums add
in another order) and whether the argmax agrees.

Usage: PYTHONPATH=. python bench/experiments/runner_split_ab.py --out DIR   (GPU)
"""

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import runner_bench as rb
from bench.rejection_bench import out_dir
from specdec.runner import gemv

RULE = gemv.skinny_shape


def unsplit(n: int, k: int, itemsize: int = 2, split: bool = True) -> gemv.SkinnyShape:
    """The rule before split-K: one program per column block, whatever `split` asks."""
    return RULE(n, k, itemsize, split=False)


def main() -> None:
    folder = out_dir()
    dev = torch.device("cuda")
    bandwidth = rb.copy_bandwidth(dev, 2**31)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name()}
    name = "Llama-3.2-1B"  # the only model of the two with a split shape (down: 2048 x 8192)
    hf, runners = None, {}
    for variant in ("split", "unsplit"):
        gemv.skinny_shape = RULE if variant == "split" else unsplit  # read when graphs capture
        hf, runner = rb.build(name, rb.MODELS[name], dev, 512, 8, (1, 8), hf=hf)
        ids = rb.prefill(runner, 8, 512, dev)
        runners[variant] = (runner, ids)
        for b, n in ((1, 1), (1, 5), (8, 1)):  # capture this variant's graphs
            rb.runner_step_ms(runner, ids[:b], n, 512, True, dev, 3)
    gemv.skinny_shape = RULE
    del hf
    gc.collect()
    logits = {}
    for variant, (runner, ids) in runners.items():
        tokens = torch.arange(1, 6, device=dev)[None]
        out = runner.graph_step(ids[:1], tokens)
        assert isinstance(out, torch.Tensor)
        logits[variant] = out.float().clone()
        runner.truncate(ids[0], 512)
    a, b_ = logits["split"], logits["unsplit"]
    diff = ((a - b_).abs().max() / b_.abs().max()).item()
    argmax_same = torch.equal(a.argmax(-1), b_.argmax(-1))
    print(f"{name}: logits max |split - unsplit| / max |unsplit| = {diff:.2e}, argmax equal: "
          f"{argmax_same}", flush=True)  # fmt: skip
    results[f"{name} logits"] = {"max_rel_diff": diff, "argmax_equal": argmax_same}
    for b, n in ((1, 1), (1, 5), (8, 1)):
        times = rb.interleaved_ms(runners, b, n, dev)
        floor = rb.floor_ms(runners["split"][0], b, n, 512, bandwidth)
        on, off = min(times["split"]), min(times["unsplit"])
        print(f"{name} b{b} n{n}: floor {floor:.3f} ms, split {on:.3f} ({on / floor:.3f}x), "
              f"unsplit {off:.3f} ({off / floor:.3f}x)", flush=True)  # fmt: skip
        results[f"{name} b{b} n{n}"] = dict(floor=floor, **times)
    (folder / "runner_split_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
