"""The system benchmark's results: goals against the same run's in-process graph times and
empty round trip, a markdown section (ready to paste at the top of BENCHMARKS.md) and a plot.
Needs no GPU and no torch: `e2e_bench.py --report RESULTS.json` regenerates both."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import e2e_timeline

TARGET_ONLY = "target_only"
# the target alone measured again on the run's last serve start (--serve-target-only-again):
# its "x target-only" is how far the target alone drifted within the run
TARGET_ONLY_AGAIN = "target_only_again"
# tokens/s of lock-step speculation at L = 3 over target-only, per batch
SPEEDUP_GOALS = {1: 1.4, 8: 1.3, 32: 1.05}
LOCKSTEP_SLACK, TARGET_ONLY_SLACK = 1.15, 1.1
# Through specdec serve and the client, at batch 1 and the largest batch: the orchestrator's
# overhead per step (client step - hub step), time per output token over the same config's
# Pipeline row, and time to first token over the in-process prefill of the same prompt length.
SERVE_OVERHEAD_MS, SERVE_TPOT_SLACK, TTFT_SLACK = 0.3, 1.02, 1.3


def config_name(length: float | None) -> str:
    return TARGET_ONLY if length is None else f"lockstep_L{length:g}"


def bounds(result: dict[str, Any], batch: int) -> dict[str, float]:
    """In-process graph step times (ms) at `batch`: decode, verify, draft, and the bounds."""
    k = result["settings"]["num_draft_tokens"]
    t, d = result["inprocess_ms"]["target"], result["inprocess_ms"]["draft"]
    decode, verify, draft = t[f"1,{batch}"], t[f"{k + 1},{batch}"], d[f"1,{batch}"]
    return {"decode": decode, "verify": verify, "draft": draft, "lockstep": k * draft + verify}


STAND_IN = "standin_"  # config names of the draft stand-in's rows (BENCHMARKING ONLY)


def config_label(config: str) -> str:
    """A config's name, marked where the draft was the stand-in (`draft_service.stand_in`)."""
    return f"{config} (STAND-IN)" if config.startswith(STAND_IN) else config


def label(row: dict[str, Any]) -> str:
    """A serve row's name: its placement (where the run had one) and config."""
    config = config_label(row["config"])
    return f"{row['placement']} {config}" if "placement" in row else config


def bound_tokens_per_s(result: dict[str, Any], row: dict[str, Any]) -> float:
    """What the target's GPU allows: committed tokens per step over the in-process graph time
    of the step's target forward (decode for target-only, the (k + 1)-token verify else)."""
    b = bounds(result, row["batch"])
    plain = row["config"] in (TARGET_ONLY, TARGET_ONLY_AGAIN)
    forward_ms = b["decode"] if plain else b["verify"]
    return row["batch"] * row["tokens_per_step_per_request"] / (forward_ms / 1e3)


def _row(result: dict[str, Any], config: str, batch: int) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["config"] == config and r["batch"] == batch), None)


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its measured value, its limit and whether it is met."""
    rtt = result["empty_round_trip"]["median_ms"]
    out = []
    for r in result["rows"]:
        b = bounds(result, r["batch"])
        if r["config"] == TARGET_ONLY:
            limit, what = TARGET_ONLY_SLACK * b["decode"], "1.1 x graph decode"
        else:
            limit = LOCKSTEP_SLACK * b["lockstep"] + 2 * rtt
            what = "1.15 x (k T_draft + T_verify) + 2 empty round trips"
        value = r["step_ms_median"]
        out.append(
            {
                "goal": f"{r['config']} step ms <= {what}",
                "batch": r["batch"],
                "value": value,
                "limit": limit,
                "met": value <= limit,
            }
        )
    for batch, want in SPEEDUP_GOALS.items():
        spec, plain = _row(result, config_name(3.0), batch), _row(result, TARGET_ONLY, batch)
        if spec is None or plain is None:
            continue
        value = spec["tokens_per_s"] / plain["tokens_per_s"]
        out.append(
            {
                "goal": "tokens/s at L = 3 / target-only >=",
                "batch": batch,
                "value": value,
                "limit": want,
                "met": value >= want,
            }
        )
    if result.get("serve"):
        out += serve_goals(result)
    return out


def prefill_ms(result: dict[str, Any], tokens: int) -> float | None:
    """The in-process prefill of one `tokens`-token prompt, where the run measured it."""
    value = result["inprocess_ms"]["target"].get(f"prefill,{tokens}")
    return None if value is None else float(value)


def fallbacks(result: dict[str, Any]) -> list[str]:
    """The serve rows whose window had steps where the draft fell back (missed its deadline or
    was down, so its requests ran at k = 0): their figures are not the configuration's."""
    rows = (result.get("serve") or {}).get("rows", [])
    return [
        f"{r.get('placement', '-')} {r['config']} batch {r['batch']}: "
        f"{r['fallback_steps']:.0f} of {r['hub_steps']:.0f} steps"
        for r in rows
        if r.get("fallback_steps", 0) > 0
    ]


