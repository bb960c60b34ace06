"""What a draft ask that carries several new tokens costs the draft (a catch-up of n tokens),
against re-admitting the request: the two ways weighed for a late draft admission
(docs/design.md, "A late draft admission"), and for telling the draft only every few steps at
k = 0. The draft engine alone, in one process, on the system benchmark's draft checkpoint
(1B-shaped, random weights; `--smoke`: the tiny one on the CPU).

    PYTHONPATH=. python bench/experiments/catch_up_cost.py --out DIR [--batches 1 8 32]
        [--tails 1 2 3 4 6 8 16] [--reps 8] [--k 4]

Per batch B and tail n: B requests are admitted with a P-token prompt and asked once; then
each of `reps` asks brings n new tokens per request (random, so the drafts the KV holds past
the committed tokens are rolled back and the n tokens are caught up) and k drafts. A tail of
at most two tokens runs in the draft's captured graphs; a longer one is prefilled eagerly
first (`draft_service.drafting.GRAPHED_TAIL`). Reported: the first such ask's host wall time
(a shape's first eager run can compile kernels) and the median of the others, with the draft's
device time, and the time to admit the same B requests again from their whole tokens (the
re-admission the hub could do instead), one Admit after another as the hub sends them.
Writes `catch_up_<device>.json` and prints a table.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from bench import e2e_models
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner, RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ProposeEntry

GRAPHS = (1, 2, 4, 8, 16, 32)
PROMPT_LEN = 64


def engine(path: str, smoke: bool, max_slots: int, max_seq_len: int) -> DraftEngine:
    """The draft engine as the draft service builds it (graphs captured on a GPU)."""
    if smoke:
        rc = RunnerConfig(path, max_slots=max_slots, max_seq_len=max_seq_len)
    else:
        rc = RunnerConfig(path, device="cuda:0", dtype="bfloat16", max_slots=max_slots,
                          max_seq_len=max_seq_len, cuda_graph_batch_sizes=GRAPHS)  # fmt: skip
    cfg = DraftConfig(runner=rc)
    assert cfg.runner is not None
    runner = ModelRunner.load(cfg.runner)
    return DraftEngine(cfg, runner, model_info(cfg, runner))


def measure(
    draft: DraftEngine, batch: int, tail: int, reps: int, k: int, seed: int
) -> dict[str, Any]:
    """One (batch, tail) cell: the first catch-up ask, the median of the rest, the draft's
    device time, and the re-admission of the same requests."""
    g = torch.Generator().manual_seed(seed)
    vocab = draft.vocab_size
    ids = [f"b{batch}-n{tail}-r{i}" for i in range(batch)]
    tokens = {rid: torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist() for rid in ids}
    greedy = SamplingParams(0.0)
    for rid in ids:
        draft.admit(AdmitRequest(rid, tuple(tokens[rid]), greedy))
    walls, devices = [], []
    for step in range(reps + 1):
        new = {rid: [] if step == 0 else torch.randint(1, vocab, (tail,), generator=g).tolist()
               for rid in ids}  # fmt: skip
        for rid in ids:
            tokens[rid] += new[rid]
        asks = [ProposeEntry(rid, step, tuple(new[rid]), len(tokens[rid]), k) for rid in ids]
        started = time.perf_counter()
        proposal = draft.propose_timed(asks)
        wall = time.perf_counter() - started
        if proposal.errors:
            raise RuntimeError(f"the draft refused an ask: {proposal.errors[0]}")
        if step > 0:  # step 0 only drafts from the admission
            walls.append(wall)
            devices.append(proposal.times.forward_s)
    draft.release(ids)
    started = time.perf_counter()
    for rid in ids:  # the hub's re-admission: the request's whole tokens again
        draft.admit(AdmitRequest(rid, tuple(tokens[rid]), greedy))
    readmit = time.perf_counter() - started
    draft.release(ids)
    return {
        "batch": batch,
        "tail": tail,
        "first_ms": 1e3 * walls[0],
        "median_ms": 1e3 * statistics.median(walls[1:] or walls),
        "device_ms": 1e3 * statistics.median(devices[1:] or devices),
        "readmit_ms": 1e3 * readmit,
        "tokens": len(tokens[ids[0]]),
    }


def table(rows: list[dict[str, Any]], device: str) -> str:
    lines = [
        f"Draft catch-up of n tokens per request ({device}): host ms of an ask that brings n "
        "new tokens and asks k drafts (first, then the median of the rest), the draft's "
        "device ms, and ms to re-admit the same requests from their whole tokens:",
        "",
        "| batch | n | first ask ms | ask ms (median) | device ms | re-admit ms (tokens) |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['tail']} | {r['first_ms']:.2f} | {r['median_ms']:.2f} "
            f"| {r['device_ms']:.2f} | {r['readmit_ms']:.1f} ({r['tokens']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = e2e_models.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tails", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)
    if min(args.tails) < 1 or args.reps < 1 or args.k < 0 or min(args.batches) < 1:
        p.error("--tails and --batches must be >= 1, --reps >= 1 and --k >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda:0"
    paths = e2e_models.build(args.cache, smoke=args.smoke, device=device)
    longest = PROMPT_LEN + (args.reps + 1) * (max(args.tails) + args.k) + 8
    draft = engine(paths["draft"], args.smoke, max(args.batches), longest)
    name = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    rows = []
    for batch in args.batches:
        for seed, tail in enumerate(args.tails):
            rows.append(measure(draft, batch, tail, args.reps, args.k, seed))
            print(f"batch {batch}, n = {tail}: {rows[-1]['median_ms']:.2f} ms", flush=True)
    result = {"device": name, "k": args.k, "prompt_len": PROMPT_LEN, "rows": rows}
    stem = "catch_up_" + "".join(c if c.isalnum() else "_" for c in name)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(table(rows, name))
    return result


if __name__ == "__main__":
    main()
