"""Time to first token through `specdec serve` and the client: by prompt length, target only
and with speculation, with and without a cached prefix.

One `specdec serve` (the split placement where the machine has two GPUs or more, else both
services on one; paged KV with prefix caching where --kv-block-size is set) on the system
benchmark's checkpoints (`e2e_models`: 8B / 1B shapes with random weights on a GPU, the tiny
smoke pair with --smoke on the CPU). The server is idle before every request. For each prompt
length N and each of --repeats + 1 rounds (the first is a warm-up, not reported), each proposer
in turn (off: the target alone; draft: lock-step speculation with synthetic acceptance,
BENCHMARKING ONLY) sends:
  uncached: N random tokens no request sent before;
  cached:   (paged KV only: slots cache no prefix) the uncached prompt's first N - 64
            tokens, then 64 new ones (a chat turn resending its history), so its start is in
            the prefix cache.
The rounds are the system benchmark's (`e2e_serve.measure_ttft`), on one serve start.
Reported per (N, proposer, cached): the median over rounds of the client's time from the call
to the first token, the server's TTFT, and its parts (queue, hand-off = admission less the
target's prefill, prefill, first step); and per (N, cached), speculation's TTFT over the
target's alone.

    PYTHONPATH=. python bench/ttft_bench.py --out bench/results --kv-block-size 16   # GPU
    PYTHONPATH=. python bench/ttft_bench.py --smoke --out /tmp/ttft                  # CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from bench import e2e_models, provenance
from bench.e2e_report import ttft_ratios
from bench.e2e_serve import (
    TTFT_CACHED_SUFFIX,
    TTFT_NEW_TOKENS,
    bench_settings,
    measure_ttft,
    serving,
)

GRAPH_SIZES = (1, 2, 4)
GOAL_LENGTHS = (512, 4096)  # speculation's TTFT within GOAL_RATIO of the target's alone
GOAL_RATIO = 1.1
CONFIGS = (("target_only", "off"), ("lockstep", "draft"))


def measure(serve: Any, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The rows: one per (length, proposer, prefix), each the medians over the timed rounds."""
    bar = tqdm(total=len(args.lengths) * (args.repeats + 1), desc="TTFT rounds", unit="round")
    with bar:
        return measure_ttft(serve, CONFIGS, args.lengths, args.repeats, args.num_draft_tokens,
                            vocab, args.timeout_s, cached=bool(args.kv_block_size),
                            tick=bar.update)  # fmt: skip


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, prefix): speculation's median client TTFT over the target's alone, and
    whether it meets the goal where the goal names the length."""
    out = []
    for r in ttft_ratios(rows):
        goal = GOAL_RATIO if r["prompt_len"] in GOAL_LENGTHS else None
        out.append(r | {"goal": goal, "met": None if goal is None else r["ratio"] <= goal})
    return out


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    block = s["kv_block_size"]
    kv = f"paged in blocks of {block}" if block else "in slots"
    lines = [
        f"Time to first token through specdec serve ({result['machine']}, "
        f"{result['placement']} placement, commit {result['commit']}, {result['date']}): "
        f"batch 1 on an idle server, {s['repeats']} timed rounds after a warm-up, "
        f"KV {kv}; "
        f"speculation is lock-step k = {s['num_draft_tokens']} with synthetic acceptance "
        "(BENCHMARKING ONLY). A cached prompt resends an earlier prompt's start with "
        f"{TTFT_CACHED_SUFFIX} new tokens at its end.",
        "",
        "| prompt tokens | prefix | proposer | client TTFT ms (median) | max | server TTFT ms | "
        "queue | hand-off | prefill | first step | tokens found cached (least) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["prompt_len"], r["cached_prefix"],
                                                   r["proposer"] != "off")):  # fmt: skip
        p = r["parts_ms_median"]
        lines.append(
            f"| {r['prompt_len']} | {'cached' if r['cached_prefix'] else 'none'} | "
            f"{r['proposer']} | {r['client_ms_median']:.1f} | {r['client_ms_max']:.1f} | "
            f"{r['server_ms_median']:.1f} | {p['queue']:.2f} | {p['handoff']:.2f} | "
            f"{p['prefill']:.2f} | {p['first_step']:.2f} | {r['prefix_hit_tokens_min']} |"
        )
    lines += ["", "| prompt tokens | prefix | speculation / target only | goal |"]
    lines += ["|---|---|---|---|"]
    for r in sorted(result["ratios"], key=lambda r: (r["prompt_len"], r["cached_prefix"])):
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:g}x: {'met' if r['met'] else 'MISSED'}"
        lines.append(f"| {r['prompt_len']} | {'cached' if r['cached_prefix'] else 'none'} | "
                     f"{r['ratio']:.2f}x | {goal} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = e2e_models.parser(__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--kv-block-size", type=int, default=0)
    parser.add_argument("--placement", choices=["auto", "shared", "split"], default="auto")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths = sorted({min(n, 256) for n in args.lengths})
    if min(args.lengths) < 2 or args.repeats < 1:
        parser.error("--lengths must be >= 2 and --repeats >= 1")
    if args.kv_block_size < 0 or args.prefill_chunk_tokens < 0:
        parser.error("--kv-block-size and --prefill-chunk-tokens must be >= 0")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on the CPU")
    gpus = 0 if args.smoke else torch.cuda.device_count()
    placement = args.placement
    if placement == "auto":
        placement = "split" if gpus >= 2 else "shared"
    if placement == "split" and gpus < 2:
        parser.error(f"the split placement needs two GPUs; this machine has {gpus}")
    paths = e2e_models.build(args.cache, args.smoke, "cpu" if args.smoke else "cuda")
    max_seq_len = max(args.lengths) + TTFT_NEW_TOKENS + args.num_draft_tokens + 2
    s = bench_settings(args.smoke, paths, 4, max_seq_len, args.num_draft_tokens, GRAPH_SIZES,
                       args.kv_block_size)  # fmt: skip
    vocab = e2e_models.prompt_vocab(args.smoke)
    device = torch.device("cpu" if args.smoke else "cuda")
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": provenance.commit(short=True),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": provenance.machine(device) + (f" x {gpus}" if gpus > 1 else ""),
        "placement": placement,
        "settings": vars(args) | {"out": str(args.out), "cache": str(args.cache)},
    }
    extra = ["--prefill-chunk-tokens", str(args.prefill_chunk_tokens)]
    length = 3.0  # lock-step's synthetic acceptance: BENCHMARKING ONLY
    log_dir = args.out / "ttft_logs"
    with serving(s, length, log_dir, args.timeout_s, placement=placement, extra=extra,
                 name="serve_ttft") as serve:  # fmt: skip
        result["rows"] = measure(serve, args, vocab)
    result["ratios"] = ratios(result["rows"])
    args.out.mkdir(parents=True, exist_ok=True)
    name = provenance.device_name(device) + (f"_x{gpus}" if gpus > 1 else "")
    provenance.save(args.out / f"ttft_{name}", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
