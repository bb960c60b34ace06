"""The paged KV cache (`RunnerConfig.kv_block_size`) against fixed slots, in the runner, on one
device: what it costs a step, how many requests the same memory holds, and what a prefix hit
saves the first token.

1. Step time: a CUDA graph decode step (n = 1) and verify step (n = k + 1) at each batch with
   --ctx tokens of KV per request, fixed slots and each --block-sizes, the runners loaded side
   by side and timed in turn (`runner_bench.interleaved_ms`), so a drift of the machine
   touches every layout alike.
2. Capacity: the memory --capacity-slots fixed slots of --capacity-seq-len positions take, as
   a paged pool; requests of --capacity-prompt prompt + --capacity-output output tokens
   admitted until the pool is full, prefilled, and decoded to their full length (every step
   a real one), against what the slots hold (one request a slot).
3. Time to first token with a cached prefix: a prompt of --prefix-len shared tokens and 16
   more prefilled (one `forward`, device synchronised), then another prompt on the same
   prefix: its time over the first's; with prefix caching off for reference.

    PYTHONPATH=. python bench/paged_bench.py --out bench/results      # GPU: 8B target shapes
    PYTHONPATH=. python bench/paged_bench.py --smoke --out /tmp/paged # CPU, tiny model
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import e2e_models, provenance
from bench.runner_bench import interleaved_ms, prefill, sync
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.kv_cache import PagedCache, SlotCache

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _config(args: argparse.Namespace, path: str, **kv: Any) -> RunnerConfig:
    slots = kv.get("max_slots", max(args.batches))
    graphs = tuple(sorted({s for s in GRAPH_SIZES if s <= slots} | {slots}))  # all at once too
    base = {"max_slots": max(args.batches), "max_seq_len": args.ctx + 64}
    return RunnerConfig(
        path, device=args.device, dtype=args.dtype,
        cuda_graph_batch_sizes=graphs if args.device.startswith("cuda") else (),
        **(base | kv),
    )  # fmt: skip


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_times(args: argparse.Namespace, path: str) -> dict[str, dict[str, float]]:
    """layout → "n,b" → median ms over the rounds."""
    dev = torch.device(args.device)
    layouts = {"slots": {}} | {f"paged {p}": {"kv_block_size": p} for p in args.block_sizes}
    runners = {}
    for name, kv in layouts.items():
        runner = ModelRunner.load(_config(args, path, **kv))
        runners[name] = (runner, prefill(runner, max(args.batches), args.ctx, dev))
    out: dict[str, dict[str, float]] = {name: {} for name in layouts}
    for b in args.batches:
        for n in (1, args.num_draft_tokens + 1):
            view = {name: (r, ids[:b]) for name, (r, ids) in runners.items()}
            timed = interleaved_ms(view, b, n, dev, rounds=args.rounds, ctx=args.ctx,
                                   iters=args.iters)  # fmt: skip
            for name, times in timed.items():
                out[name][f"{n},{b}"] = statistics.median(times)
    del runners, view
    _free()
    return out


def capacity(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Requests of prompt + output tokens that the slots' memory holds, paged, all decoded to
    their full length; against the slots."""
    probe = ModelRunner.load(_config(args, path, max_slots=1, max_seq_len=64))
    layer = probe._cache.layers[0]  # [slots + 1, 2, kv_heads, seq, head_dim]
    layers, kv_heads, head_dim = len(probe._cache.layers), layer.shape[2], layer.shape[4]
    del probe, layer
    _free()
    dtype = getattr(torch, args.dtype)
    budget = SlotCache.bytes_needed(layers, args.capacity_slots, args.capacity_seq_len, kv_heads,
                                    head_dim, dtype)  # fmt: skip
    page = args.block_sizes[0]
    block = PagedCache.bytes_needed(layers, 0, page, kv_heads, head_dim, dtype)  # one block
    blocks = budget // block - 1
    length = args.capacity_prompt + args.capacity_output
    fit = blocks // -(-length // page)
    config = _config(args, path, kv_block_size=page, kv_blocks=blocks, max_slots=min(fit, 4096),
                     max_seq_len=length + 1, prefix_caching=False)  # fmt: skip
    runner = ModelRunner.load(config)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    ids = [f"c{i}" for i in range(config.max_slots)]
    t0 = time.perf_counter()
    for start in range(0, len(ids), 16):
        group = ids[start : start + 16]
        for rid in group:
            runner.add_request(rid)
        prompts = [torch.randint(0, 1000, (args.capacity_prompt,), generator=g) for _ in group]
        runner.forward([ForwardItem(r, p, 1) for r, p in zip(group, prompts, strict=True)])
    sync(dev)
    prefill_s = time.perf_counter() - t0
    tokens = torch.randint(0, 1000, (len(ids), 1), device=dev)
    t0 = time.perf_counter()
    for _ in range(args.capacity_output - 1):
        runner.graph_step(ids, tokens)
    sync(dev)
    decode_s = time.perf_counter() - t0
    lengths = {runner.cached_length(r) for r in ids}
    out = {
        "memory_bytes": budget,
        "block_size": page,
        "blocks": blocks,
        "request_tokens": length,
        "slots_hold": args.capacity_slots,
        "paged_hold": len(ids),
        "ratio": len(ids) / args.capacity_slots,
        "decoded_to": sorted(lengths),
        "prefill_s": round(prefill_s, 2),
        "decode_s": round(decode_s, 2),
        "decode_steps": args.capacity_output - 1,
        "graph_steps": runner.graph_steps,
        "free_blocks_after": runner._cache.pool.available,  # type: ignore[union-attr]
    }
    del runner
    _free()
    return out


