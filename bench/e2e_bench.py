"""The whole served system, measured: `specdec serve` driven by its client, and the draft and
target services in their own processes driven over gRPC by `bench.pipeline.Pipeline`,
against the same run's in-process graph times.

    PYTHONPATH=. python bench/e2e_bench.py --out bench/results      # GPU: 8B target, 1B draft
    PYTHONPATH=. python bench/e2e_bench.py --out bench/results --no-serve  # without specdec serve
    PYTHONPATH=. python bench/e2e_bench.py --smoke --out /tmp/e2e    # CPU, tiny models, ~2 min
    PYTHONPATH=. python bench/e2e_bench.py --report bench/results/e2e_NVIDIA_H200.json
    PYTHONPATH=. python bench/e2e_bench.py --by-length RUN_L3.json RUN_L1.5.json  # tokens/s vs L

Steps, each phase in its own process where it holds device memory:
1. checkpoints with random weights (Llama-3.1-8B / Llama-3.2-1B shapes, one shared tokenizer of
   128,256 ids; cached), and their in-process CUDA graph step times (`e2e_inprocess`);
2. the empty gRPC round trip, a trivial echo server in a child process;
3. the draft service, then a plain target service: target-only rows (k = 0 blocks, the draft is
   never called) and the greedy check (target-only and lock-step speculation with real
   acceptance must commit the same tokens); then a target per synthetic acceptance length L
   (BENCHMARKING ONLY: its output is not the target's distribution): lock-step rows;
4. (unless --no-serve) the same checkpoints and service settings through `specdec serve` (a child
   process with its own local Ray cluster; needs `ray` importable) and `specdec.client`: B
   concurrent streams, target-only and speculation per --serve-lengths, the client's time
   per output token and step against the hub's step time from /metrics and the Pipeline
   rows, and time to first token at each --ttft-prompt-len (with --kv-block-size, also with
   a cached prefix), at the shortest against the in-process prefill (`bench.e2e_serve`); per
   placement (--serve-placements: both services on one GPU, "shared", and with two GPUs one
   each, "split"), lock-step and draft-ahead rows, each with its GPUs' busy fractions and, at
   batch 1, a timeline of what each GPU did, from the services' device traces
   (`bench.e2e_timeline`, SPECDEC_GPU_TRACE);
5. if the greedy runs diverged (on a GPU), the target's logits at each first divergence,
   computed twice in a child process: replaying target-only's one-token steps and
   speculation's (k + 1)-token verify steps (`e2e_inprocess.diagnose`). The divergence is
   kernel numerics iff each replay's argmax is its own run's token (the flip is reproduced by
   the two kernel shapes alone); anything else is a failure. --smoke (float32 on the CPU)
   requires identical tokens: any divergence fails it;
6. `e2e_<GPU>.json`, `.md` (a section ready for BENCHMARKS.md), `.png` and `_timeline.png`
   in --out.

Exit code 1 when a serve row's window had steps where the draft fell back (missed its deadline
or was down: the row measured something else), or when the greedy check fails (a divergence not
reproduced by the replays, or any divergence with --smoke). Services are stopped on every way out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from bench import e2e_models, e2e_report, e2e_serve
from bench.e2e_driver import PipelineDriver, Workload, compare, greedy_run, measure, prompts
from bench.e2e_services import (
    REPO,
    Service,
    empty_round_trip,
    run_module,
    running,
    wait_serving,
)
from specdec.serving.server import apply_switch_interval

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # those up to max_slots are captured


class Progress:
    """tqdm where it is installed, else one updating line on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.what = total, 0, ""
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, unit="step", dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def phase(self, what: str) -> None:
        self.what = what
        if self._bar is not None:
            self._bar.set_description(what)
        else:
            print(f"\r[{self.done}/{self.total}] {what}", end="", file=sys.stderr, flush=True)

    def tick(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.done % 8 == 0 or self.done == self.total:
            print(f"\r[{self.done}/{self.total}] {self.what}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def child(task: str, job: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    """Runs `bench.e2e_inprocess TASK` in a child process; its JSON result."""
    log_dir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log = (log_dir / f"{task}.{x}" for x in ("job.json", "json", "log"))
    job_path.write_text(json.dumps(job))
    args = [task, str(job_path), str(out_path)]
    run_module("bench.e2e_inprocess", args, log, what=f"e2e_inprocess {task}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def settings(args: argparse.Namespace) -> dict[str, Any]:
    k, steps = args.num_draft_tokens, args.warmup + args.steps + 1
    need = max(args.prompt_len + steps * (k + 1), args.prompt_len + args.greedy_tokens + 2 * k + 2)
    max_slots = max([*args.batches, args.greedy_batch])
    out = {
        "smoke": args.smoke,
        "batches": args.batches,
        "num_draft_tokens": k,
        "prompt_len": args.prompt_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "lengths": args.lengths,
        "dtype": "float32" if args.smoke else "bfloat16",
        "max_slots": max_slots,
        "graph_sizes": [b for b in GRAPH_SIZES if b <= max_slots],
        "ctx": args.prompt_len + args.warmup + args.steps,
        "serve": args.serve,
        "pair": "smoke" if args.smoke else args.pair,
        "target_tp": args.target_tensor_parallel,
        "kv_block_size": args.kv_block_size,
    }
    if args.serve:  # every service, Pipeline rows included, gets room for the serve rows
        out |= {
            "serve_lengths": args.serve_lengths,
            "serve_hit_rates": args.serve_hit_rates,
            "serve_placements": args.serve_placements,
            "serve_dynamic": args.serve_dynamic,
            "serve_no_push": args.serve_no_push,
            "serve_acceptance_spread": args.serve_acceptance_spread,
            "serve_hit_rate_spread": args.serve_hit_rate_spread,
            "serve_stand_in": args.serve_stand_in,
            "serve_stand_in_lockstep": args.serve_stand_in_lockstep,
            "serve_stand_in_dynamic": args.serve_stand_in_dynamic,
            "serve_target_only_again": args.serve_target_only_again,
            "draft_ahead": args.draft_ahead,
            "serve_steps": args.serve_steps,
            "ttft_prompt_lens": args.ttft_prompt_len,
            "ttft_repeats": args.ttft_repeats,
        }
        need = max(need, e2e_serve.seq_len_needed(out))
    out["max_seq_len"] = 64 * ((need + k + 1 + 63) // 64)
    return out


def service_args(s: dict[str, Any], path: str, device: str) -> list[str]:
    flags = {
        "--model": path,
        "--device": device,
        "--dtype": s["dtype"],
        "--grace-s": "1",
        "--max-slots": str(s["max_slots"]),
        "--max-seq-len": str(s["max_seq_len"]),
    }
    out = [x for pair in flags.items() for x in pair]
    if device.startswith("cuda"):
        sizes = [str(b) for b in GRAPH_SIZES if b <= s["max_slots"]]
        out += ["--cuda-graph-batch-sizes", *sizes]
    if s.get("kv_block_size"):
        out += ["--kv-block-size", str(s["kv_block_size"])]
    return out


@contextmanager
def target_service(
    s: dict[str, Any], args: argparse.Namespace, draft: Service, length: float | None
) -> Iterator[Service]:
    flags = service_args(s, s["paths"]["target"], s["target_device"])
    flags += ["--draft-address", draft.address, "--draft-wait-s", str(args.start_timeout_s)]
    if s["target_device"] == "cpu":  # the Triton interpreter would take about 1 s per step
        flags += ["--sampler-impl", "torch"]
    if s.get("target_tp", 1) > 1:
        flags += ["--tensor-parallel", str(s["target_tp"])]
    if length is not None:
        flags += [
            "--synthetic-acceptance-length",
            str(length),
            "--synthetic-num-draft-tokens",
            str(s["num_draft_tokens"]),
        ]
    name = f"target_{e2e_report.config_name(length)}"
    with running(name, "target_service", flags, args.log_dir, args.start_timeout_s) as target:
        yield target


def serve_rows(result: dict[str, Any], args: argparse.Namespace, progress: Progress) -> None:
    """Target-only rows and the greedy check on a plain target, then lock-step rows per L,
    into `result` as they are measured."""
    s, rows = result["settings"], result["rows"]
    vocab = s["vocab_size"]

    def work(batch: int, k: int) -> Workload:
        return Workload(batch, k, s["prompt_len"], vocab, args.warmup, args.steps)

    def run(config: str, driver: PipelineDriver, k: int, length: float | None) -> None:
        try:
            for b in s["batches"]:
                progress.phase(f"{config} batch {b}")
                row = measure(driver, work(b, k), config, progress.tick)
                rows.append({"config": config, "synthetic_length": length} | row)
        finally:
            driver.close()

    progress.phase("starting the draft and target services")
    draft_flags = service_args(s, s["paths"]["draft"], s["draft_device"])
    timeout = args.start_timeout_s
    with running("draft", "draft_service", draft_flags, args.log_dir, timeout, wait=False) as d:
        with target_service(s, args, d, None) as t:
            wait_serving(d, timeout)
            run(e2e_report.TARGET_ONLY, PipelineDriver(None, t.address), 0, None)
            progress.phase("greedy check")
            result["greedy_check"] = greedy_check(s, args, d, t)
            progress.tick()
        for length in s["lengths"]:
            progress.phase(f"starting a target with synthetic L = {length}")
            with target_service(s, args, d, length) as t:
                config = e2e_report.config_name(length)
                run(config, PipelineDriver(d.address, t.address), s["num_draft_tokens"], length)


def greedy_check(
    s: dict[str, Any], args: argparse.Namespace, draft: Service, target: Service
) -> dict[str, Any]:
    k = s["num_draft_tokens"]
    runs: list[list[list[int]]] = []
    spec_steps: list[list[int]] = []
    for name, draft_address, ks in (("plain", None, 0), ("spec", draft.address, k)):
        driver = PipelineDriver(draft_address, target.address)
        steps = spec_steps if ks else None
        try:
            w = Workload(args.greedy_batch, ks, s["prompt_len"], s["vocab_size"], 0, 0)
            runs.append(greedy_run(driver, w, f"greedy-{name}", args.greedy_tokens, steps))
        finally:
            driver.close()
    w = Workload(args.greedy_batch, k, s["prompt_len"], s["vocab_size"], 0, 0)
    return compare(w, runs[0], runs[1], spec_steps)


def diagnose(s: dict[str, Any], greedy: dict[str, Any], args: argparse.Namespace) -> dict:
    """Both runs replayed in a child process with the target service's runner settings."""
    job = {
        "path": s["paths"]["target"],
        "device": s["target_device"],
        "dtype": s["dtype"],
        "max_slots": s["max_slots"],
        "max_seq_len": s["max_seq_len"],
        "graph_sizes": list(GRAPH_SIZES),  # those up to max_slots, as the service captures
        "target_tp": s.get("target_tp", 1),
        "num_draft_tokens": greedy["num_draft_tokens"],
        "prompts": prompts(greedy["batch"], s["prompt_len"], s["vocab_size"], 1),
        "target_only": greedy["target_only"],
        "speculative": greedy["speculative"],
        "speculative_steps": greedy["speculative_steps"],
        "divergences": greedy["divergences"],
    }
    return child("diagnose", job, args.log_dir)


def greedy_passed(result: dict[str, Any]) -> bool:
    """Identical tokens; on a GPU, or divergences all reproduced as numerics (`diagnose`)."""
    greedy, diagnosis = result["greedy_check"], result["greedy_diagnosis"]
    if greedy["passed"]:
        return True
    return not result["settings"]["smoke"] and bool(diagnosis and diagnosis["numerics"])


def measure_all(result: dict[str, Any], args: argparse.Namespace) -> None:
    s = result["settings"]
    total = 2 + len(s["batches"]) * (1 + len(s["lengths"])) * args.steps + 1
    progress = Progress(total + (e2e_serve.progress_units(s) if s["serve"] else 0))
    try:
        progress.phase("checkpoints and in-process graph times")
        job = s | {
            "cache": str(args.cache),
            "graph_sizes": list(GRAPH_SIZES),
            "iters": args.inprocess_iters,
            # the shortest: the in-process runner holds max(batches) + 1 slots of that length
            "prefill_len": min(s["ttft_prompt_lens"]) if s["serve"] else 0,
        }
        prep = child("prepare", job, args.log_dir)
        progress.tick()
        s |= {k: prep[k] for k in ("paths", "draft_device", "target_device")}
        s["vocab_size"] = e2e_models.prompt_vocab(args.smoke, s["pair"])
        s["models"] = {role: Path(path).name for role, path in s["paths"].items()}
        result["environment"] = prep["environment"]
        result["inprocess_ms"] = {"target": prep["target_ms"], "draft": prep["draft_ms"]}
        progress.phase("empty gRPC round trip")
        result["empty_round_trip"] = empty_round_trip(args.log_dir)
        progress.tick()
        serve_rows(result, args, progress)
        if s["serve"]:
            result["serve"] = {"rows": [], "ttft": [], "stops": []}
            e2e_serve.section(
                result, args.log_dir, args.start_timeout_s, progress.phase, progress.tick
            )
    finally:
        progress.close()
    greedy = result["greedy_check"]
    if not greedy["passed"]:
        result["greedy_diagnosis"] = diagnose(s, greedy, args)


def partial_report(result: dict[str, Any], out: Path) -> Path | None:
    """The report of a run stopped before its end (a call's time limit, often during the greedy
    check's diagnosis, which comes after every serve row), as e2e_partial.md beside the partial
    results, where what was measured renders; None (and a line on stderr) where it does not."""
    try:
        text = e2e_report.markdown(result)
    except Exception as e:  # too little was measured: the JSON is all there is
        print(f"no partial report: {e!r}", file=sys.stderr)
        return None
    path = out / "e2e_partial.md"
    path.write_text("_Partial: the run stopped before its end; this is what it had measured._"
                    "\n\n" + text)  # fmt: skip
    print(f"and rendered in {path}", file=sys.stderr)
    return path


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": settings(args),
        "rows": [],
        "greedy_check": None,
        "greedy_diagnosis": None,
        "serve": None,
    }
    try:
        measure_all(result, args)
    except BaseException:  # keep what was measured: device time is scarce
        args.out.mkdir(parents=True, exist_ok=True)
        partial = args.out / "e2e_partial.json"
        partial.write_text(json.dumps(result, indent=1) + "\n")
        print(f"stopped early; what was measured is in {partial}", file=sys.stderr)
        partial_report(result, args.out)
        raise
    path = e2e_report.write(result, args.out)
    print(e2e_report.markdown(result))
    print(f"results: {path} (.md, .png beside it); service logs in {args.log_dir}")
    return 0 if greedy_passed(result) and not e2e_report.fallbacks(result) else 1


def _spread(text: str) -> float:
    """A mixed-traffic spread: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a spread must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"a spread must be >= 0, got {text!r}")
    return value


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument(
        "--cache",
        type=Path,
        default=e2e_models.DEFAULT_CACHE,
        help="checkpoint directory (reused when it holds the same models)",
    )
    p.add_argument("--log-dir", type=Path, help="service logs (default: OUT/e2e_logs)")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU, a few steps")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument(
        "--lengths",
        type=float,
        nargs="*",
        default=[1.5, 3.0],
        help="synthetic mean acceptance lengths of the lock-step rows",
    )
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--warmup", type=int, help="untimed steps first (graphs are captured lazily)")
    p.add_argument("--steps", type=int, help="timed steps per row")
    p.add_argument("--greedy-batch", type=int)
    p.add_argument("--greedy-tokens", type=int)
    p.add_argument("--inprocess-iters", type=int)
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure through `specdec serve` and specdec.client too (the default; needs ray "
        "importable); --no-serve: only the Pipeline rows and the in-process times",
    )
    p.add_argument(
        "--serve-lengths",
        type=float,
        nargs="+",
        default=[3.0],
        help="synthetic lengths of the serve rows (one specdec serve start each)",
    )
    p.add_argument(
        "--serve-hit-rates",
        type=float,
        nargs="*",
        help="draft-ahead rows per serve length, one specdec serve start each: --draft-ahead "
        "at a synthetic hit rate h (BENCHMARKING ONLY); default 0.5 0.8 1 (--smoke: 1); "
        "empty: lock-step only",
    )
    p.add_argument("--draft-ahead", type=int, default=2, help="F of the draft-ahead rows")
    p.add_argument(
        "--serve-dynamic",
        action="store_true",
        help="also a lock-step start with --dynamic-speculation per serve length (the target "
        "chooses each step's k from what it measures)",
    )
    p.add_argument(
        "--serve-no-push",
        action="store_true",
        help="beside each draft-ahead row, the same with --no-draft-push-chains (the hub asks "
        "and waits for every chain): what pushed chains buy where the hub chooses them (it asks "
        "for pushes where, as measured, they make it wait less), in one run",
    )
    p.add_argument(
        "--serve-acceptance-spread",
        type=_spread,
        default=0.0,
        metavar="S",
        help="mixed traffic (BENCHMARKING ONLY): each request's own mean acceptance length, "
        "uniform in [L - S, L + S] (narrowed to [1, k + 1]) by a hash of its id",
    )
    p.add_argument(
        "--serve-hit-rate-spread",
        type=_spread,
        default=0.0,
        metavar="S",
        help="mixed traffic (BENCHMARKING ONLY): each request's own draft-ahead hit rate, "
        "uniform in [h - S, h + S] (narrowed to [0, 1]) by a hash of its id",
    )
    p.add_argument(
        "--serve-stand-in",
        type=float,
        nargs="*",
        default=[],
        metavar="H",
        help="BENCHMARKING ONLY: rows with the draft stand-in (the draft on a GPU of its own, "
        "emulated on a one-GPU machine: its forwards take the times measured on this GPU in "
        "the same run, on no GPU), draft-ahead at each synthetic hit rate H, per serve length",
    )
    p.add_argument(
        "--serve-stand-in-lockstep",
        action="store_true",
        help="BENCHMARKING ONLY: also a lock-step row with the draft stand-in per serve length",
    )
    p.add_argument(
        "--serve-target-only-again",
        action="store_true",
        help="measure the target-only serve rows again at the run's end (a start with the "
        "first one's settings), so that the report shows how far the target alone drifted "
        "within the run (its x target-only)",
    )
    p.add_argument(
        "--serve-stand-in-dynamic",
        action="store_true",
        help="BENCHMARKING ONLY: also a dynamic speculation row with the draft stand-in per "
        "serve length (lock-step drafts, k chosen per step: its steps at k = 0 on one GPU)",
    )
    p.add_argument(
        "--serve-placements",
        nargs="+",
        choices=e2e_serve.PLACEMENTS,
        help="where the serve rows' services run: shared (both on one GPU) and/or split (one "
        "GPU each); default: both with two GPUs or more, else shared",
    )
    p.add_argument(
        "--target-tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="the target over N GPUs in every row (tensor parallelism: in-process on cuda:1 "
        "to cuda:N, the draft on cuda:0; specdec serve --target-tensor-parallel N): N + 1 GPUs",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=0,
        metavar="N",
        help="both services' KV caches paged in blocks of N positions (--kv-block-size of the "
        "services and specdec serve; prefix caching on); 0: fixed slots. The in-process rows "
        "stay on fixed slots",
    )
    p.add_argument(
        "--pair",
        choices=sorted(e2e_models.PAIRS),
        default=e2e_models.DEFAULT_PAIR,
        help="the shapes of target and draft (random weights): "
        + "; ".join(f"{name}: {t} / {d}" for name, (t, d) in sorted(e2e_models.PAIRS.items())),
    )
    p.add_argument("--serve-steps", type=int, help="timed steps per serve row (window)")
    p.add_argument(
        "--ttft-prompt-len",
        type=int,
        nargs="+",
        help="prompt tokens of the TTFT requests, one or more lengths (the in-process prefill "
        "is measured at the shortest; with --kv-block-size, rows with a cached prefix too)",
    )
    p.add_argument("--ttft-repeats", type=int, help="timed TTFT requests per config")
    p.add_argument("--report", type=Path, help="regenerate .md and .png from a results JSON")
    p.add_argument(
        "--by-length",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="plot served tokens/s against L from these results JSONs (runs of one machine at "
        "different --serve-lengths) into FIRST_by_length.png",
    )
    args = p.parse_args(argv)
    smoke = dict(
        batches=[1, 4],
        prompt_len=16,
        warmup=2,
        steps=6,
        greedy_batch=4,
        greedy_tokens=8,
        inprocess_iters=2,
        serve_steps=32,  # a longer window: the busy CPU delivers responses in bursts
        ttft_prompt_len=[64],
        ttft_repeats=2,
        serve_hit_rates=[1.0],
    )
    full = dict(
        batches=[1, 8, 32],
        prompt_len=64,
        warmup=16,
        steps=64,
        greedy_batch=8,
        greedy_tokens=16,
        inprocess_iters=20,
        serve_steps=64,
        ttft_prompt_len=[512],
        ttft_repeats=5,
        serve_hit_rates=[0.5, 0.8, 1.0],
    )
    for name, value in (smoke if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.log_dir = args.log_dir or args.out / "e2e_logs"
    k = args.num_draft_tokens
    if min(args.ttft_prompt_len) < 2:
        p.error(f"--ttft-prompt-len must be >= 2, got {args.ttft_prompt_len}.")
    if not all(1 <= length <= k + 1 for length in args.lengths):
        p.error(f"--lengths must be in [1, {k + 1}] (1 + --num-draft-tokens), got {args.lengths}.")
    if args.serve and args.report is None and not args.by_length:
        if not all(1 <= length <= k + 1 for length in args.serve_lengths) or k < 1:
            p.error(f"--serve-lengths must be in [1, {k + 1}], got {args.serve_lengths}.")
        if not all(0.0 <= h <= 1.0 for h in args.serve_stand_in):
            p.error(f"--serve-stand-in hit rates must be in [0, 1], got {args.serve_stand_in}.")
        if importlib.util.find_spec("ray") is None:
            p.error(
                "the serve rows run `specdec serve`, which needs ray importable (PYTHONPATH); "
                "--no-serve measures without them."
            )
    return args


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    apply_switch_interval()  # the driver's threads too, when SPECDEC_SWITCH_INTERVAL_S is set
    if args.report is not None:
        result = json.loads(args.report.read_text())
        e2e_report.write(result, args.report.parent, args.report.stem)
        print(e2e_report.markdown(result))
        return 0
    if args.by_length:
        results = [json.loads(path.read_text()) for path in args.by_length]
        first = args.by_length[0]
        png = first.parent / f"{first.stem}_by_length.png"
        if not e2e_report.plot_lengths(e2e_report.merged_by_length(results), png):
            print("no plot: matplotlib is missing, or the runs hold fewer than two lengths")
            return 1
        print(png)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # so the services are stopped on the way out
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
