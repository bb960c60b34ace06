"""Soak: many concurrent greedy streams against a real `specdec serve` for a long time.

`specdec serve` runs as a child process on the CPU with the tiny benchmark pair
(`bench.e2e_models`, `--smoke`: the draft is the target plus noise, so drafts are accepted).
First each of `--prompts` distinct prompts is generated alone (its solo-run reference, greedy);
then `--streams` asyncio streams each send requests back to back until `--duration-s` has
passed, each request a prompt of the set under a request id of its own. Checked, per request:
- every response carries the request's own id (none misrouted) and its step numbers follow on
  from 0 without a gap or a repeat (none lost or duplicated);
- the tokens equal the prompt's solo reference, token for token;
- the request ends with finish reason "length" and no error.
Memory: the resident set of `specdec serve` and of every process below it (Ray's and the two
services') is sampled every `--sample-s`; a process's growth is its mean over the last tenth of
the run against its mean over the tenth after the warm-up (`--warmup-s`). Latency: time to first
token (call to first token, as the client sees it) and time per output token ((last token time
− first token time) / (tokens − 1)) of every request, p50 and p99.

Writes soak.json (everything) and soak.md (the figures) under --out; exits 1 if any check
failed or a process of `specdec serve` (the serve process or a service) grew more than
--max-growth-pct.

    python -m bench.soak --duration-s 600 --out bench/results/soak_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.e2e_models import DEFAULT_CACHE, build
from bench.e2e_serve import scrape, serve_env, stop_serve
from bench.e2e_services import REPO, Service, free_port, wait_serving
from bench.provenance import commit
from orchestrator.launch.ray_start import descendants
from specdec.client import AsyncClient, Client

PROMPT_LEN = (4, 24)  # prompt lengths drawn from this range
VOCAB = 1024  # the smoke pair's tokenizer


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    mismatched: int = 0  # tokens differ from the solo reference
    misrouted: int = 0  # a response carried another request's id
    step_errors: int = 0  # steps lost, repeated or out of order
    errors: int = 0  # the call failed
    failures: list[str] = field(default_factory=list)  # the first few, described
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(*PROMPT_LEN))]
            for _ in range(count)]  # fmt: skip


def references(address: str, sets: list[list[int]], max_tokens: int, k: int) -> list[list[int]]:
    """Each prompt generated alone: the tokens every concurrent run of it must equal."""
    out = []
    with Client(address, timeout=120) as client:
        for prompt in sets:
            params: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          proposer="draft", num_draft_tokens=k)  # fmt: skip
            outs = list(client.generate(prompt, **params))
            out.append([t for o in outs for t in o.token_ids])
    return out


async def one_stream(
    client: AsyncClient, index: int, sets: list[list[int]], refs: list[list[int]],
    args: argparse.Namespace, end: float, totals: Totals,
) -> None:  # fmt: skip
    n = 0
    while time.monotonic() < end:
        which = (index + n * 7) % len(sets)
        rid = f"soak-{index}-{n}"
        n += 1
        tokens: list[int] = []
        steps: list[int] = []
        start = time.monotonic()
        first = last = 0.0
        final = None
        try:
            async for out in client.generate(
                sets[which], max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                proposer="draft", num_draft_tokens=args.num_draft_tokens, request_id=rid,
            ):  # fmt: skip
                if out.request_id != rid:
                    totals.misrouted += 1
                    totals.fail(f"{rid}: a response for {out.request_id!r}")
                if out.token_ids:
                    last = time.monotonic()
                    first = first or last
                tokens += out.token_ids
                steps += [s.step for s in out.steps]
                final = out if out.finished else final
        except Exception as e:  # the stream ends: retrying at once would only spin
            totals.errors += 1
            totals.fail(f"{rid}: {type(e).__name__}: {e}")
            return
        totals.requests += 1
        totals.tokens += len(tokens)
        if steps != list(range(len(steps))):
            totals.step_errors += 1
            totals.fail(f"{rid}: steps {steps[:8]}... not 0, 1, 2, ...")
        if tokens != refs[which]:
            totals.mismatched += 1
            pairs = enumerate(zip(tokens, refs[which], strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(tokens), len(refs[which])))
            totals.fail(f"{rid}: {len(tokens)} tokens, first difference at {at}")
        if final is None or final.finish_reason != "length":
            totals.fail(f"{rid}: finish reason {final and final.finish_reason}")
            totals.errors += 1
        totals.ttft_s.append(first - start)
        if len(tokens) > 1:
            totals.tpot_s.append((last - first) / (len(tokens) - 1))


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def name_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in cmd if w]
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].strip()
    if "-m" in words[1:-1]:
        return f"python -m {' '.join(words[words.index('-m') + 1 :][:2])}"
    script = next((Path(w).name for w in words[1:] if w.endswith(".py")), None)
    return f"python {script}" if script else Path(words[0]).name


class Memory:
    """Samples the resident set of `root` and every process below it."""

    def __init__(self, root: int, period_s: float):
        self.root, self.period_s = root, period_s
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            now = time.monotonic() - self._t0
            for pid in {self.root} | descendants(self.root):
                rss = rss_bytes(pid)
                if rss is not None:
                    self.names.setdefault(pid, name_of(pid))
                    self.samples.setdefault(pid, []).append((now, rss))
            if self._stop.wait(self.period_s):
                return

    def growth(self, warmup_s: float, duration_s: float) -> list[dict[str, Any]]:
        """Per process: MB after the warm-up and at the end, and the growth in percent."""
        tenth = max((duration_s - warmup_s) / 10, self.period_s)
        out = []
        for pid, samples in self.samples.items():
            base = [r for t, r in samples if warmup_s <= t < warmup_s + tenth]
            end = [r for t, r in samples if t >= duration_s - tenth]
            if not base or not end:
                continue  # it did not live through the run
            b, e = statistics.fmean(base), statistics.fmean(end)
            out.append({"pid": pid, "name": self.names[pid], "after_warmup_mb": b / 2**20,
                        "end_mb": e / 2**20, "growth_pct": 100 * (e - b) / b})  # fmt: skip
        return sorted(out, key=lambda g: -g["end_mb"])


def ours(name: str) -> bool:
    """The processes of specdec itself (`specdec serve`'s two processes, the command and the
    orchestrator it runs as its child, and the two services)."""
    return name.startswith("python -m orchestrator serve") or "ServiceActor" in name


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def load(address: str, sets: list[list[int]], refs: list[list[int]],
               args: argparse.Namespace, totals: Totals) -> None:  # fmt: skip
    end = time.monotonic() + args.duration_s
    async with AsyncClient(address, timeout=600) as client:
        tasks = [asyncio.create_task(one_stream(client, i, sets, refs, args, end, totals))
                 for i in range(args.streams)]  # fmt: skip
        with tqdm(total=round(args.duration_s), unit="s", desc="soak", file=sys.stderr) as bar:
            while not all(t.done() for t in tasks):
                await asyncio.sleep(1.0)
                elapsed = round(args.duration_s - max(0.0, end - time.monotonic()))
                bar.update(elapsed - bar.n)
                bar.set_postfix(requests=totals.requests, tokens=totals.tokens,
                                bad=totals.mismatched + totals.misrouted + totals.step_errors
                                + totals.errors)  # fmt: skip
        await asyncio.gather(*tasks)


def serve(paths: dict[str, str], args: argparse.Namespace, log: Path) -> tuple[Service, str]:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "orchestrator", "serve", "--target", paths["target"], "--draft",
           paths["draft"], "--device", "cpu", "--sampler-impl", "torch", "--num-cpus", "4",
           "--max-requests", str(args.max_requests), "--max-queue", str(args.streams),
           "--max-concurrent-calls", str(args.streams + 8),
           "--max-workers", str(args.streams + 32),
           "--max-seq-len", "256", "--proposer", "draft",
           "--num-draft-tokens", str(args.num_draft_tokens), "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", str(metrics_port), "--grace-s", "1"]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        process = subprocess.Popen(cmd, cwd=REPO, env=serve_env(), stdout=f, stderr=f,
                                   start_new_session=True)  # fmt: skip
    return Service(
        "serve", process, f"127.0.0.1:{port}", log
    ), f"http://127.0.0.1:{metrics_port}/metrics"


def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = build(args.cache, smoke=True, device="cpu")
    service, metrics_url = serve(paths, args, args.out / "soak_serve.log")
    totals = Totals()
    try:
        wait_serving(service, args.start_timeout_s)
        sets = prompts(args.prompts, args.seed)
        refs = references(service.address, sets, args.max_tokens, args.num_draft_tokens)
        memory = Memory(service.process.pid, args.sample_s)
        before = scrape(metrics_url)
        memory.start()
        started = time.monotonic()
        asyncio.run(load(service.address, sets, refs, args, totals))
        wall_s = time.monotonic() - started
        memory.stop()
        after = scrape(metrics_url)
    finally:
        stopped = stop_serve(service)
    growth = memory.growth(args.warmup_s, wall_s)
    grown = [g for g in growth if ours(g["name"]) and g["growth_pct"] > args.max_growth_pct]
    bad = totals.mismatched + totals.misrouted + totals.step_errors + totals.errors
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafted = delta.get("specdec:spec_decode_num_draft_tokens_total", 0.0)
    result = {
        "commit": commit(short=True), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": wall_s, "requests": totals.requests, "tokens": totals.tokens,
        "tokens_per_s": totals.tokens / wall_s,
        "mismatched": totals.mismatched, "misrouted": totals.misrouted,
        "step_errors": totals.step_errors, "errors": totals.errors, "failures": totals.failures,
        "ttft_s": {"p50": percentile(totals.ttft_s, 0.5), "p99": percentile(totals.ttft_s, 0.99)},
        "tpot_s": {"p50": percentile(totals.tpot_s, 0.5), "p99": percentile(totals.tpot_s, 0.99)},
        "acceptance_rate": delta.get("specdec:spec_decode_num_accepted_tokens_total", 0.0)
        / drafted if drafted else None,
        "draft_fallback_steps": delta.get("specdec:draft_fallback_steps_total", 0.0),
        "memory": growth, "grown": [g["name"] for g in grown],
        "passed": bad == 0 and not grown, "serve_stopped": stopped,
    }  # fmt: skip
    return result


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"# Soak (CPU): {s['streams']} streams, {r['wall_s'] / 60:.1f} min",
        "",
        f"Commit {r['commit']}, {r['machine']}; `specdec serve` with the tiny smoke pair, "
        f"--max-requests {s['max_requests']}, k = {s['num_draft_tokens']}, {s['max_tokens']} "
        f"tokens per request, {s['prompts']} prompts. Result: "
        f"**{'PASS' if r['passed'] else 'FAIL'}**.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| requests finished | {r['requests']:,} |",
        f"| tokens | {r['tokens']:,} ({r['tokens_per_s']:.0f}/s) |",
        f"| tokens different from the solo run | {r['mismatched']} requests |",
        f"| misrouted responses | {r['misrouted']} |",
        f"| steps lost or repeated | {r['step_errors']} requests |",
        f"| failed calls | {r['errors']} |",
        f"| time to first token p50 / p99 | {r['ttft_s']['p50'] * 1e3:.0f} / "
        f"{r['ttft_s']['p99'] * 1e3:.0f} ms |",
        f"| time per output token p50 / p99 | {r['tpot_s']['p50'] * 1e3:.1f} / "
        f"{r['tpot_s']['p99'] * 1e3:.1f} ms |",
        f"| acceptance rate | {r['acceptance_rate'] or 0:.2f} |",
        f"| steps at k = 0 for a draft fault | {r['draft_fallback_steps']:.0f} |",
        "",
        f"Resident memory after the {s['warmup_s']:.0f} s warm-up and at the end (means over a "
        "tenth of the run each):",
        "",
        "| process | after warm-up MB | end MB | growth |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {g['name']} | {g['after_warmup_mb']:.0f} | {g['end_mb']:.0f} | "
            f"{g['growth_pct']:+.1f}% |"
            for g in r["memory"]
        ),
    ]
    if r["failures"]:
        lines += ["", "First failures:", "", *(f"- {f}" for f in r["failures"])]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--max-requests", type=int, default=64, help="requests the pair runs at once")
    p.add_argument("--warmup-s", type=float, help="default: a fifth of the duration")
    p.add_argument("--sample-s", type=float, default=2.0, help="memory sampling period")
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak_cpu")
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = args.duration_s / 5
    if not 0 <= args.warmup_s < args.duration_s:
        p.error("--warmup-s must be in [0, --duration-s).")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "soak.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