def prefix_ttft(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Prefill time of a prompt whose first --prefix-len tokens another prompt had (median of
    --ttft-repeats), with prefix caching on and off."""
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 1000, (args.prefix_len,), generator=g).tolist()
    out: dict[str, Any] = {"prefix_len": args.prefix_len}
    for caching in (True, False):
        config = _config(args, path, kv_block_size=args.block_sizes[0], max_slots=2,
                         max_seq_len=args.prefix_len + 64, prefix_caching=caching)  # fmt: skip
        runner = ModelRunner.load(config)
        first, again = [], []
        for r in range(args.ttft_repeats + 1):  # the first round warms up
            for times in (first, again):
                tail = torch.randint(0, 1000, (16,), generator=g).tolist()
                if times is first:  # a prefix nobody had: its blocks cached from here
                    shared = torch.randint(0, 1000, (args.prefix_len,), generator=g).tolist()
                runner.add_request("t")
                sync(dev)
                t0 = time.perf_counter()
                runner.forward([ForwardItem("t", shared + tail, 1)])
                sync(dev)
                if r:
                    times.append((time.perf_counter() - t0) * 1e3)
                runner.release("t")
        key = "caching" if caching else "no_caching"
        out[key] = {"first_ms": statistics.median(first), "again_ms": statistics.median(again),
                    "ratio": statistics.median(again) / statistics.median(first)}  # fmt: skip
        del runner
        _free()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    paths = e2e_models.build(Path(args.cache), args.smoke, args.device, e2e_models.DEFAULT_PAIR)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": provenance.commit(),
        "machine": provenance.machine(torch.device(args.device)),
        "target": e2e_models.SMOKE_TARGET if args.smoke else e2e_models.TARGET,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "cache")},
    }
    parts = [("steps", step_times), ("capacity", capacity), ("prefix", prefix_ttft)]
    for name, part in tqdm(parts, desc="paged KV", unit="part"):
        result[name] = part(args, paths["target"])
    return result


def report(r: dict[str, Any]) -> str:
    s = r["settings"]
    cols = [f"n = {n}, b = {b}" for b in s["batches"] for n in (1, s["num_draft_tokens"] + 1)]
    lines = [
        f"Paged KV against fixed slots, {r['target']} on {r['machine']} (commit "
        f"{r['commit'][:7]}, {r['date']}).",
        "",
        f"Step ms (graph step, {s['ctx']} tokens of KV per request; median of {s['rounds']} "
        "interleaved rounds; in brackets, over slots):",
        "",
        "| layout | " + " | ".join(cols) + " |",
        "|---" * (1 + 2 * len(s["batches"])) + "|",
    ]
    base = r["steps"]["slots"]
    for name, times in r["steps"].items():
        cells = []
        for key, ms in times.items():
            cells.append(f"{ms:.3f}" + ("" if name == "slots" else f" ({ms / base[key]:.2f}x)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    c, p = r["capacity"], r["prefix"]
    lines += [
        "",
        f"Capacity: the memory of {c['slots_hold']} slots ({c['memory_bytes'] / 2**30:.1f} GiB) "
        f"as {c['blocks']} blocks of {c['block_size']} holds {c['paged_hold']} requests of "
        f"{c['request_tokens']} tokens ({c['ratio']:.2f}x the slots), all decoded to "
        f"{c['decoded_to']} tokens ({c['decode_steps']} steps in {c['decode_s']} s, "
        f"{c['graph_steps']} graphed; prefill {c['prefill_s']} s).",
        "",
        f"Prefix of {p['prefix_len']} tokens + 16: prefill ms of a new prefix, then of another "
        f"prompt on it: caching {p['caching']['first_ms']:.2f} then "
        f"{p['caching']['again_ms']:.2f} ({p['caching']['ratio']:.2f}x); no caching "
        f"{p['no_caching']['first_ms']:.2f} then {p['no_caching']['again_ms']:.2f} "
        f"({p['no_caching']['ratio']:.2f}x).",
    ]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--cache", default=str(e2e_models.DEFAULT_CACHE))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small sizes")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=20, help="steps timed per round")
    p.add_argument("--capacity-slots", type=int, default=32)
    p.add_argument("--capacity-seq-len", type=int, default=8192)
    p.add_argument("--capacity-prompt", type=int, default=1024)
    p.add_argument("--capacity-output", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--ttft-repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.device = "cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.dtype = "bfloat16" if args.device != "cpu" else "float32"
    if args.smoke:
        args.batches, args.ctx, args.rounds, args.iters, args.block_sizes = [1, 4], 40, 2, 3, [4]
        args.capacity_slots, args.capacity_seq_len = 2, 64
        args.capacity_prompt, args.capacity_output = 12, 4
        args.prefix_len, args.ttft_repeats = 32, 2
    if any(b < 1 for b in args.block_sizes) or not args.block_sizes:
        p.error("--block-sizes takes positive sizes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    stem = args.out / f"paged_{provenance.device_name(torch.device(args.device))}"
    provenance.save(stem, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
