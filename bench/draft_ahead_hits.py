"""Draft-ahead's real hit rate on a real pair, per fan-out F, temperature and Saguaro scale C.

The hit rate is how often the verdict of a step is one the draft drafted ahead for
(draft_service.ahead); the acceptance comes with it. The demo pair (trained once from its fixed
recipe and cached, `specdec demo`), or `--target` / `--draft` checkpoint folders, serves the
demo's Python prompts through both services over real gRPC on loopback (`bench.local`, one
process), k = 4, on the CPU in float32 or on a GPU in bfloat16 (eager forwards: graphs would cap
the hypotheses a pass drafts, and the hit rate is about outcomes, not speed). A hit is an ask
answered from a chain drafted ahead; every other ask is drafted after its verdict as in
lock-step. Each seeded output is compared with draft-ahead off. On the CPU in float32 they must
be identical (exit 1 otherwise). In lower precision a chain drafted ahead comes from a batch of
another shape, whose rounding can move q or the target's logits in the last bits and so one
decision; the outputs are then equal in distribution, not bit for bit, and the report counts
those that differ.

Saguaro sampling (`--saguaro-scales`, DraftConfig.saguaro_scale) makes the draft sample from q
with its F + 1 most likely tokens scaled by C, so that the target's residual after a rejection
falls on the tokens draft-ahead guesses: it raises the hit rate at temperature > 0 and lowers
the acceptance. Each row reports both, and what they give together in the throughput model of
BENCHMARKS.md ("How well the design's throughput model predicted"): modelled tokens per ms at
batch 1 with an 8B / 1B pair's measured H100 costs, E[L] / (T_verify + eps + P(miss) (k T_draft
+ RTT)). A Saguaro row's output differs from the run with draft-ahead off by construction (it
samples from another q, equal in distribution after verification), so only C = 1 rows are
compared with it.

The fan-out spread (`--spread`, DraftConfig.draft_ahead_spread) runs every row of F again with
as many hypotheses a pass chosen by their estimated chance instead of F guesses per accepted
count (its F column reads "F spread"): the same cost per pass, and the hit rate it buys.

    PYTHONPATH=. python bench/draft_ahead_hits.py --out bench/results             # CPU, minutes
    PYTHONPATH=. python bench/draft_ahead_hits.py --device cuda --out bench/results  # a GPU
    PYTHONPATH=. python bench/draft_ahead_hits.py --smoke --out /tmp/hits          # CI's pair
    PYTHONPATH=. python bench/draft_ahead_hits.py --saguaro-scales --out /tmp/hits  # no Saguaro
    PYTHONPATH=. python bench/draft_ahead_hits.py --spread --out /tmp/hits  # and the spread

Writes draft_ahead_hits_<device>.md and .json in --out (cpu, or the GPU's name), with `smoke_`
or the target folder's name before the device for a smoke run or a pair of your own.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.local import local_pair
from bench.provenance import commit, device_name, machine
from draft_service.config import DraftConfig
from orchestrator.demo.models import DemoBudget, build_demo_models
from orchestrator.demo.run import PROMPTS
from specdec.runner import RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.cli import checkpoint_seq_len
from target_service.config import TargetConfig

# an 8B target / 1B draft on H100s at batch 1, k = 4 (BENCHMARKS.md, the throughput model): the
# verify, the k draft steps a miss waits for, the round trip plus Python, and the rest, in ms
VERIFY_MS, DRAFT_K_MS, RTT_MS, EPSILON_MS = 5.9, 4.8, 1.4, 0.3


def modelled_tokens_per_ms(mean_acceptance_length: float, hit_rate: float) -> float:
    """Tokens per ms at batch 1 in the throughput model: a hit hides the draft, a miss waits
    for it. E.g. L = 2, h = 0.5: 2 / (5.9 + 0.3 + 0.5 * 6.2) = 0.215."""
    miss_ms = (1.0 - hit_rate) * (DRAFT_K_MS + RTT_MS)
    return mean_acceptance_length / (VERIFY_MS + EPSILON_MS + miss_ms)


def context(
    target: Path, draft: Path, prompts: Sequence[str], tokens: int, k: int
) -> tuple[list[list[int]], int]:
    """The prompts as the target's token ids, and the positions the runners hold: the whole
    context both checkpoints allow (the demo's 128), at most 2048, since the draft drafts ahead
    while a request has room for twice its drafts. SystemExit if the run does not fit."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    encoded = [tok(p)["input_ids"] for p in prompts]
    length = min(2048, *(checkpoint_seq_len(str(c)) or 2048 for c in (target, draft)))
    if max(map(len, encoded)) + tokens + k + 1 > length:
        raise SystemExit(f"the prompts plus {tokens} new tokens and k + 1 do not fit the "
                         f"{length} positions the runners hold: lower --tokens")  # fmt: skip
    return encoded, length


def run_one(
    target: Path, draft: Path, fanout: int, temperature: float, k: int, tokens: int,
    device: str, dtype: str, encoded: list[list[int]], length: int, saguaro_scale: float = 1.0,
    spread: bool = False,
) -> dict[str, Any]:  # fmt: skip
    slots = len(encoded)
    ahead_slots = fanout * (k + 1) * slots
    runner = {"max_seq_len": length, "device": device, "dtype": dtype}
    draft_config = DraftConfig(
        runner=RunnerConfig(str(draft), max_slots=slots + ahead_slots, **runner),
        draft_ahead=fanout, draft_ahead_slots=ahead_slots, saguaro_scale=saguaro_scale,
        draft_ahead_spread=spread,
    )  # fmt: skip
    target_config = TargetConfig(RunnerConfig(str(target), max_slots=slots, **runner),
                                 sampler_impl="torch")  # fmt: skip
    with local_pair(draft_config, target_config) as svc:
        pipe = svc.pipeline()
        ids = [f"p{i}" for i in range(len(encoded))]
        for i, (rid, prompt) in enumerate(zip(ids, encoded, strict=True)):
            pipe.admit(rid, prompt, SamplingParams(temperature, seed=1234 + i))
        pipe.generate(dict.fromkeys(ids, k), tokens)
        out = [pipe.requests[r].generated[:tokens] for r in ids]
        accepted = sum(r.num_accepted for r in pipe.requests.values())
        drafted = sum(r.num_draft_tokens for r in pipe.requests.values())
        proposals = sum(r.num_drafts for r in pipe.requests.values())
        pipe.close()
        engine = svc.draft_engine
        asks = engine.ahead_hits + engine.ahead_misses
    hit_rate = engine.ahead_hits / asks if asks else None
    length_ = 1 + accepted / proposals if proposals else None
    return {
        "fanout": fanout, "spread": spread, "temperature": temperature,
        "saguaro_scale": saguaro_scale, "k": k,
        "tokens": tokens, "hits": engine.ahead_hits, "asks_with_chains": asks,
        "hit_rate": hit_rate,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": length_,
        "modelled_tokens_per_ms": None if length_ is None
        else modelled_tokens_per_ms(length_, hit_rate or 0.0),
        "output": out,
    }  # fmt: skip


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--smoke", action="store_true",
                   help="CI's tiny demo pair, 2 prompts x 16 tokens")  # fmt: skip
    p.add_argument("--target", type=Path, help="target checkpoint (default: the demo pair)")
    p.add_argument("--draft", type=Path, help="draft checkpoint, with --target")
    p.add_argument("--device", help="cpu or cuda (default: cpu; cuda runs bfloat16)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on the CPU, bfloat16 on a GPU")  # fmt: skip
    p.add_argument("--tokens", type=int, help="new tokens per prompt (default 64; smoke 16)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--seeds", type=int, default=1,
                   help="requests per prompt, each its own seed (more asks a row)")  # fmt: skip
    p.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--temperatures", type=float, nargs="+",
                   help="default 0 0.7 1 (smoke: 0 0.7)")  # fmt: skip
    p.add_argument("--saguaro-scales", type=float, nargs="*", metavar="C",
                   help="Saguaro scales C < 1 also run at each temperature > 0 and F (default "
                        "0.5 0.25, smoke 0.25; none given: plain draft-ahead only)")  # fmt: skip
    p.add_argument("--spread", action="store_true",
                   help="every row of F again with the fan-out spread "
                        "(--draft-ahead-spread)")  # fmt: skip
    args = p.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    if args.device is not None and args.device not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if any(f < 1 for f in args.fanouts) or args.k < 1:
        p.error("-k and every --fanouts value must be at least 1")
    if args.temperatures is None:
        args.temperatures = [0.0, 0.7] if args.smoke else [0.0, 0.7, 1.0]
    if args.saguaro_scales is None:
        args.saguaro_scales = [0.25] if args.smoke else [0.5, 0.25]
    if any(not 0 < c < 1 for c in args.saguaro_scales):
        p.error("every --saguaro-scales value must be in (0, 1): 1 is the plain row")
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.tokens is not None and args.tokens < 1:
        p.error(f"--tokens must be at least 1, got {args.tokens}")
    return args