def serve_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    serve, batches = result["serve"], result["settings"]["batches"]
    out = []
    for r in serve["rows"]:
        if r["batch"] not in (1, max(batches)):
            continue
        pipeline = _row(result, r["config"], r["batch"])
        checks = [("orchestrator overhead ms per step <=", r["overhead_ms_per_step"],
                   SERVE_OVERHEAD_MS, r["overhead_ms_per_step"] <= SERVE_OVERHEAD_MS)]  # fmt: skip
        if pipeline is not None:
            tpot = r["tpot_ms_median"] / pipeline["time_per_output_token_ms"]
            checks.append(("TPOT / Pipeline TPOT <=", tpot, SERVE_TPOT_SLACK,
                           tpot <= SERVE_TPOT_SLACK))  # fmt: skip
        for what, value, limit, met in checks:
            out.append({"goal": f"serve {r['config']}: {what}", "batch": r["batch"],
                        "value": value, "limit": limit, "met": met})  # fmt: skip
    for t in serve["ttft"]:
        prefill = prefill_ms(result, t["prompt_len"])
        if prefill is None or t.get("cached_prefix"):  # a cached prefix prefills less
            continue
        value = t["client_ms_median"] / prefill
        out.append(
            {
                "goal": f"serve {t['config']}: TTFT ({t['prompt_len']}-token prompt) / "
                "in-process prefill <=",
                "batch": 1,
                "value": value,
                "limit": TTFT_SLACK,
                "met": value <= TTFT_SLACK,
            }
        )
    return out


# Where a request's time to first token goes, as the server reports it (`Timing`): waiting to
# be sent to a pair; the admission's trip to the target's loop and back, less the services' own
# time; the services' admission (the target's prefill, the draft's overlapped); and from the
# admission's answer to the first token (the first step and its delivery).
TTFT_PARTS = ("queue", "handoff", "prefill", "first_step")


