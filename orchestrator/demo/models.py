"""The demo's model pair, trained on this machine on text that ships with Python.

`build_demo_models` trains, once, a byte-level BPE tokenizer, a small Llama target and a
smaller Llama draft on the standard library's top-level `.py` sources, and caches both
checkpoints under `~/.cache/specdec/demo/<key>/` (`SPECDEC_CACHE_DIR` or `XDG_CACHE_HOME` move
it). The key hashes the recipe: the budget, the source files and the library versions whose
output it depends on. The draft is distilled from the target (trained on the target's
next-token distributions, as DistillSpec does, arXiv:2310.08461) rather than on the text, which
is what makes its greedy guesses agree with the target's.

torch is imported only inside functions, so `import orchestrator` stays torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from orchestrator.demo import training
from orchestrator.demo.budget import DemoBudget, DemoPair, LlamaShape
from orchestrator.demo.training import AcceptanceReport, measure_acceptance

__all__ = [
    "AcceptanceReport",
    "DemoBudget",
    "DemoPair",
    "LlamaShape",
    "build_demo_models",
    "measure_acceptance",
]

# bump when the training code changes what a cached pair contains (3: phases end by step
# count only, so every machine trains the same pair; 2's pairs were cut short by a time limit)
RECIPE_VERSION = 3
HELDOUT_EVERY = 20  # a source file is held out when the hash of its name is 0 mod this


def cache_root() -> Path:
    if env := os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec"


def source_files(corpus_bytes: int = 0) -> list[Path]:
    """The standard library's top-level `.py` files in name order (first `corpus_bytes`)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # _sysconfigdata*.py is this machine's build configuration, not source anyone wrote
    files = sorted(
        (f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata")),
        key=lambda p: p.name,
    )
    if corpus_bytes:
        kept, total = [], 0
        for f in files:
            if total >= corpus_bytes:
                break
            kept.append(f)
            total += f.stat().st_size
        files = kept
    return files


def is_heldout(path: Path) -> bool:
    return int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def recipe(budget: DemoBudget, device: str = "cpu") -> dict[str, Any]:
    files = source_files(budget.corpus_bytes)
    versions = {m: metadata.version(m) for m in ("torch", "transformers", "tokenizers")}
    out = {
        "recipe_version": RECIPE_VERSION,
        "budget": asdict(budget),
        "python": sys.version.split()[0],
        "files": [[f.name, f.stat().st_size] for f in files],
        "versions": versions,
    }
    if device != "cpu":  # trained elsewhere (a GPU's numerics): a pair of its own
        out["device"] = device.split(":")[0]
    return out


def cache_key(budget: DemoBudget, device: str = "cpu") -> str:
    blob = json.dumps(recipe(budget, device), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_demo_models(
    cache_dir: Path | None = None,
    *,
    budget: DemoBudget | None = None,
    progress: bool = True,
    device: str = "cpu",
) -> DemoPair:
    """The cached pair for `budget`, trained on `device` first if absent (atomically: an
    interrupted build leaves only a temporary directory, never a half cache entry)."""
    budget = budget or DemoBudget()
    parent = (cache_dir or cache_root()) / "demo"
    final = parent / cache_key(budget, device)
    if (final / "training.json").is_file():
        return DemoPair(final, final / "target", final / "draft")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=parent))
    try:
        files = [f for f in source_files(budget.corpus_bytes) if not is_heldout(f)]
        stats = training.train_pair(tmp, budget, files, progress, device)
        stats["recipe"] = recipe(budget, device)
        (tmp / "training.json").write_text(json.dumps(stats, indent=1))
        try:
            tmp.rename(final)
        except OSError:  # another process finished the same key first; keep theirs
            if not (final / "training.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return DemoPair(final, final / "target", final / "draft")


def main() -> int:
    """python -m orchestrator.demo.models [--quick]: build (or find) the pair, then measure it."""
    quick = "--quick" in sys.argv[1:]
    t0 = time.perf_counter()
    pair = build_demo_models(budget=DemoBudget.ci() if quick else DemoBudget())
    print(f"pair in {pair.root} ({time.perf_counter() - t0:.1f} s)")
    prompts = training.heldout_prompts(source_files(), is_heldout, count=16)
    report = measure_acceptance(pair, prompts, k=4, new_tokens=64)
    stats = {k: v for k, v in pair.training.items() if k != "recipe"}
    print(json.dumps(stats | {"acceptance": asdict(report)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