def configs(args: argparse.Namespace) -> list[tuple[float, int, float, bool]]:
    """(temperature, F, C, spread) of every run: F = 0 (draft-ahead off) first at each
    temperature, then each F plain, then each F with each Saguaro scale (temperature > 0 only:
    greedy rows ignore it); with --spread, then each of those F rows again with the spread."""
    out = []
    for t in args.temperatures:
        fixed = [(t, f, 1.0) for f in args.fanouts]
        if t > 0:
            fixed += [(t, f, c) for c in args.saguaro_scales for f in args.fanouts]
        out += [(t, 0, 1.0, False)] + [(*row, False) for row in fixed]
        if args.spread:
            out += [(*row, True) for row in fixed]
    return out


def table(header: str, rows: list[dict[str, Any]]) -> str:
    """The markdown report: a row per run with draft-ahead on."""

    def num(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [
        f"{header}. Modelled tokens/ms: the throughput model at batch 1 with an 8B / 1B pair's "
        "H100 costs (see the script's docstring); Saguaro C = 1 is plain draft-ahead.",
        "",
        "| temperature | F | Saguaro C | hit rate | hits / asks | acceptance rate | "
        "mean acceptance length | modelled tokens/ms | output same as off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["fanout"] == 0:
            continue
        same = "-" if r["same_output_as_off"] is None else str(r["same_output_as_off"])
        lines.append(
            f"| {r['temperature']} | {r['fanout']}{' spread' if r.get('spread') else ''} | "
            f"{r['saguaro_scale']:g} | "
            f"{num(r['hit_rate'])} | {r['hits']} / {r['asks_with_chains']} | "
            f"{num(r['acceptance_rate'])} | {num(r['mean_acceptance_length'], 2)} | "
            f"{num(r['modelled_tokens_per_ms'])} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    device = args.device or "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    tokens = args.tokens or (16 if args.smoke else 64)
    prompts = PROMPTS[:2] if args.smoke else PROMPTS
    if args.target is not None:
        target, draft, pair = args.target, args.draft, f"{args.target} / {args.draft}"
    else:
        budget = DemoBudget.ci() if args.smoke else DemoBudget()
        demo = build_demo_models(None, budget=budget)
        target, draft = demo.target, demo.draft
        pair = "the CI recipe's demo pair" if args.smoke else "the demo pair"
    encoded, length = context(target, draft, prompts, tokens, args.k)
    encoded *= args.seeds  # request i has seed 1234 + i: the first seeds' are the same as ever
    rows = []
    for t, f, c, spread in tqdm(configs(args), desc="draft-ahead hit rates"):
        rows.append(run_one(target, draft, f, t, args.k, tokens, device, dtype, encoded, length, c,
                            spread=spread))  # fmt: skip
    for r in rows:  # draft-ahead never changes a seeded output; Saguaro's q does (see above)
        base = next(b for b in rows if b["temperature"] == r["temperature"] and b["fanout"] == 0)
        r["same_output_as_off"] = r["output"] == base["output"] if r["saguaro_scale"] == 1 else None
    where = torch.device(device)
    header = (
        f"Draft-ahead hit rate on {pair} (commit {commit(short=True)}, {machine(where)}, "
        f"{dtype}), k = {args.k}, {len(prompts)} prompts x {args.seeds} seeds x {tokens} "
        "tokens"
    )
    text = table(header, rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    label = "smoke_" if args.smoke else "" if args.target is None else f"{args.target.name}_"
    name = f"draft_ahead_hits_{label}{device_name(where)}"
    (args.out / f"{name}.md").write_text(text)
    for r in rows:
        del r["output"]
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    differ = [r for r in rows if r["same_output_as_off"] is False]
    exact = device == "cpu" and dtype == "float32"
    if differ and exact:
        print(f"{len(differ)} configuration(s) changed a seeded output: on the CPU in float32 "
              "draft-ahead must not")  # fmt: skip
    elif differ:
        print(f"{len(differ)} configuration(s) changed a seeded output ({dtype} on {device}: "
              "equal in distribution, not bit for bit; see the module's docstring)")  # fmt: skip
    return 1 if differ and exact else 0


if __name__ == "__main__":
    raise SystemExit(main())
