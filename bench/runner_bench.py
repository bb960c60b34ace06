"""Step time of the model runner against the memory floor and transformers' own model.

Random bf16 weights at real sizes (Llama-3.1-8B, Llama-3.2-1B), built on the device. For batch
1, 8, 32, 64 with 512 tokens of KV per request: decode (1 token) and verify (k + 1 = 5 tokens),
with and without CUDA graphs, against
  (a) the memory floor: bytes of weights + KV read once / measured device copy bandwidth;
  (b) transformers eager (DynamicCache), and static cache + torch.compile where it runs.

    PYTHONPATH=. python bench/runner_bench.py --out $OUT          # GPU, real sizes
    PYTHONPATH=. python bench/runner_bench.py --smoke --out /tmp  # CPU, tiny config

With `--before OLD.json` (an earlier run's results) the markdown also keeps that run's table and
a before/after comparison of the best runner time per row.
"""

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec.runner import ForwardItem, ModelRunner, RunnerConfig

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE | {"factor": 32.0},
        tie_word_embeddings=True,
    ),
    "Llama-3.1-8B": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE | {"factor": 8.0},
        tie_word_embeddings=False,
    ),
}
SMOKE = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_scaling=LLAMA3_ROPE | {"factor": 8.0, "original_max_position_embeddings": 64},
)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, warmup: int, iters: int) -> float:
    """Mean milliseconds per call, host overhead included (it is part of a real step)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), dev, warmup=3, iters=10)
    return 2 * nbytes / (ms / 1e3)


def build(
    name: str,
    spec: dict[str, Any],
    dev: torch.device,
    ctx: int,
    slots: int,
    sizes: tuple[int, ...],
    compile_pointwise: bool = False,
    hf: Any = None,
) -> tuple[Any, ModelRunner]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**spec)
    config.architectures = ["LlamaForCausalLM"]
    if hf is None:
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    rc = RunnerConfig(
        compile_pointwise=compile_pointwise,
        model_path=f"<random {name}>",
        device=str(dev),
        dtype="bfloat16",
        max_slots=slots,
        max_seq_len=ctx + 64,
        cuda_graph_batch_sizes=sizes,
    )
    runner = ModelRunner.from_hf_weights(rc, config, dict(hf.state_dict()))
    return hf, runner


def prefill(runner: ModelRunner, slots: int, ctx: int, dev: torch.device) -> list[str]:
    ids = [f"r{i}" for i in range(slots)]
    g = torch.Generator(device="cpu").manual_seed(0)
    for start in range(0, slots, 8):
        group = ids[start : start + 8]
        for rid in group:
            runner.add_request(rid)
        runner.forward(
            [ForwardItem(r, torch.randint(0, 1000, (ctx,), generator=g), 0) for r in group]
        )
    return ids


def runner_step_ms(
    runner: ModelRunner,
    ids: list[str],
    n: int,
    ctx: int,
    graphs: bool,
    dev: torch.device,
    iters: int,
) -> float:
    tokens = torch.randint(0, 1000, (len(ids), n), device=dev)
    saved = runner._graphs  # benchmark-only switch between the graph and the eager path
    if not graphs:
        runner._graphs = None

    def step() -> None:
        runner.graph_step(ids, tokens)
        for rid in ids:
            runner.truncate(rid, ctx)

    try:
        return timed(step, dev, warmup=3, iters=iters)
    finally:
        runner._graphs = saved


def interleaved_ms(
    runners: dict[str, tuple[ModelRunner, list[str]]],
    b: int,
    n: int,
    dev: torch.device,
    before: Any = None,
    rounds: int = 4,
    ctx: int = 512,
    iters: int = 50,
) -> dict[str, list[float]]:
    """Graph-step ms of each variant's runner (its requests prefilled to `ctx` tokens),
    `rounds` rounds taken in turn (A B A B ...), so a drift of the machine touches every
    variant alike; `before(variant)` runs first each time (e.g. to set an environment switch)."""
    times: dict[str, list[float]] = {v: [] for v in runners}
    for _ in range(rounds):
        for variant, (runner, ids) in runners.items():
            if before is not None:
                before(variant)
            times[variant].append(runner_step_ms(runner, ids[:b], n, ctx, True, dev, iters))
    return times


def hf_eager_ms(hf: Any, b: int, n: int, ctx: int, dev: torch.device, iters: int) -> float:
    from transformers import DynamicCache

    c = hf.config
    kv_shape = (b, c.num_key_value_heads, ctx, c.head_dim or c.hidden_size // c.num_attention_heads)
    cache = DynamicCache()
    for layer in range(c.num_hidden_layers):
        cache.update(
            torch.zeros(kv_shape, dtype=torch.bfloat16, device=dev),
            torch.zeros(kv_shape, dtype=torch.bfloat16, device=dev),
            layer,
        )
    tokens = torch.randint(0, 1000, (b, n), device=dev)

    def step() -> None:
        with torch.inference_mode():
            hf(input_ids=tokens, past_key_values=cache, logits_to_keep=n)
        cache.crop(-n)

    return timed(step, dev, warmup=2, iters=iters)


def hf_compiled_ms(name: str, n: int, ctx: int, iters: int, timeout_s: float) -> float | str:
    """Batch 1: StaticCache + torch.compile, in a child process: a device-side assert inside a
    compiled graph poisons the whole CUDA context, and must not take the runner rows with it."""
    cmd = [
        sys.executable,
        __file__,
        "--hf-compile-child",
        name,
        "--ctx",
        str(ctx),
        "--iters",
        str(iters),
        "--child-tokens",
        str(n),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"skipped: compile took over {timeout_s:.0f} s"
    last = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode == 0 and last[0].startswith("MS "):
        return float(last[0].split()[1])
    tail = (done.stderr.strip().splitlines() or ["?"])[-1]
    return f"skipped: rc={done.returncode}: {tail[:100]}"


def hf_compile_child(name: str, n: int, ctx: int, iters: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    dev = torch.device("cuda")
    config = LlamaConfig(**MODELS[name])
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    cache = StaticCache(config=hf.config, max_cache_len=ctx + 16)
    with torch.inference_mode():
        hf(
            input_ids=torch.zeros(1, ctx, dtype=torch.long, device=dev),
            past_key_values=cache,
            cache_position=torch.arange(ctx, device=dev),
            logits_to_keep=1,
        )
    fwd = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    tokens = torch.randint(0, 1000, (1, n), device=dev)
    pos = torch.arange(ctx, ctx + n, device=dev)

    def step() -> None:
        with torch.inference_mode():
            fwd(input_ids=tokens, past_key_values=cache, cache_position=pos, logits_to_keep=n)

    print(f"MS {timed(step, dev, warmup=3, iters=iters)}", flush=True)


def profile_decode(runner: ModelRunner, ids: list[str], ctx: int, out: Path) -> None:
    """Top CUDA kernels of one eager batch-1 decode step: where the time over the floor goes."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(runner.config.device)
    saved, runner._graphs = runner._graphs, None
    tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            runner.graph_step(ids[:1], tokens)
            runner.truncate(ids[0], ctx)
        sync(dev)
    runner._graphs = saved
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    out.write_text(table)
    print(table, flush=True)