def ttft_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, prefix): each speculative config's median client TTFT over the target's
    alone (the proposer "off" row of the same length and prefix)."""

    def key(r: dict[str, Any]) -> tuple[int, bool]:  # runs before cached rows have none
        return r["prompt_len"], r.get("cached_prefix", False)

    off = {key(r): r for r in rows if r["proposer"] == "off"}
    out = []
    for r in rows:
        base = off.get(key(r))
        if r["proposer"] != "off" and base is not None:
            out.append({"config": r["config"], "prompt_len": r["prompt_len"],
                        "cached_prefix": key(r)[1],
                        "ratio": r["client_ms_median"] / base["client_ms_median"]})  # fmt: skip
    return out


def _f(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"


def _tables(result: dict[str, Any]) -> list[str]:
    lines = [
        "| config | batch | step ms median | p90 | bound ms | step / bound | tokens/s "
        "| ms per output token | tokens per step per request | graphed steps |",
        "|---" * 10 + "|",
    ]
    for r in result["rows"]:
        b = bounds(result, r["batch"])
        bound = b["decode"] if r["config"] == TARGET_ONLY else b["lockstep"]
        lines.append(
            f"| {r['config']} | {r['batch']} | {_f(r['step_ms_median'])} | {_f(r['step_ms_p90'])} "
            f"| {_f(bound)} | {r['step_ms_median'] / bound:.2f} | {_f(r['tokens_per_s'])} "
            f"| {_f(r['time_per_output_token_ms'])} | {r['tokens_per_step_per_request']:.2f} "
            f"| {r['graphed_steps']}/{r['steps']} |"
        )
    lines += [
        "",
        "Where a step's time went (mean ms per step; transport = round trips minus the services' "
        "own time, Python = service time minus device time):",
        "",
        "| config | batch | draft forward | verify forward | sampler | Python (services) "
        "| Python (driver) | transport | sum | mean step |",
        "|---" * 10 + "|",
    ]
    for r in result["rows"]:
        s = r["split_ms_mean"]
        services = s["draft_python"] + s["target_python"]
        lines.append(
            f"| {r['config']} | {r['batch']} | {_f(s['draft_forward'])} "
            f"| {_f(s['verify_forward'])} | {_f(s['sampler'])} | {_f(services)} "
            f"| {_f(s['driver'])} | {_f(s['transport'])} | {_f(sum(s.values()))} "
            f"| {_f(r['step_ms_mean'])} |"
        )
    return lines


def _inprocess(result: dict[str, Any]) -> list[str]:
    k = result["settings"]["num_draft_tokens"]
    lines = [
        f"In-process graph steps (ms; `ModelRunner.graph_step`, {result['settings']['ctx']} "
        "tokens of KV):",
        "",
        f"| batch | target decode (n = 1) | target verify (n = {k + 1}) | draft step (n = 1) "
        f"| k T_draft + T_verify |",
        "|---" * 5 + "|",
    ]
    for batch in result["settings"]["batches"]:
        b = bounds(result, batch)
        lines.append(
            f"| {batch} | {_f(b['decode'])} | {_f(b['verify'])} | {_f(b['draft'])} "
            f"| {_f(b['lockstep'])} |"
        )
    return lines


def _greedy(result: dict[str, Any]) -> str:
    g = result["greedy_check"]
    head = (
        f"Greedy check (real acceptance, batch {g['batch']}, {g['new_tokens']} new tokens, "
        f"target-only vs lock-step k = {g['num_draft_tokens']}): "
    )
    if g["passed"]:
        return head + "identical tokens (passed)."
    diverged = f"{len(g['divergences'])} of {g['batch']} requests diverged"
    diag = result.get("greedy_diagnosis") or {}
    ds = diag.get("divergences", [])
    if "numerics" not in diag:  # not diagnosed, or a result from before the replays
        return head + f"{diverged}; not diagnosed by replay: FAILED."
    noise = max(d["noise_in_std"] for d in ds)
    gap = max(d["gap_in_std"] for d in ds)
    sizes = f"(logit noise between the two up to {noise:.4f} row stds, token gap up to {gap:.4f})"
    smoke = result["settings"].get("smoke")
    if diag["numerics"]:
        verdict = "FAILED (--smoke requires identical tokens)" if smoke else "passed (numerics)"
        return (
            head + f"{diverged}; each divergence reproduced by the target's own forwards of the "
            f"same prefix, replayed as each run computed them: 1-token steps give the "
            f"target-only token, {g['num_draft_tokens'] + 1}-token verify steps the speculative "
            f"token {sizes}: {verdict}."
        )
    bad = [
        f"request {d['request']} at token {d['position']}: "
        + ", ".join(
            what
            for what, ok in (
                ("1-token replay not the target-only token", d["one_token_reproduces_target_only"]),
                ("verify replay not the speculative token", d["verify_reproduces_speculative"]),
            )
            if not ok
        )
        for d in ds
        if not d["numerics"]
    ]
    return (
        head + f"{diverged}; {len(bad)} not reproduced by replaying the target's own forwards "
        f"({'; '.join(bad)}) {sizes}: FAILED."
    )


def _mixed_text(s: dict[str, Any]) -> str:
    """The mixed traffic of the serve rows, if any (BENCHMARKING ONLY)."""
    length, hit = s.get("serve_acceptance_spread", 0.0), s.get("serve_hit_rate_spread", 0.0)
    parts = [f"L ± {length:g}"] * bool(length) + [f"h ± {hit:g}"] * bool(hit)
    if not parts:
        return ""
    return (f", mixed traffic: each request its own {' and '.join(parts)} (uniform by a hash "
            "of its id, narrowed to the valid range)")  # fmt: skip


def _serve(result: dict[str, Any]) -> list[str]:
    serve, s = result["serve"], result["settings"]
    lines = [
        "### Through specdec serve and the client",
        "",
        f"`specdec serve` (a local Ray cluster, the services as Ray actors; placements: "
        f"{_placements_text(serve, s)}) on the same checkpoints and service settings, driven by "
        f"`specdec.client`: B concurrent greedy streams (one thread each) of "
        f"{s['prompt_len']}-token prompts, ignore_eos, k = {s['num_draft_tokens']} for "
        f"speculation; synthetic acceptance (BENCHMARKING ONLY) per serve start, L = "
        f"{', '.join(f'{x:g}' for x in s['serve_lengths'])}{_mixed_text(s)}; target-only rows "
        "(proposer off, "
        f"no acceptance test at k = 0) ran on the first. Window: from {s['warmup']} to "
        f"{s['warmup'] + s['serve_steps']} step responses per request. Client figures are "
        "medians over requests of each request's responses in the window: TPOT = "
        "(t_last - t_first) / tokens "
        "after the first response, step = (t_last - t_first) / steps after the first. Hub step = "
        "the window's `specdec:step_seconds` sum / count; overhead = client step - hub step. "
        "A low gap p10 means responses arrived in bursts (held back, then delivered "
        "together), which makes the client's figures over a short window unreliable.",
        "",
        "| config | batch | TPOT ms | Pipeline TPOT ms | TPOT / Pipeline | client step ms "
        "| steps/s | hub step ms | overhead ms per step | Pipeline step ms | tokens/s "
        "| tokens per step per request | response gap ms p10 / p50 / p90 "
        "| responses per request / hub steps in window |",
        "|---" * 14 + "|",
    ]
    for r in serve["rows"]:
        p = _row(result, r["config"], r["batch"])
        p_tpot = p["time_per_output_token_ms"] if p else float("nan")
        p_step = p["step_ms_mean"] if p else float("nan")
        lines.append(
            f"| {label(r)} | {r['batch']} | {_f(r['tpot_ms_median'])} | {_f(p_tpot)} "
            f"| {r['tpot_ms_median'] / p_tpot:.3f} | {_f(r['client_step_ms_median'])} "
            f"| {_f(r['steps_per_s'])} | {_f(r['hub_ms']['step'])} "
            f"| {_f(r['overhead_ms_per_step'])} | {_f(p_step)} | {_f(r['tokens_per_s'])} "
            f"| {r['tokens_per_step_per_request']:.2f} "
            f"| {' / '.join(_f(r['gap_ms'][q]) for q in ('p10', 'p50', 'p90'))} "
            f"| {r['client_responses_median']:g} / {r['hub_steps']:g} |"
        )
    lines += ["", *_stand_in(serve), *_side_by_side(result)]
    lines += [
        "",
        "The hub's step by part (mean ms per step in the window, from /metrics; draft and "
        "transport averaged over all steps), and the k of the steps that served draft requests "
        "(dynamic speculation's choice): its mean and the share of steps at k = 0:",
        "",
        "| config | batch | draft forward | Propose transport | verify forward | sampler "
        "| hub step | mean k | steps at k = 0 |",
        "|---" * 9 + "|",
    ]
    for r in serve["rows"]:
        h = r["hub_ms"]
        k_mean, k0 = h.get("k_mean"), h.get("k0_share")  # older results lack them
        lines.append(
            f"| {label(r)} | {r['batch']} | {_f(h['draft'])} | {_f(h['transport'])} "
            f"| {_f(h['verify'])} | {_f(h['sampler'])} | {_f(h['step'])} "
            f"| {'-' if k_mean is None else f'{k_mean:.2f}'} "
            f"| {'-' if k0 is None else f'{k0:.2f}'} |"
        )
    lines += [
        "",
        "Time to first token at batch 1 (idle server, median of the timed requests after one "
        "warm-up; client: call to first token, server: Timing.time_to_first_token_s), against "
        "the target's in-process prefill (`ModelRunner.forward` of one prompt of that length, "
        "from an idle device to its logits: one call's latency; in brackets the mean of "
        "back-to-back calls, which overlap each other's launches; then one call after 0.2 s "
        "idle, as a request reaching an idle server finds the host and the device):",
        "",
        "| config | prompt tokens | prefix | client TTFT ms | server TTFT ms | in-process "
        "prefill ms | client / prefill | server: queue / hand-off / prefill / first step ms |",
        "|---" * 8 + "|",
    ]
    for t in serve["ttft"]:
        cached = t.get("cached_prefix", False)  # absent from runs before cached rows
        # a cached prefix's request prefills less than the in-process whole prompt: no column
        prefill = None if cached else prefill_ms(result, t["prompt_len"])
        ratio = f"{t['client_ms_median'] / prefill:.2f}" if prefill else "-"
        parts = t.get("parts_ms_median")  # absent from runs before the split was reported
        split = " / ".join(_f(parts[p]) for p in TTFT_PARTS) if parts else "-"
        shown = "-" if cached else _prefill_shown(result, t["prompt_len"], prefill)
        prefix = f"cached ({t['prefix_hit_tokens_min']} tokens found)" if cached else "none"
        lines.append(
            f"| {t['config']} | {t['prompt_len']} | {prefix} | {_f(t['client_ms_median'])} "
            f"| {_f(t['server_ms_median'])} | {shown} | {ratio} | {split} |"
        )
    ratios = ttft_ratios(serve["ttft"])
    if ratios:
        lines += ["", "Speculation's TTFT over the target's alone (client medians): " + "; ".join(
            f"{r['config']} {r['prompt_len']} tokens"
            f"{', cached prefix' if r['cached_prefix'] else ''}: {r['ratio']:.2f}x"
            for r in ratios
        ) + "."]  # fmt: skip
    return lines


def _prefill_shown(result: dict[str, Any], n: int, prefill: float | None) -> str:
    """The in-process prefill of an n-token prompt as the TTFT table shows it: one call, in
    brackets back-to-back calls' mean, then one call after idling, where measured."""
    target = result["inprocess_ms"]["target"]
    piped = target.get(f"prefill_pipelined,{n}")
    idle = target.get(f"prefill_idle,{n}")
    shown = (_f(prefill) if prefill else "-") + (f" ({_f(piped)})" if piped else "")
    return shown + (f"; idle {_f(idle)}" if idle else "")


