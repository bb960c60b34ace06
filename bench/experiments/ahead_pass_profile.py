"""Where the draft's pass ahead spends its time: the 1B-shaped draft of the system benchmark,
in one process, no gRPC. Each step proposes k drafts for a block of greedy requests, then runs
the pass ahead (`DraftEngine.draft_ahead`) that the target's verify hides; the next ask hits a
chain (a synthetic hit rate of 1, BENCHMARKING ONLY). Prints per batch the pass's host wall
time (to its end on the device) against its device time and the in-process graph step, the
GPU's idle share inside one profiled pass with the CPU ops that took longest, and the fork's
KV copies. Medians over the steps after the first 16, or the second half of fewer
(draft-ahead's accepted counts settle after 16 verdicts: `ahead.AcceptedCounts`).

    PYTHONPATH=. python bench/experiments/ahead_pass_profile.py --out DIR [--batches 1 8]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench import e2e_models
from bench.runner_bench import prefill, runner_step_ms
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner, RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ProposeEntry

GRAPHS = (1, 2, 4, 8, 16, 32)
K = 4
ACCEPTED = 2  # L = 3: every verdict accepts two drafts


def engine(path: str, device: str, draft_ahead: int) -> DraftEngine:
    rc = RunnerConfig(path, device=device, dtype="bfloat16" if device != "cpu" else "float32",
                      max_slots=64, max_seq_len=512,
                      cuda_graph_batch_sizes=GRAPHS if device != "cpu" else ())  # fmt: skip
    cfg = DraftConfig(
        runner=rc, draft_ahead=draft_ahead, draft_ahead_slots=48, synthetic_hit_rate=1.0
    )
    runner = ModelRunner.load(rc)
    runner.own_device()
    eng = DraftEngine(cfg, runner, model_info(cfg, runner))
    eng.capture_graphs()
    return eng


def steps(eng: DraftEngine, batch: int, n: int, profile: Path | None) -> dict[str, list[float]]:
    settled = min(16, n // 2)  # the steps before are left out of the medians
    runner = eng.runner
    assert runner is not None
    g = torch.Generator().manual_seed(batch)
    ids = [f"r{i}" for i in range(batch)]
    tokens = {r: torch.randint(1, 1000, (64,), generator=g).tolist() for r in ids}
    for r in ids:
        eng.admit(AdmitRequest(r, tuple(tokens[r]), SamplingParams(0.0)))
    new = {r: [] for r in ids}
    out: dict[str, list[float]] = {"propose_ms": [], "pass_ms": [], "pass_device_ms": []}
    for step in range(n):
        asks = [ProposeEntry(r, step, tuple(new[r]), len(tokens[r]), K) for r in ids]
        a = time.perf_counter()
        proposal = eng.propose_timed(asks)
        b = time.perf_counter()
        assert not proposal.errors
        prof = None
        if step == n - 1 and profile is not None:
            activity = torch.profiler.ProfilerActivity
            prof = torch.profiler.profile(activities=[activity.CPU, activity.CUDA])
            prof.__enter__()
        before = eng._ahead.seconds
        c = time.perf_counter()
        eng.draft_ahead(ids)
        runner.synchronize()
        d = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            assert profile is not None
            prof.export_chrome_trace(str(profile / f"ahead_pass_b{batch}.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
            print(f"batch {batch}: GPU idle in the profiled pass: {idle_share(prof):.0%}")
        if step >= settled:
            out["propose_ms"].append((b - a) * 1e3)
            out["pass_ms"].append((d - c) * 1e3)
            out["pass_device_ms"].append((eng._ahead.seconds - before) * 1e3)
        block = proposal.block
        for i, rid in enumerate(block.request_ids):
            drafts = block.tokens(i)
            new[rid] = [*drafts[:ACCEPTED], 7]  # any token: the synthetic hit takes the chain
            tokens[rid] += new[rid]
    eng.release(ids)
    return out


def idle_share(prof: torch.profiler.profile) -> float:
    """The share of the profiled span (first kernel start to last kernel end) with no kernel
    running on the device."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )
    if not spans:
        return float("nan")
    busy, (start, end) = 0, spans[0]
    first, last = spans[0][0], max(e for _, e in spans)
    for s, e in spans[1:]:
        if s > end:
            busy, start, end = busy + end - start, s, e
        else:
            end = max(end, e)
    busy += end - start
    return 1 - busy / max(last - first, 1)


def fork_ms(eng: DraftEngine, branches: int, length: int, repeats: int = 50) -> float:
    """The fork's KV copies (`SlotCache.fork`) of one source into `branches`, median ms."""
    runner = eng.runner
    assert runner is not None
    ids = [*prefill(runner, 1, length, runner.device), *(f"b{i}" for i in range(branches))]
    for rid in ids[1:]:
        runner.add_request(rid)
    forks = [(ids[0], b, length) for b in ids[1:]]
    times = []
    for _ in range(repeats):
        runner.synchronize()
        a = time.perf_counter()
        runner.fork(forks)
        runner.synchronize()
        times.append((time.perf_counter() - a) * 1e3)
    for rid in ids:
        runner.release(rid)
    return statistics.median(times)


def main() -> None:
    p = e2e_models.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--draft-ahead", type=int, default=2)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda:0"
    paths = e2e_models.build(args.cache, smoke=args.smoke, device=device)
    eng = engine(paths["draft"], device, args.draft_ahead)
    runner = eng.runner
    assert runner is not None
    result: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(0) if device != "cpu" else "cpu",
        "graph_step_ms": {},
    }
    for batch in args.batches:
        ids = prefill(runner, batch, 64, runner.device)
        step_ms = runner_step_ms(runner, ids, 1, 64, True, runner.device, 20)
        result["graph_step_ms"][batch] = step_ms  # type: ignore[index]
        for rid in ids:
            runner.release(rid)
        t = steps(eng, batch, args.steps, None if args.smoke else args.out)
        result[f"batch_{batch}"] = {name: statistics.median(v) for name, v in t.items()}
        print(f"batch {batch}: " + json.dumps(result[f"batch_{batch}"]))
    for branches in (3, 24):
        result[f"fork_{branches}_branches_ms"] = fork_ms(eng, branches, 70)
        print(f"fork of {branches} branches, 70 tokens: {result[f'fork_{branches}_branches_ms']}")
    (args.out / "ahead_pass_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
