"""specdec against Hugging Face transformers on a pair with real acceptance: greedy, batch 1,
the same weights, dtype, device and prompts.

Rows:
- transformers `generate`, the target alone;
- transformers assisted generation (`generate(assistant_model=draft)`: with transformers'
  defaults for the draft length and its early stop, and with k drafts each step like specdec);
- `specdec serve` (its own local Ray cluster, both services on this machine's first GPU, or on
  the CPU) driven by `specdec.client`: the target alone (proposer off) and lock-step
  speculation at k.

Each row runs every prompt once after one untimed warm-up request, one request at a time, and
reports tokens per second (new tokens over the requests' summed wall time, prefill included
in every row alike), milliseconds per output token, and how many requests' tokens equal the
target's own greedy output from transformers (equal up to ties within the forwards' rounding:
docs/design.md, "Exactness"). specdec rows add the acceptance they measured.

The pair: the demo pair (trained here once and cached, `orchestrator.demo.models`; `--smoke`
trains the tiny CI recipe and runs on the CPU), or `--target` / `--draft` checkpoint folders
sharing one tokenizer. The prompts are held-out standard-library source, as the demo's.

    PYTHONPATH=. python bench/hf_assisted_bench.py --out bench/results          # GPU
    PYTHONPATH=. python bench/hf_assisted_bench.py --smoke --out /tmp/hf        # CPU, ~1 min

Writes hf_assisted_<device>.json and .md in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e_serve import serving
from bench.provenance import commit, device_name, machine
from orchestrator.demo import models as demo_models
from orchestrator.demo import training as demo_training
from specdec.client import Client

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_prompts(tokenizer: Any, count: int, chars: int) -> list[list[int]]:
    """`count` held-out source prompts (the demo's), as the target tokenizer's ids."""
    files = demo_models.source_files()
    texts = demo_training.heldout_prompts(files, demo_models.is_heldout, count, chars)
    if len(texts) < count:
        raise RuntimeError(f"only {len(texts)} held-out prompts found, {count} wanted")
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rows(
    run: Callable[[list[int]], list[int]], prompts: Sequence[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[float]]:
    """Each prompt's new tokens and wall seconds, after one untimed warm-up request."""
    run(prompts[0])
    outputs, seconds = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = run(prompt)
        seconds.append(time.perf_counter() - start)
        if len(out) != new_tokens:
            raise RuntimeError(f"{len(out)} tokens generated, {new_tokens} asked for")
        outputs.append(out)
    return outputs, seconds


def hf_rows(
    target_dir: Path, draft_dir: Path, prompts: Sequence[list[int]], new_tokens: int, k: int,
    device: torch.device, dtype: torch.dtype,
) -> dict[str, tuple[list[list[int]], list[float]]]:  # fmt: skip
    """transformers' rows: plain greedy generate, and assisted generation."""
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model = model.to(device=device, dtype=dtype).eval()  # older versions ignore `dtype=`
        config = model.generation_config
        if config.pad_token_id is None:
            config.pad_token_id = config.eos_token_id
        # never stop, as specdec's ignore_eos: min_new_tokens would mask the end-of-sequence
        # token out of the logits instead, and greedy would pick another one there
        config.eos_token_id = None
        return model

    target, draft = load(target_dir), load(draft_dir)

    def generate(**extra: Any) -> Callable[[list[int]], list[int]]:
        def run(prompt: list[int]) -> list[int]:
            ids = torch.tensor([prompt], device=device)
            with torch.inference_mode():
                out = target.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    do_sample=False, **extra,
                )  # fmt: skip
            _sync(device)
            return [int(t) for t in out[0, len(prompt) :]]

        return run

    rows = {"transformers generate": timed_rows(generate(), prompts, new_tokens)}
    rows["transformers assisted (its defaults)"] = timed_rows(
        generate(assistant_model=draft), prompts, new_tokens
    )
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # no early stop: k each step
    rows[f"transformers assisted (k = {k} each step)"] = timed_rows(
        generate(assistant_model=draft), prompts, new_tokens
    )
    return rows


def specdec_rows(
    target_dir: Path, draft_dir: Path, prompts: Sequence[list[int]], new_tokens: int, k: int,
    device: torch.device, dtype: str, log_dir: Path, max_seq_len: int,
) -> dict[str, tuple[list[list[int]], list[float], float | None]]:  # fmt: skip
    """specdec serve's rows: the target alone, and lock-step speculation at k (with its
    measured acceptance: accepted / drafted tokens)."""
    settings = {
        "target_device": device.type,
        "paths": {"target": str(target_dir), "draft": str(draft_dir)},
        "dtype": dtype,
        "max_slots": 4,
        "max_seq_len": max_seq_len,
        "num_draft_tokens": k,
        "graph_sizes": [1],
    }
    rows: dict[str, tuple[list[list[int]], list[float], float | None]] = {}
    with serving(settings, None, log_dir, timeout_s=900.0) as serve, Client(serve.address) as c:
        for name, proposer in (("specdec, target alone", "off"), (f"specdec, k = {k}", "draft")):
            counts: list[tuple[int, int]] = []  # (drafted, accepted) per request, warm-up first

            def run(
                prompt: list[int],
                proposer: str = proposer,
                counts: list[tuple[int, int]] = counts,
            ) -> list[int]:
                out = c.complete(prompt, max_tokens=new_tokens, temperature=0.0,
                                 ignore_eos=True, proposer=proposer,
                                 num_draft_tokens=k if proposer == "draft" else 0)  # fmt: skip
                counts.append((sum(s.num_draft_tokens for s in out.steps),
                               sum(s.num_accepted for s in out.steps)))  # fmt: skip
                return list(out.token_ids)

            outputs, seconds = timed_rows(run, prompts, new_tokens)
            drafted, accepted = (sum(column) for column in zip(*counts[1:], strict=True))
            rows[name] = (outputs, seconds, accepted / drafted if drafted else None)
    return rows


