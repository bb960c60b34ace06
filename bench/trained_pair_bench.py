"""The served system with real acceptance: a target and a draft distilled from it, trained here,
through `specdec serve` and the client at temperature 0 and above.

1. The pair: `orchestrator.demo.models.build_demo_models` with a larger budget (on a GPU about
   100M and 15M parameters, a byte-level BPE of 8,192 ids, trained on the standard library's
   top-level sources under bfloat16 autocast; the draft distilled from the target's
   distributions), cached by content like the demo's pair. With --smoke, the demo's tiny CI
   budget on the CPU.
2. Rows: for each --temperatures and --batches, B concurrent streams of held-out source
   prompts (seeded where sampled), target-only, lock-step speculation and draft-ahead (F =
   --draft-ahead guesses per position; with --saguaro-scale, Saguaro sampling as well) and,
   with --dynamic, lock-step under dynamic speculation (unseeded: a seeded sampled request
   keeps its k), each served by `specdec serve` on the pair (split: draft and target on a
   GPU each; one GPU or the CPU: shared). No synthetic acceptance: every accepted token is
   the draft's.
   Reported per row: tokens/s over the window (from when every stream has --warmup
   responses to when the first one finishes; the median of --repeats windows of the same
   streams, their range beside it), over target-only's at the same temperature and batch;
   the mean acceptance length L (1 + accepted / steps that drafted) and, drafting ahead, the
   hit rate (asks answered from chains drafted ahead / asks), from /metrics.

    PYTHONPATH=. python bench/trained_pair_bench.py --out bench/results       # GPU(s)
    PYTHONPATH=. python bench/trained_pair_bench.py --smoke --out /tmp/tp      # CPU, tiny pair
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import product
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench import provenance
from bench.e2e_serve import (
    Serve,
    bench_settings,
    scrape,
    serving,
    streaming,
    wait_idle,
    wait_until,
)
from orchestrator.demo.budget import DemoBudget, LlamaShape
from orchestrator.demo.models import build_demo_models, cache_root, is_heldout, source_files
from orchestrator.demo.training import heldout_prompts

# about 100M (target) and 15M (draft) parameters with 8,192 ids
TRAINED = DemoBudget(
    vocab_size=8192, seq_len=512, batch_size=32,
    target=LlamaShape(12, 768, 12, 4, 2048), draft=LlamaShape(2, 512, 8, 4, 1536),
    target_steps=3000, draft_steps=1500, lr=1e-3,
)  # fmt: skip
CONFIGS = ("target_only", "lockstep", "ahead", "dynamic")


def budget_for(args: argparse.Namespace) -> DemoBudget:
    if args.smoke:
        return DemoBudget.ci()
    from dataclasses import replace

    return replace(TRAINED, target_steps=args.target_steps, draft_steps=args.draft_steps)


def _settings(args: argparse.Namespace, pair: Any, budget: DemoBudget) -> dict[str, Any]:
    paths = {"target": str(pair.target), "draft": str(pair.draft)}
    slots = max(args.batches)
    graphs = [b for b in (1, 2, 4, 8, 16, 32) if b <= slots]
    s = bench_settings(args.device == "cpu", paths, slots, budget.seq_len,
                       args.num_draft_tokens, graphs, 0)  # fmt: skip
    return s | {"draft_ahead": args.draft_ahead}


def serve_starts(args: argparse.Namespace) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """(name, `specdec serve` flags, the configs it serves) per serve start: target-only and
    lock-step; draft-ahead; with --dynamic, lock-step under dynamic speculation (its rows'
    sampled requests unseeded, since a seeded sampled request keeps its k)."""
    ahead = ["--draft-ahead", str(args.draft_ahead)]
    if args.saguaro_scale != 1:
        ahead += ["--saguaro-scale", str(args.saguaro_scale)]
    if args.spread:
        ahead += ["--draft-ahead-spread"]
    starts = [("serve_trained", [], ("target_only", "lockstep")),
              ("serve_trained_ahead", ahead, ("ahead",))]  # fmt: skip
    if args.dynamic:
        starts.append(("serve_trained_dynamic", ["--dynamic-speculation"], ("dynamic",)))
    return starts


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(f"specdec:{name}", 0.0) - before.get(f"specdec:{name}", 0.0)


def measure(
    serve: Serve, config: str, temperature: float, batch: int, prompts: list[str],
    args: argparse.Namespace, repeat: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """B streams to --new-tokens each; the window's tokens/s, L and hit rate."""
    base: dict[str, Any] = {"max_tokens": args.new_tokens, "ignore_eos": True,
                            "temperature": temperature,
                            "proposer": "off" if config == "target_only" else "draft"}  # fmt: skip
    if config != "target_only":
        base["num_draft_tokens"] = args.num_draft_tokens
    requests = []
    for i in range(batch):
        params = base | {"request_id": f"{config}-T{temperature:g}-b{batch}-{i}-r{repeat}"}
        if temperature > 0 and config != "dynamic":  # a seeded sampled request keeps its k
            params["seed"] = 1000 + i
        requests.append((prompts[i % len(prompts)], params))
    wait_idle(serve.metrics_url)
    deadline = time.monotonic() + args.timeout_s
    with streaming(serve.address, requests, args.timeout_s) as (_, recs, cond):
        with cond:
            wait_until(cond, lambda: all(len(r.times) >= args.warmup or r.done for r in recs),
                       deadline, f"{config}: the streams did not warm up")  # fmt: skip
            t0, before = time.perf_counter(), scrape(serve.metrics_url)
            marks = [len(r.times) for r in recs]
            wait_until(cond, lambda: any(r.done for r in recs), deadline,
                       f"{config}: no stream finished")  # fmt: skip
            t1 = time.perf_counter()
            tokens = sum(sum(r.tokens[m:]) for r, m in zip(recs, marks, strict=True))
        after = scrape(serve.metrics_url)
    drafts = _delta(before, after, "spec_decode_num_drafts_total")
    accepted = _delta(before, after, "spec_decode_num_accepted_tokens_total")
    hits = _delta(before, after, "draft_ahead_hits_total")
    misses = _delta(before, after, "draft_ahead_misses_total")
    return {
        "config": config, "temperature": temperature, "batch": batch,
        "tokens_per_s": tokens / (t1 - t0), "window_s": t1 - t0, "tokens": tokens,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "asks": hits + misses,
    }  # fmt: skip


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    t = result["training"]
    saguaro = f", Saguaro scale {s['saguaro_scale']:g}" if s["saguaro_scale"] != 1 else ""
    if s.get("spread"):
        saguaro += ", fan-out spread"
    lines = [
        f"Trained pair through `specdec serve` ({result['machine']}, commit {result['commit']}, "
        f"{result['date']}; placement {s['placement']}): target "
        f"{t['target']['parameters']:,} and draft {t['draft']['parameters']:,} parameters, "
        f"trained {t['target']['steps']} + {t['draft']['steps']} steps "
        f"({t['total_seconds']:.0f} s; final losses {t['target']['final_loss']:.3f} / "
        f"{t['draft']['final_loss']:.3f}), k = {s['num_draft_tokens']}, draft-ahead F = "
        f"{s['draft_ahead']}{saguaro}"
        f"; real acceptance. Held-out prompts; {s['new_tokens']} new tokens per stream.",
        "",
        "| T | config | batch | tokens/s (median) | runs' range | x target-only | L "
        "| draft-ahead hit rate (asks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["temperature"], r["batch"]): r["tokens_per_s"]
            for r in result["rows"] if r["config"] == "target_only"}  # fmt: skip
    for r in result["rows"]:
        ratio = r["tokens_per_s"] / base[(r["temperature"], r["batch"])]
        length = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.2f} ({r['asks']:.0f})"
        runs = r["tokens_per_s_runs"]
        lines.append(f"| {r['temperature']:g} | {r['config']} | {r['batch']} | "
                     f"{r['tokens_per_s']:.0f} | {min(runs):.0f}-{max(runs):.0f} | {ratio:.2f} | "
                     f"{length} | {hit} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=None, help="default: the demo's cache")
    parser.add_argument("--smoke", action="store_true", help="the demo's tiny pair on the CPU")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft-ahead", type=int, default=2)
    parser.add_argument("--saguaro-scale", type=float, default=1.0)
    parser.add_argument("--spread", action="store_true",
                        help="the draft-ahead rows with the fan-out spread "
                             "(--draft-ahead-spread)")  # fmt: skip
    parser.add_argument("--target-steps", type=int, default=TRAINED.target_steps)
    parser.add_argument("--draft-steps", type=int, default=TRAINED.draft_steps)
    parser.add_argument("--dynamic", action="store_true",
                        help="also lock-step rows under dynamic speculation "
                             "(--dynamic-speculation; sampled requests unseeded)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3,
                        help="windows per row (the same streams); the median one's row is "
                             "kept")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.new_tokens < 2 * args.warmup or args.draft_ahead < 1:
        parser.error("--batches must be >= 1, --new-tokens >= 2 x --warmup, --draft-ahead >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if any(not 0 <= t <= 2 for t in args.temperatures):
        parser.error("--temperatures must be in [0, 2]")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on the CPU")
    if args.smoke:
        args.new_tokens, args.warmup = min(args.new_tokens, 24), min(args.warmup, 4)
    args.device = "cpu" if args.smoke else "cuda"
    budget = budget_for(args)
    pair = build_demo_models(args.cache or cache_root(), budget=budget, device=args.device)
    files = source_files(budget.corpus_bytes)
    # prompts well inside the pair's context (the smoke pair's is 64 positions)
    chars = 60 if args.smoke else 400
    prompts = heldout_prompts(files, is_heldout, count=max(args.batches), chars=chars)
    s = _settings(args, pair, budget)
    placement = "split" if torch.cuda.device_count() >= 2 else "shared"
    log_dir = args.out / "trained_pair_logs"
    settings = vars(args) | {"out": str(args.out), "cache": str(args.cache), "placement": placement}
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": provenance.commit(short=True),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": provenance.machine(torch.device(args.device)),
        "settings": settings,
        "training": {k: v for k, v in pair.training.items() if k != "recipe"},
        "rows": [],
    }
    starts = serve_starts(args)
    rows = sum(len(configs) for *_, configs in starts) * len(args.temperatures) * len(args.batches)
    bar = tqdm(total=rows, desc="rows", unit="row")
    for name, extra, configs in starts:
        with serving(s, None, log_dir, args.timeout_s, placement=placement, extra=extra,
                     name=name) as serve:  # fmt: skip
            for config, temperature, batch in product(configs, args.temperatures, args.batches):
                # the same streams (same seeds) --repeats times: the median window's row
                runs = [measure(serve, config, temperature, batch, prompts, args, r)
                        for r in range(args.repeats)]  # fmt: skip
                runs.sort(key=lambda row: row["tokens_per_s"])
                row = runs[len(runs) // 2] | {
                    "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]
                }
                result["rows"].append(row)
                bar.update()
    bar.close()
    order = {c: i for i, c in enumerate(CONFIGS)}
    result["rows"].sort(key=lambda r: (r["temperature"], r["batch"], order[r["config"]]))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"trained_pair_{provenance.device_name(torch.device(args.device))}"
    provenance.save(stem, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
