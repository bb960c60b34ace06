"""Where one served step's time goes inside each service, without gRPC: the draft and target
engines in one process drive lock-step propose → verify on the 8B/1B checkpoints of the system
benchmark, and each call is timed on the host and traced by torch.profiler.

    PYTHONPATH=. python bench/experiments/step_profile.py --out DIR [--batch 1] [--k 4]

Prints per call: host wall time, device time (StepTimes), and the profiler's top CUDA kernels
and CPU ops of one propose and one verify; writes chrome traces into DIR.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import e2e_models
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner, RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ProposeEntry
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.synthetic import SyntheticAcceptance

GRAPHS = (1, 2, 4, 8, 16, 32)


def engines(
    paths: dict[str, str], synthetic: float, smoke: bool
) -> tuple[DraftEngine, TargetEngine]:
    rc = RunnerConfig("", device="cuda:0", dtype="bfloat16", max_slots=32, max_seq_len=512,
                      cuda_graph_batch_sizes=GRAPHS)  # fmt: skip
    if smoke:
        rc = RunnerConfig("", max_slots=32, max_seq_len=512)
    d_cfg = DraftConfig(runner=replace(rc, model_path=paths["draft"]))
    assert d_cfg.runner is not None
    d_runner = ModelRunner.load(d_cfg.runner)
    draft = DraftEngine(d_cfg, d_runner, model_info(d_cfg, d_runner))
    syn = SyntheticAcceptance(4, mean_acceptance_length=synthetic) if synthetic else None
    t_cfg = TargetConfig(replace(rc, model_path=paths["target"]), synthetic=syn)
    return draft, TargetEngine(ModelRunner.load(t_cfg.runner), t_cfg)


def run(draft: DraftEngine, target: TargetEngine, batch: int, k: int, steps: int,
        profile_dir: Path | None) -> dict[str, list[float]]:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(batch)]
    vocab = target.vocab_size
    tokens = {rid: torch.randint(1, vocab, (64,), generator=g).tolist() for rid in ids}
    new: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid in ids:
        for e in (draft, target):
            e.admit(AdmitRequest(rid, tuple(tokens[rid]), SamplingParams(0.0)))
    t: dict[str, list[float]] = {k_: [] for k_ in ("propose", "verify", "draft_dev", "verify_dev")}
    for step in range(steps):
        asks = [ProposeEntry(r, step, tuple(new[r]), len(tokens[r]), k) for r in ids]
        prof = None
        if profile_dir is not None and step == steps - 1:
            activity = torch.profiler.ProfilerActivity
            prof = torch.profiler.profile(activities=[activity.CPU, activity.CUDA])
            prof.__enter__()
        a = time.perf_counter()
        proposal = draft.propose_timed(asks)
        block, errors, d_times = proposal.block, proposal.errors, proposal.times
        b = time.perf_counter()
        verdicts, v_times = target.verify_timed(block)
        c = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            assert profile_dir is not None
            prof.export_chrome_trace(str(profile_dir / f"step_b{batch}.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
        assert not errors and not verdicts.errors
        if step >= 4:
            t["propose"].append(b - a)
            t["verify"].append(c - b)
            t["draft_dev"].append(d_times.forward_s)
            t["verify_dev"].append(v_times.forward_s + v_times.sampler_s)
        for i, rid in enumerate(verdicts.request_ids):
            new[rid] = list(verdicts.token_ids[i])
            tokens[rid] += new[rid]
    for e in (draft, target):
        e.release(ids)
    return t


def main() -> None:
    p = e2e_models.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--synthetic", type=float, default=3.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda:0"
    paths = e2e_models.build(args.cache, smoke=args.smoke, device=device)
    draft, target = engines(paths, args.synthetic, args.smoke)
    for batch in args.batches:
        t = run(draft, target, batch, 4, args.steps, args.out)
        print(f"batch {batch}: " + ", ".join(
            f"{name} {1e3 * statistics.median(v):.3f} ms" for name, v in t.items()))  # fmt: skip


if __name__ == "__main__":
    main()