def floor_ms(runner: ModelRunner, b: int, n: int, ctx: int, bandwidth: float) -> float:
    model = runner._backend.model  # type: ignore[union-attr]
    a = model.args
    weights = model.weight_bytes()
    if not a.tie_word_embeddings:  # the embedding table is looked up, not read whole
        weights -= model.w["embed"].numel() * model.w["embed"].element_size()
    kv = b * (ctx + n) * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    return (weights + kv) / bandwidth * 1e3


def compiled_rows(
    name: str,
    spec: dict[str, Any],
    hf: Any,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    dev: torch.device,
    t_start: float,
) -> ModelRunner:
    """Adds graph_compiled_ms to each row: CUDA graphs plus torch.compile'd pointwise ops."""
    sizes = tuple(args.batches)
    _, runner = build(name, spec, dev, args.ctx, max(sizes), sizes, True, hf)
    if not args.decode_kernel:
        runner._backend._kernel = False  # type: ignore[union-attr]
    ids = prefill(runner, max(sizes), args.ctx, dev)
    for row in rows:
        b, n = row["batch"], row["tokens"]
        ms = runner_step_ms(runner, ids[:b], n, args.ctx, True, dev, args.iters)
        row["graph_compiled_ms"] = ms
        elapsed = time.perf_counter() - t_start
        print(f"[{elapsed:6.1f}s] {name} b={b} n={n} graphs+compiled {ms:.3f} ms", flush=True)
    return runner


