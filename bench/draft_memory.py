"""The draft's KV memory with and without draft-ahead's hypotheses, in fixed slots and paged:
what a paged cache saves draft-ahead (issue 30's goal: the extra at most 10% of the slots').

The draft's runner is configured exactly as `specdec serve` configures it (`ServiceConfig` ->
`orchestrator.launch.services._runner`: the hypotheses for up to 8 requests at the served k,
`--draft-ahead F` x (k + 1) x min(max_requests, 8) of them; a paged pool sized for the requests
plus the blocks each hypothesis may copy and write into), then loaded (`ModelRunner.load`) on
the system benchmark's draft checkpoint (`e2e_models`: Llama-3.2-1B shapes with random weights
on a GPU, the tiny smoke draft on the CPU). Measured per configuration: the bytes of the KV
tensors the runner holds and, on a GPU, the memory `torch.cuda.memory_allocated` grew by while
it loaded (weights, KV and graphs' buffers). Extra = with draft-ahead less without.

    PYTHONPATH=. python bench/draft_memory.py --out bench/results/paged      # GPU
    PYTHONPATH=. python bench/draft_memory.py --smoke --out /tmp/dmem        # CPU
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch

from bench import e2e_models, provenance
from orchestrator.config import ServiceConfig
from orchestrator.launch.services import _runner
from specdec.runner import ModelRunner

GOAL = 0.10  # paged extra / slots extra


def measure_one(
    paths: dict[str, str], args: argparse.Namespace, block: int, ahead: int
) -> dict[str, Any]:
    k, requests = args.num_draft_tokens, args.max_requests
    slots = ahead * (k + 1) * min(requests, 8)  # as `specdec serve` sets draft_ahead_slots
    config = ServiceConfig(
        target=paths["target"], draft=paths["draft"], device=args.device, dtype=args.dtype,
        max_requests=requests, max_seq_len=args.max_seq_len, max_num_draft_tokens=k,
        kv_block_size=block, draft_ahead=ahead, draft_ahead_slots=slots,
    )  # fmt: skip
    rc = _runner(config, paths["draft"], args.device, slots)
    cuda = args.device == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    runner = ModelRunner.load(rc)
    kv = runner.kv_cache_bytes
    row = {
        "kv": "slots" if not block else f"paged {block}",
        "draft_ahead": ahead,
        "hypotheses": slots,
        "runner_slots": rc.max_slots,
        "kv_blocks": rc.kv_blocks,
        "kv_bytes": kv,
        "allocated_bytes": torch.cuda.memory_allocated() - before if cuda else None,
    }
    del runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    gib = 1 << 30
    lines = [
        f"The draft's KV memory ({result['machine']}, commit {result['commit']}, "
        f"{result['date']}): the draft runner as `specdec serve` configures it, "
        f"--max-requests {s['max_requests']}, --max-seq-len {s['max_seq_len']}, k = "
        f"{s['num_draft_tokens']}, --draft-ahead {s['draft_ahead']} "
        "(its hypotheses for up to 8 requests), loaded on the draft checkpoint.",
        "",
        "| KV | draft-ahead | hypotheses | runner slots | blocks | KV GiB | allocated GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        alloc = "—" if r["allocated_bytes"] is None else f"{r['allocated_bytes'] / gib:.3f}"
        lines.append(
            f"| {r['kv']} | {r['draft_ahead']} | {r['hypotheses']} | {r['runner_slots']} | "
            f"{r['kv_blocks'] or '—'} | {r['kv_bytes'] / gib:.3f} | {alloc} |"
        )
    e = result["extra"]
    lines += [
        "",
        f"Draft-ahead's extra KV: slots {e['slots'] / gib:.3f} GiB, paged {e['paged'] / gib:.4f} "
        f"GiB: paged / slots = {e['ratio']:.4f} (goal <= {GOAL:g}: "
        f"{'met' if e['ratio'] <= GOAL else 'MISSED'}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = e2e_models.parser(__doc__)
    parser.add_argument("--max-requests", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft-ahead", type=int, default=2)
    parser.add_argument("--kv-block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_requests, args.max_seq_len = min(args.max_requests, 8), min(args.max_seq_len, 512)
    if min(args.max_requests, args.num_draft_tokens, args.draft_ahead, args.kv_block_size) < 1:
        parser.error("--max-requests, --num-draft-tokens, --draft-ahead, --kv-block-size >= 1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on the CPU")
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = "float32" if args.smoke else "bfloat16"
    paths = e2e_models.build(args.cache, args.smoke, args.device)
    device = torch.device(args.device)
    rows = [
        measure_one(paths, args, block, ahead)
        for block in (0, args.kv_block_size)
        for ahead in (0, args.draft_ahead)
    ]
    slots = rows[1]["kv_bytes"] - rows[0]["kv_bytes"]
    paged = rows[3]["kv_bytes"] - rows[2]["kv_bytes"]
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": provenance.commit(short=True),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": provenance.machine(device),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "cache")},
        "rows": rows,
        "extra": {"slots": slots, "paged": paged, "ratio": paged / slots},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    provenance.save(args.out / f"draft_memory_{provenance.device_name(device)}", result,
                    report(result))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