def _stand_in(serve: dict[str, Any]) -> list[str]:
    """What the STAND-IN rows are, and the draft times they waited; nothing without them."""
    times = serve.get("stand_in")
    if not times:
        return []
    graphs = {(g["batch"], g["tokens"]): g["seconds"] * 1e3 for g in times["graph_s"]}
    batches = sorted({b for b, _ in graphs})
    fixed, per_token = times["forward_s"]
    fork_fixed, fork_per = times["fork_s"]
    return [
        "Rows marked STAND-IN are BENCHMARKING ONLY: the draft service ran the draft "
        "stand-in (`draft_service.stand_in`), not the draft model. The target had this GPU to "
        "itself, and each draft forward took the time the real draft's forward of that shape "
        f"took on this GPU ({times['gpu']}), measured in this run before the services started "
        "(below), on no GPU. Its drafts are no model's, so its rows use synthetic acceptance "
        "and, drafting ahead, a synthetic hit rate h. They stand in for the draft on a GPU of "
        "its own; a real two-GPU run is a separate measurement.",
        "",
        "| draft graph batch | 1 token ms | 2 tokens ms |",
        "|---|---|---|",
        *(
            f"| {b} | {_f(graphs.get((b, 1), float('nan')))} "
            f"| {_f(graphs.get((b, 2), float('nan')))} |"
            for b in batches
        ),
        "",
        f"Eager forward: {_f(fixed * 1e3)} ms + {per_token * 1e6:.2f} us per token; fork (KV "
        f"copies): {_f(fork_fixed * 1e3)} ms + {fork_per * 1e9:.2f} ns per branch-token.",
        "",
    ]