def summarise(
    outputs: list[list[int]], seconds: list[float], reference: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    total = sum(seconds)
    return {
        "tokens_per_s": len(outputs) * new_tokens / total,
        "ms_per_token": 1e3 * total / (len(outputs) * new_tokens),
        "equal_to_greedy": sum(o == r for o, r in zip(outputs, reference, strict=True)),
        "requests": len(outputs),
    }


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    rows = result["rows"]
    base = rows["specdec, k = {}".format(s["k"])]["tokens_per_s"]
    lines = [
        f"### specdec vs transformers, {s['pair']} pair, {result['machine']} "
        f"(commit {result['commit'][:7]}, {result['date']})",
        "",
        f"Greedy, batch 1, {s['prompts']} prompts of {s['prompt_tokens']} tokens (mean), "
        f"{s['new_tokens']} new tokens each, {s['dtype']}; one request at a time after a "
        "warm-up. Equal: requests whose tokens equal transformers' own greedy `generate`.",
        "",
        "| configuration | tokens/s | ms per token | specdec k=" + str(s["k"]) + " is × faster "
        "| acceptance | equal |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        acc = "" if r.get("acceptance") is None else f"{r['acceptance']:.3f}"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} | "
            f"{base / r['tokens_per_s']:.2f}× | {acc} | {r['equal_to_greedy']} of "
            f"{r['requests']} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="the tiny CI pair on the CPU")
    p.add_argument("--target", type=Path, help="target checkpoint (default: the demo pair)")
    p.add_argument("--draft", type=Path, help="draft checkpoint, with --target")
    p.add_argument("--device", help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on a GPU")
    p.add_argument("--prompts", type=int, help="requests per row (default 16; smoke 3)")
    p.add_argument("--prompt-chars", type=int, help="prompt text (default 160; smoke 60)")
    p.add_argument("--new-tokens", type=int, help="per request (default 96; smoke 24)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    args = p.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    if args.prompts is not None and args.prompts < 1:
        p.error(f"--prompts must be at least 1, got {args.prompts}")
    if args.new_tokens is not None and args.new_tokens < 1:
        p.error(f"--new-tokens must be at least 1, got {args.new_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    n_prompts = args.prompts or (3 if args.smoke else 16)
    new_tokens = args.new_tokens or (24 if args.smoke else 96)  # at most: capped below
    if args.target is not None:
        target_dir, draft_dir, pair = args.target, args.draft, str(args.target)
    else:
        budget = demo_models.DemoBudget.ci() if args.smoke else demo_models.DemoBudget()
        demo = demo_models.build_demo_models(budget=budget)
        target_dir, draft_dir = demo.target, demo.draft
        pair = "demo (CI recipe)" if args.smoke else "demo"
    from transformers import AutoConfig, AutoTokenizer

    chars = args.prompt_chars or (60 if args.smoke else 160)
    prompts = load_prompts(AutoTokenizer.from_pretrained(str(target_dir)), n_prompts, chars)
    positions = AutoConfig.from_pretrained(str(target_dir)).max_position_embeddings
    room = positions - max(map(len, prompts)) - args.num_draft_tokens - 1
    if args.new_tokens is None and room >= 1:  # the demo target holds 128 positions
        new_tokens = min(new_tokens, room)
    longest = max(map(len, prompts)) + new_tokens + args.num_draft_tokens + 1
    if longest > positions:
        raise SystemExit(f"prompts plus --new-tokens need {longest} positions; the target has "
                         f"{positions}: lower --new-tokens or --prompt-chars")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    k = args.num_draft_tokens
    print(f"{pair} pair on {device}, {dtype}: {n_prompts} prompts, {new_tokens} new tokens",
          flush=True)  # fmt: skip
    hf = hf_rows(target_dir, draft_dir, prompts, new_tokens, k, device, DTYPES[dtype])
    if device.type == "cuda":
        torch.cuda.empty_cache()  # transformers' models are gone; specdec serve loads its own
    reference = hf["transformers generate"][0]
    ours = specdec_rows(target_dir, draft_dir, prompts, new_tokens, k, device, dtype,
                        args.out / "hf_assisted_logs", positions)  # fmt: skip
    rows: dict[str, Any] = {}
    for name, (outputs, seconds) in hf.items():
        rows[name] = summarise(outputs, seconds, reference, new_tokens)
    for name, (outputs, seconds, acceptance) in ours.items():
        rows[name] = summarise(outputs, seconds, reference, new_tokens) | {"acceptance": acceptance}
    result = {
        "device": device_name(device),
        "machine": machine(device),
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "settings": {
            "pair": pair, "k": k, "prompts": n_prompts, "new_tokens": new_tokens,
            "dtype": dtype, "prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        },
        "rows": rows,
    }  # fmt: skip
    stem = args.out / f"hf_assisted_{result['device']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = report(result)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
