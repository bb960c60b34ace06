"""Where the race's time goes (GPU): `_decide_sample_kernel` time with parts of the race
replaced by cheap stand-ins, so each part's cost shows as the difference. The variants are
copies of target_service/kernels.py with one or more source lines replaced (their outputs are
wrong on purpose; only their timing is read). Also reports registers and spills.

Usage: python bench/experiments/rejection_ablation.py --out DIR
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rejection_bench import make_inputs, out_dir
from target_service import kernels

PHILOX = (
    "bits = _vocab_bits(seed, off, pos, stream, BLOCK)",
    "bits = offs.to(tl.uint32) * 2654435761",
)
LOG = (
    "expo = -tl.log(((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0))",
    "expo = ((bits >> 9).to(tl.float32) + 0.5)",
)
EXP = (
    "p = tl.where(mask & (logit >= thr), tl.exp(logit * inv_t - row_max) / row_sum, 0.0)",
    "p = tl.where(mask & (logit >= thr), logit, 0.0)",
)
VARIANTS = {
    "as is": [],
    "no Philox (multiply-hash)": [PHILOX],
    "no log in E": [LOG],
    "no exp in p": [EXP],
    "none of the three": [PHILOX, LOG, EXP],
}
CAPTURE = (  # keep the decide launch's compiled kernel, for its register count
    "    _decide_sample_kernel[(batch, n_race)](",
    "    global LAST\n    LAST = _decide_sample_kernel[(batch, n_race)](",
)


def variant(index: int, replacements: list[tuple[str, str]], tmp: Path) -> ModuleType:
    source = Path(kernels.__file__).read_text()
    for old, new in [*replacements, CAPTURE]:
        assert old in source, old
        source = source.replace(old, new)
    name = f"kernels_ablation_{index}"
    path = tmp / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def kernel_us(module: ModuleType, x: kernels.KernelInputs) -> dict[str, float]:
    """Mean device time per launch of each kernel over 15 calls (torch.profiler)."""
    for _ in range(3):
        module.rejection_sample_triton(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(15):
            module.rejection_sample_triton(x)
        torch.cuda.synchronize()
    return {
        e.key: round(e.device_time_total / e.count, 1)
        for e in prof.key_averages()
        if e.key.startswith("_") and e.key.endswith("_kernel")
    }


def main() -> None:
    out = out_dir()
    tmp = Path(tempfile.mkdtemp(prefix="rejection_ablation_"))
    modules = {name: variant(i, r, tmp) for i, (name, r) in enumerate(VARIANTS.items())}
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name()}
    for batch, k, q_form in ((64, 4, "dense"), (64, 1, "none"), (8, 4, "dense")):
        x, _ = make_inputs(batch, k, 128256, q_form)
        for name, module in modules.items():
            times = kernel_us(module, x)
            last = module.LAST
            regs = {"regs": getattr(last, "n_regs", 0), "spills": getattr(last, "n_spills", 0)}
            report[f"B={batch} k={k} {q_form} / {name}"] = {"kernel_us": times, **regs}
            print(f"B={batch} k={k} {q_form} / {name}: {times} {regs}", flush=True)
        del x
        torch.cuda.empty_cache()
    (out / "rejection_ablation.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