def best_ms(row: dict[str, Any]) -> float:
    return min(x for x in (row["graph_ms"], row.get("graph_compiled_ms")) if isinstance(x, float))


def bench_model(
    name: str,
    spec: dict[str, Any],
    args: argparse.Namespace,
    dev: torch.device,
    bandwidth: float,
    t_start: float,
) -> list[dict[str, Any]]:
    sizes, ctx, rows = tuple(args.batches), args.ctx, []
    hf, runner = build(name, spec, dev, ctx, max(sizes), sizes if dev.type == "cuda" else ())
    if not args.decode_kernel:  # benchmark-only switch back to the SDPA path
        runner._backend._kernel = False  # type: ignore[union-attr]
    ids = prefill(runner, max(sizes), ctx, dev)
    for b in sizes:
        for n in (1, 5):
            row: dict[str, Any] = dict(
                model=name, batch=b, tokens=n, floor_ms=floor_ms(runner, b, n, ctx, bandwidth)
            )
            row["graph_ms"] = runner_step_ms(runner, ids[:b], n, ctx, True, dev, args.iters)
            row["eager_ms"] = runner_step_ms(runner, ids[:b], n, ctx, False, dev, args.iters)
            try:
                row["hf_eager_ms"] = hf_eager_ms(hf, b, n, ctx, dev, args.iters)
            except Exception as exc:  # report, keep benchmarking the runner
                row["hf_eager_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            compile_ok = args.hf_compile and b == 1 and n == 1 and dev.type == "cuda"
            if (
                compile_ok
                and name in args.hf_compile_models
                and time.perf_counter() - t_start < args.compile_deadline_s
            ):
                row["hf_compile_ms"] = hf_compiled_ms(name, n, ctx, args.iters, 120.0)
            rows.append(row)
            print(f"[{time.perf_counter() - t_start:6.1f}s] {json.dumps(row)}", flush=True)
    if args.profile and dev.type == "cuda":
        profile_decode(runner, ids, ctx, args.out / f"runner_profile_{name}.txt")
    if args.compile_runner and dev.type == "cuda":
        del runner
        try:
            runner = compiled_rows(name, spec, hf, rows, args, dev, t_start)
        except Exception as exc:  # the plain rows stand; say why the compiled ones are missing
            print(f"compiled runner failed: {type(exc).__name__}: {exc}", flush=True)
            for row in rows:
                row.setdefault("graph_compiled_ms", f"failed: {type(exc).__name__}")
    del hf, runner
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def fmt(x: object) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "—" if x is None else str(x)[:30]


def markdown(gpu: str, bandwidth: float, ctx: int, rows: list[dict[str, Any]]) -> str:
    head = (
        f"GPU: {gpu}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); "
        f"bf16 weights, {ctx} tokens of KV per request; times in ms per step.\n\n"
        "| model | batch | tokens | floor | graphs | graphs+compiled | eager | HF eager "
        "| HF compile "
        "| best / floor | HF eager / best |\n" + "|---" * 11 + "|\n"
    )
    lines = [
        f"| {r['model']} | {r['batch']} | {r['tokens']} | {fmt(r['floor_ms'])} "
        f"| {fmt(r['graph_ms'])} | {fmt(r.get('graph_compiled_ms'))} | {fmt(r['eager_ms'])} "
        f"| {fmt(r['hf_eager_ms'])} "
        f"| {fmt(r.get('hf_compile_ms'))} | {best_ms(r) / r['floor_ms']:.2f} "
        f"| {ratio(r['hf_eager_ms'], best_ms(r))} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n\n" + goals_text(rows) + "\n"


def before_after(old: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The earlier run's table, then best-of-runner times before and after, row by row."""
    prev = {(r["model"], r["batch"], r["tokens"]): r for r in old["rows"]}
    lines = [
        "\n## Before\n",
        markdown(old["gpu"], old["bandwidth_bytes_per_s"], old["ctx"], old["rows"]),
        "## Before / after (best of graphs, graphs+compiled)\n",
        "| model | batch | tokens | before | after | speed-up | before / floor | after / floor "
        "| HF eager / after |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        o = prev.get((r["model"], r["batch"], r["tokens"]))
        if o is None:
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tokens']} | {best_ms(o):.3f} "
            f"| {best_ms(r):.3f} | {best_ms(o) / best_ms(r):.2f} "
            f"| {best_ms(o) / o['floor_ms']:.2f} | {best_ms(r) / r['floor_ms']:.2f} "
            f"| {ratio(r['hf_eager_ms'], best_ms(r))} |"
        )
    return "\n".join(lines) + "\n"


def ratio(a: object, b: float) -> str:
    return f"{a / b:.1f}" if isinstance(a, float) else "—"


def goals_text(rows: list[dict[str, Any]]) -> str:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {(r["batch"], r["tokens"]): r for r in rows if r["model"] == model}
        if (1, 1) not in by or (1, 5) not in by:
            continue
        d, v = by[(1, 1)], by[(1, 5)]
        speedup = min(
            (
                r["hf_eager_ms"] / best_ms(r)
                for r in by.values()
                if isinstance(r["hf_eager_ms"], float)
            ),
            default=float("nan"),
        )
        out.append(
            f"- {model} (best of graphs, graphs+compiled): decode b1 = "
            f"{best_ms(d) / d['floor_ms']:.3f}x floor (goal <= 1.3); "
            f"verify-5 / decode at b1 = {best_ms(v) / best_ms(d):.2f} (goal <= 1.15); "
            f"min speed-up over HF eager = {speedup:.1f}x (goal >= 5)"
        )
    return "Goals:\n" + "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny config, CPU, quick")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--no-hf-compile", dest="hf_compile", action="store_false")
    p.add_argument("--hf-compile-models", nargs="+", default=["Llama-3.2-1B"])
    p.add_argument("--compile-deadline-s", type=float, default=240.0)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--no-compile-runner", dest="compile_runner", action="store_false")
    p.add_argument("--no-decode-kernel", dest="decode_kernel", action="store_false")
    p.add_argument("--before", type=Path, help="an earlier run's JSON to compare against")
    p.add_argument("--hf-compile-child", help=argparse.SUPPRESS)
    p.add_argument("--child-tokens", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_compile_child:
        return hf_compile_child(args.hf_compile_child, args.child_tokens, args.ctx, args.iters)
    if args.smoke:
        args.batches, args.ctx, args.iters = [1, 2], 32, 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
    print(f"{gpu}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    models = {"smoke": SMOKE} if args.smoke else {m: MODELS[m] for m in args.models}
    t_start, rows = time.perf_counter(), []
    tag = gpu.replace(" ", "_")
    args.out.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.before.read_text()) if args.before else None
    for name, spec in models.items():
        rows += bench_model(name, spec, args, dev, bandwidth, t_start)
        report = dict(gpu=gpu, bandwidth_bytes_per_s=bandwidth, ctx=args.ctx, rows=rows)
        (args.out / f"runner_{tag}.json").write_text(json.dumps(report, indent=1))
        text = markdown(gpu, bandwidth, args.ctx, rows)
        text += before_after(old, rows) if old else ""
        (args.out / f"runner_{tag}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
