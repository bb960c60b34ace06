"""Running streams while a long prompt is prefilled, through `specdec serve` and the client:
what chunked prefill (`--prefill-chunk-tokens`) buys them.

For each value of --chunks (0: the prompt prefilled whole at its admission), `specdec serve`
starts on the benchmark's checkpoints (`e2e_models`: 8B / 1B shapes with random weights on a
GPU, the tiny smoke pair with --smoke on the CPU), --streams greedy streams of 64-token prompts
decode (target-only, or lock-step speculation with --proposer draft and synthetic acceptance,
BENCHMARKING ONLY), and once each has --warmup responses one request with a --long-prompt-token
prompt arrives. Reported per chunk size, over the streams' responses from that arrival to the
long request's first token (the prefill window) and over as many responses before it (the
baseline): the median and p99 time per output token (each response's gap over the tokens it
brought), their ratio, and the long request's time to first token.

    PYTHONPATH=. python bench/chunked_prefill_bench.py --out bench/results       # GPU
    PYTHONPATH=. python bench/chunked_prefill_bench.py --smoke --out /tmp/chunk  # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from bench import e2e_models, provenance
from bench.e2e_driver import prompts
from bench.e2e_serve import Stream, bench_settings, serving, streaming, wait_idle, wait_until

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 64


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _gaps(
    recs: list[Stream], t0: float, t1: float, skip: int = 0, whole: bool = False
) -> list[float]:
    """Each response's wait per token it brought (ms), for every response whose wait overlaps
    (t0, t1] (the one that a whole prefill stalls arrives after the long prompt's first token,
    and counts), or with `whole` lies within it. A stream's responses before its `skip`th
    (its warm-up) never count."""
    out = []
    for r in recs:
        for i in range(max(1, skip), len(r.times)):
            inside = t0 < r.times[i - 1] and r.times[i] <= t1
            overlaps = r.times[i - 1] < t1 and r.times[i] > t0
            if (inside if whole else overlaps) and r.tokens[i] > 0:
                out.append(1e3 * (r.times[i] - r.times[i - 1]) / r.tokens[i])
    return out


def measure(serve: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.stream_tokens, "ignore_eos": True,
                              "temperature": 0.0, "proposer": args.proposer}  # fmt: skip
    if args.proposer == "draft":
        params["num_draft_tokens"] = args.num_draft_tokens
    wait_idle(serve.metrics_url)
    long_prompt = prompts(1, args.long_prompt, vocab, 7)[0]
    requests = [(p, params | {"request_id": f"s{i}"})
                for i, p in enumerate(prompts(args.streams, PROMPT_LEN, vocab, 3))]  # fmt: skip
    with streaming(serve.address, requests, args.timeout_s) as (client, recs, cond):
        deadline = time.monotonic() + args.timeout_s
        with cond:
            settled = args.warmup + args.baseline  # the baseline's responses follow the warm-up
            wait_until(cond, lambda: all(len(r.times) > settled or r.done for r in recs),
                       deadline, "the streams did not warm up")  # fmt: skip
        if any(r.done for r in recs):
            raise RuntimeError(f"a stream ended during its warm-up: {[r.error for r in recs]}")
        arrival = time.perf_counter()
        first = None
        for out in client.generate(long_prompt, max_tokens=args.long_tokens, ignore_eos=True,
                                   temperature=0.0, proposer=args.proposer,
                                   request_id="long"):  # fmt: skip
            if first is None and out.token_ids:
                first = time.perf_counter()
        assert first is not None, "the long request brought no token"
    during = _gaps(recs, arrival, first)
    before = _gaps(recs, 0.0, arrival, skip=args.warmup + 1, whole=True)
    row: dict[str, Any] = {"ttft_ms": 1e3 * (first - arrival), "responses_during": len(during)}
    for name, gaps in (("during", during), ("before", before)):
        if gaps:
            p50, p99 = statistics.median(gaps), _quantile(gaps, 0.99)
            row[name] = {"p50_ms": p50, "p99_ms": p99, "p99_over_p50": p99 / p50}
    if during and before:  # the goal: the streams' p99 during at most 2x their usual median
        row["p99_during_over_p50_before"] = row["during"]["p99_ms"] / row["before"]["p50_ms"]
    return row


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"Chunked prefill among running streams ({result['machine']}, commit "
        f"{result['commit']}, {result['date']}): {s['streams']} greedy streams "
        f"({s['proposer']}) of {PROMPT_LEN}-token prompts; a {s['long_prompt']}-token prompt "
        "arrives once each has its warm-up. TPOT over each response's gap per token it "
        "brought: during, every response of the streams whose wait overlaps the span from its "
        "arrival to its first token (a stall by a whole prefill included); before, the "
        f"responses after each stream's {s['warmup']}-response warm-up and before the arrival "
        f"({s.get('baseline', 0)} or more per stream). The goal: p99 during at most 2x the "
        "median before.",
        "",
        "| --prefill-chunk-tokens | TTFT of the long prompt ms | TPOT p50 during | p99 during "
        "| p99 / p50 during | TPOT p50 before | p99 before | p99 during / p50 before "
        "| responses during |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for chunk, row in result["rows"].items():
        d, b = row.get("during", {}), row.get("before", {})
        lines.append(
            f"| {chunk} | {row['ttft_ms']:.1f} | {d.get('p50_ms', float('nan')):.3f} | "
            f"{d.get('p99_ms', float('nan')):.3f} | {d.get('p99_over_p50', float('nan')):.2f} | "
            f"{b.get('p50_ms', float('nan')):.3f} | {b.get('p99_ms', float('nan')):.3f} | "
            f"{row.get('p99_during_over_p50_before', float('nan')):.2f} | "
            f"{row['responses_during']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = e2e_models.parser(__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--long-tokens", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument(
        "--baseline",
        type=int,
        default=32,
        help="responses per stream after its warm-up, before the long prompt",
    )
    parser.add_argument("--proposer", choices=["off", "draft"], default="off")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--kv-block-size", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.long_prompt = min(args.streams, 4), min(args.long_prompt, 512)
        args.stream_tokens, args.warmup = min(args.stream_tokens, 256), min(args.warmup, 4)
        args.baseline = min(args.baseline, 8)
        args.chunks = [c for c in args.chunks if c < args.long_prompt] or [0, 64]
    if any(c < 0 for c in args.chunks) or args.streams < 1 or args.long_prompt < 2:
        parser.error("--chunks must be >= 0, --streams >= 1 and --long-prompt >= 2")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on the CPU")
    paths = e2e_models.build(args.cache, args.smoke, "cpu" if args.smoke else "cuda")
    slots = args.streams + 1
    s = bench_settings(args.smoke, paths, slots, args.long_prompt + args.long_tokens + 64,
                       args.num_draft_tokens, [g for g in GRAPH_SIZES if g <= slots],
                       args.kv_block_size)  # fmt: skip
    vocab = e2e_models.prompt_vocab(args.smoke)
    log_dir = args.out / "chunked_prefill_logs"
    device = torch.device("cpu" if args.smoke else "cuda")
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": provenance.commit(short=True),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": provenance.machine(device),
        "settings": vars(args) | {"out": str(args.out), "cache": str(args.cache)},
        "rows": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for chunk in tqdm(args.chunks, desc="chunk sizes", unit="size"):
        length = 3.0 if args.proposer == "draft" else None  # BENCHMARKING ONLY
        extra = ["--prefill-chunk-tokens", str(chunk)]
        with serving(s, length, log_dir, args.timeout_s, extra=extra,
                     name=f"serve_chunk{chunk}") as serve:  # fmt: skip
            result["rows"][str(chunk)] = measure(serve, args, vocab)
        # after each chunk size: a run cut by a time limit keeps the rows it measured
        provenance.save(args.out / f"chunked_prefill_{provenance.device_name(device)}", result,
                        report(result))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