def _placements_text(serve: dict[str, Any], s: dict[str, Any]) -> str:
    if s["target_device"] == "cpu":
        return "both on the CPU"
    names = {"shared": "shared: both on one GPU", "split": "split: one GPU each"}
    if any(r.get("placement") == "stand-in" for r in serve.get("rows", [])):
        names["stand-in"] = "stand-in: the target on one GPU, the draft's stand-in on none"
        return "; ".join(names[p] for p in [*serve.get("placements", ["shared"]), "stand-in"])
    return "; ".join(names[p] for p in serve.get("placements", ["shared"]))


def _side_by_side(result: dict[str, Any]) -> list[str]:
    """Every serve row: tokens/s against target-only and the bound, time per output token,
    and how busy each GPU was (bench.e2e_timeline)."""
    rows = result["serve"]["rows"]
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["config"] == TARGET_ONLY}
    lines = [
        "Side by side (bound = committed tokens per step / the in-process target forward of the "
        "step: decode for target-only, the (k + 1)-token verify else; GPU busy = the union of "
        "the services' timed device work (forwards, sampler) over the window, from "
        "SPECDEC_GPU_TRACE; host = the share of the window the services' host threads spent "
        "on the critical path between device steps: the hub waiting for drafts, the draft "
        "answering an ask and running its pass ahead (launches, syncs, bookkeeping and the "
        "device time inside it), and in brackets the median span; TPOT p99 over every "
        "response's wait per token it brought):",
        "",
        "| placement | config | batch | tokens/s | x target-only | achieved / bound "
        "| TPOT ms median | TPOT ms p99 | hub step ms | GPU busy | host |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        gain = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        # dynamic speculation runs k below --num-draft-tokens, so no one verify time bounds it
        dynamic = r["config"].removeprefix(STAND_IN).startswith("dynamic")
        achieved = "-" if dynamic else f"{r['tokens_per_s'] / bound_tokens_per_s(result, r):.2f}"
        gpus = r.get("gpus", {})
        shown = ", ".join(f"{g} {f:.0%}" for g, f in gpus.get("busy", {}).items()) or "-"
        median = gpus.get("host_ms", {})
        host = ", ".join(
            f"{n} {f:.0%}" + (f" ({median[n]:.2f} ms)" if n in median else "")
            for n, f in gpus.get("host", {}).items()
        )
        p99 = r.get("tpot_ms_p99")
        lines.append(
            f"| {r.get('placement', '-')} | {config_label(r['config'])} | {r['batch']} "
            f"| {_f(r['tokens_per_s'])} | {gain:.2f} | {achieved} "
            f"| {_f(r['tpot_ms_median'])} | {_f(p99) if p99 is not None else '-'} "
            f"| {_f(r['hub_ms']['step'])} | {shown} | {host or '-'} |"
        )
    drift = [
        f"batch {r['batch']} {r['tokens_per_s'] / base[r['batch']] - 1:+.1%}"
        for r in rows
        if r["config"] == TARGET_ONLY_AGAIN and r["batch"] in base
    ]
    if drift:
        lines += ["", f"{TARGET_ONLY_AGAIN}: the target alone measured again at the run's end, "
                  "on a start with the first one's settings; how far it drifted within the run: "
                  f"{', '.join(drift)}."]  # fmt: skip
    return lines


def markdown(result: dict[str, Any]) -> str:
    env, s = result["environment"], result["settings"]
    rtt = result["empty_round_trip"]
    goal_lines = [
        f"- {'met' if g['met'] else 'MISSED'}: {g['goal']} at batch {g['batch']}: "
        f"{_f(g['value'])} vs {_f(g['limit'])}"
        for g in goals(result)
    ]
    lines = [
        f"## System benchmark (`bench/e2e_bench.py`), {env['gpu']}, {result['date']}",
        "",
        f"{env['gpu']} x {max(env['gpu_count'], 1)} (draft on {s['draft_device']}, target on "
        f"{s['target_device']}{_tp(s)}), driver {env['driver']}; torch {env['torch']}, triton "
        f"{env['triton']}, grpcio {env['grpcio']}, Python {env['python']}. Command: "
        f"`{result['command']}`.",
        "",
        f"Models: {s['models']['target']} target, {s['models']['draft']} draft, {s['dtype']}, "
        f"random weights; {s['prompt_len']}-token prompts, k = {s['num_draft_tokens']}, greedy; "
        f"{s['warmup']} warm-up then {s['steps']} timed steps per row. Lock-step rows use "
        f"synthetic acceptance (BENCHMARKING ONLY) at mean acceptance length L. Empty gRPC "
        f"round trip (lock-step stream, loopback): {rtt['median_ms']:.3f} ms median, "
        f"{rtt['p90_ms']:.3f} ms p90.",
        "",
        *_tables(result),
        "",
        *_inprocess(result),
        "",
        *([*_serve(result), ""] if result.get("serve") else []),
        "Goals:",
        "",
        *goal_lines,
        "",
        _greedy(result),
        *_ahead_lines(result),
        *_fallback_lines(result),
    ]
    return "\n".join(lines) + "\n"


def _ahead_lines(result: dict[str, Any]) -> list[str]:
    """Per draft-ahead row: its window's hit rate and backup proposals, from /metrics."""
    rows = [r for r in (result.get("serve") or {}).get("rows", []) if r.get("draft_ahead")]
    parts = []
    for r in rows:
        a = r["draft_ahead"]
        asks = a["hits"] + a["misses"]
        if asks > 0:
            pushed = f", {a['pushed']:.0f} from pushed chains" if "pushed" in a else ""
            parts.append(f"{r.get('placement', '-')} {r['config']} batch {r['batch']}: hit rate "
                         f"{a['hits'] / asks:.2f} of {asks:.0f} asks{pushed}, "
                         f"{a['backups']:.0f} backups")  # fmt: skip
    if not parts:
        return []
    return ["", "Draft-ahead in the timed windows (hits / (hits + misses); hits from chains "
            "pushed before the verdict, where the run counted them; misses answered with a "
            "backup proposal of no drafts): " + "; ".join(parts) + "."]  # fmt: skip


def _fallback_lines(result: dict[str, Any]) -> list[str]:
    serve_rows = (result.get("serve") or {}).get("rows", [])
    if not any("fallback_steps" in r for r in serve_rows):
        return []  # results from before the benchmark counted them
    rows = fallbacks(result)
    if not rows:
        return ["", "Draft fallbacks: none (every speculative step of every window drafted)."]
    return [
        "",
        "FAILED: the draft fell back (missed its deadline or was down) inside these windows, so "
        "their figures are not the configuration's: " + "; ".join(rows) + ".",
    ]


def speedups(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Tokens/s of each speculation row over target-only at the same batch, through the same
    path: "Pipeline <config>" for the direct driver's rows, "served <config>" for `specdec
    serve`'s. A row without its batch's target-only row is left out."""
    paths = [("Pipeline", result["rows"])]
    if result.get("serve"):
        paths.append(("served", result["serve"]["rows"]))
    out: dict[str, dict[int, float]] = {}
    for path, rows in paths:
        base = {r["batch"]: r["tokens_per_s"] for r in rows if r["config"] == TARGET_ONLY}
        for r in rows:
            if r["config"] != TARGET_ONLY and r["batch"] in base:
                ratio = r["tokens_per_s"] / base[r["batch"]]
                out.setdefault(f"{path} {label(r)}", {})[r["batch"]] = ratio
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    """Step time per batch, and speed-up over target-only per batch (a ratio axis: tokens/s on
    a linear axis hides batch 1); False where matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    batches = result["settings"]["batches"]
    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    color = {config: f"C{i}" for i, config in enumerate(configs)}  # one per config, both panels
    fig, (ax_step, ax_gain) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in configs:
        rows = [r for r in result["rows"] if r["config"] == config]
        xs = [r["batch"] for r in rows]
        ys = [r["step_ms_median"] for r in rows]
        ax_step.plot(xs, ys, "s--", color=color[config], label=f"Pipeline {config}")
    for key, label in (("decode", "in-process decode"), ("lockstep", "in-process k T_d + T_v")):
        ax_step.plot(
            batches,
            [bounds(result, b)[key] for b in batches],
            "k--" if key == "decode" else "k:",
            label=label,
        )
    for name, ratios in speedups(result).items():
        xs = sorted(ratios)
        ys = [ratios[b] for b in xs]
        style = "o-" if name.startswith("served") else "s--"
        ax_gain.plot(xs, ys, style, color=color.get(name.split()[-1]), label=name)
        for x, y in zip(xs, ys, strict=True):
            ax_gain.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(4, 4),
                             fontsize=7)  # fmt: skip
    ax_gain.axhline(1.0, color="k", lw=0.8, label="target-only")
    axes = ((ax_step, "step time, ms (median)"), (ax_gain, "tokens/s over target-only"))
    for ax, ylabel in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(plt, fig, f"specdec served system, {result['environment']['gpu']}", path)
    return True


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merged_by_length(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The serve rows of several runs of one machine as one result for `plot_lengths` (runs at
    different synthetic lengths): the first run's target-only rows, every run's others."""
    rows = [r for r in results[0]["serve"]["rows"] if r["config"] == TARGET_ONLY]
    for result in results:
        rows += [r for r in result["serve"]["rows"] if r["config"] != TARGET_ONLY]
    env = results[0]["environment"]
    gpu = f"{env['gpu']} x {max(env.get('gpu_count', 1), 1)}, {len(results)} runs"
    return {"serve": {"rows": rows}, "environment": {"gpu": gpu}}


def plot_lengths(result: dict[str, Any], path: Path) -> bool:
    """Served tokens/s against the synthetic acceptance length L, one panel per batch, one line
    per placement and config (its L suffix dropped), target-only as a level; False where
    matplotlib is missing or the serve rows ran at fewer than two lengths."""
    rows = (result.get("serve") or {}).get("rows", [])
    lengths = sorted({r["synthetic_length"] for r in rows if r["synthetic_length"] is not None})
    plt = _pyplot()
    if plt is None or len(lengths) < 2:
        return False
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r["batch"] != batch:
                continue
            if r["config"] == TARGET_ONLY:
                ax.axhline(r["tokens_per_s"], color="k", lw=0.8, label="target-only")
                continue
            if r["config"] == TARGET_ONLY_AGAIN:  # no length: a level of its own is noise
                continue
            family = config_label(r["config"].rsplit("_L", 1)[0])  # the config less its L
            name = f"{r.get('placement', '')} {family}".strip()
            lines.setdefault(name, []).append((r["synthetic_length"], r["tokens_per_s"]))
        for name, points in lines.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, "o--" if "STAND-IN" in name else "o-", label=name)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("synthetic mean acceptance length L")
        ax.set_ylabel("tokens/s (served)")
        ax.set_xticks(lengths)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, f"specdec served tokens/s against L, {result['environment']['gpu']}", path)
    return True


def name(result: dict[str, Any]) -> str:
    """The results' file stem: e2e_<GPU>, with _x<N> on a machine of N > 1 GPUs."""
    env = result["environment"]
    count = env.get("gpu_count", 1)
    return f"e2e_{env['gpu'].replace(' ', '_')}" + (f"_x{count}" if count > 1 else "")


def write(result: dict[str, Any], out: Path, stem_name: str | None = None) -> Path:
    """<out>/<stem>.json, .md and .png (stem: `name(result)` unless given); returns the json's
    path."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (stem_name or name(result))
    result["goals"] = goals(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    plot_lengths(result, stem.parent / f"{stem.name}_by_length.png")
    if result.get("serve"):
        title = (f"What each GPU did: the first {e2e_timeline.TIMELINE_S:g} s of each batch-1 "
                 f"serve row's window, {result['environment']['gpu']}")  # fmt: skip
        path = stem.parent / f"{stem.name}_timeline.png"
        e2e_timeline.plot(result["serve"]["rows"], title, path, label)
    return stem.with_suffix(".json")


def _tp(settings: dict[str, Any]) -> str:
    """How the serve rows' target is split, where it is."""
    tp = settings.get("target_tp", 1)
    return f", split over {tp} tensor-parallel ranks" if tp > 1 else ""
