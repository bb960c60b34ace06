"""Draft-ahead's real hit rate on a real pair: how often the verdict of a step is one the draft
drafted ahead for (draft_service.ahead), with its acceptance, per fan-out F and temperature.

The demo pair (trained here on CPU and cached, `specdec demo`) serves the Python prompts through
both services over real gRPC on loopback (`bench.local`, one process), k = 4. A hit is an
ask answered from a chain drafted ahead; every other ask is drafted after its verdict as in
lock-step. Greedy output is checked against draft-ahead off (it must be identical).

    PYTHONPATH=. python bench/draft_ahead_hits.py --out bench/results      # CPU, a few minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

from tqdm import tqdm

from bench.local import local_pair
from draft_service.config import DraftConfig
from orchestrator.demo import PROMPTS
from orchestrator.demo_models import DemoBudget, build_demo_models
from specdec.runner import RunnerConfig
from specdec.sampling_params import SamplingParams
from target_service.config import TargetConfig


def run_one(pair: object, fanout: int, temperature: float, k: int, tokens: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair.target), local_files_only=True)  # type: ignore[attr-defined]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    slots = len(prompts)
    ahead_slots = fanout * (k + 1) * slots
    draft = DraftConfig(
        runner=RunnerConfig(str(pair.draft), max_slots=slots + ahead_slots, max_seq_len=128),  # type: ignore[attr-defined]
        draft_ahead=fanout, draft_ahead_slots=ahead_slots,
    )  # fmt: skip
    target = TargetConfig(RunnerConfig(str(pair.target), max_slots=slots, max_seq_len=128),  # type: ignore[attr-defined]
                          sampler_impl="torch")  # fmt: skip
    with local_pair(draft, target) as svc:
        pipe = svc.pipeline()
        ids = [f"p{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            pipe.admit(rid, prompt, SamplingParams(temperature, seed=1234 + i))
        pipe.generate(dict.fromkeys(ids, k), tokens)
        out = [pipe.requests[r].generated[:tokens] for r in ids]
        accepted = sum(r.num_accepted for r in pipe.requests.values())
        drafted = sum(r.num_draft_tokens for r in pipe.requests.values())
        pipe.close()
        engine = svc.draft_engine
        asks = engine.ahead_hits + engine.ahead_misses
    return {
        "fanout": fanout, "temperature": temperature, "k": k, "tokens": tokens,
        "hits": engine.ahead_hits, "asks_with_chains": asks,
        "hit_rate": engine.ahead_hits / asks if asks else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "output": out,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    args = p.parse_args()
    pair = build_demo_models(None, budget=DemoBudget())
    rows = []
    configs = [(t, f) for t in args.temperatures for f in [0, *args.fanouts]]
    for t, f in tqdm(configs, desc="draft-ahead hit rates"):
        rows.append(run_one(pair, f, t, args.k, args.tokens))
    for r in rows:  # draft-ahead never changes a seeded output
        base = next(b for b in rows if b["temperature"] == r["temperature"] and b["fanout"] == 0)
        r["same_output_as_off"] = r["output"] == base["output"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    machine = f"{platform.machine()} CPU, {platform.processor() or 'unknown'}, float32"
    lines = [
        f"Draft-ahead hit rate on the demo pair (commit {commit}, {machine}), k = {args.k}, "
        f"{len(PROMPTS)} prompts x {args.tokens} tokens, seeded:",
        "",
        "| temperature | F | hit rate | hits / asks | acceptance rate | output same as off |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["fanout"] == 0:
            continue
        lines.append(
            f"| {r['temperature']} | {r['fanout']} | {r['hit_rate']:.3f} | "
            f"{r['hits']} / {r['asks_with_chains']} | {r['acceptance_rate']:.3f} | "
            f"{r['same_output_as_off']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_ahead_hits_cpu.md").write_text(text)
    for r in rows:
        del r["output"]
    (args.out / "draft_ahead_hits_cpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
