"""The system benchmark's serve mode: the benchmarking-only synthetic acceptance flag of
`specdec serve` (flag → ServeConfig → the target's SyntheticAcceptance), and the window and
/metrics arithmetic of `bench.e2e_serve`. The end-to-end run is in test_e2e_bench (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import e2e_report
from bench.e2e_serve import (
    Stream,
    hub_ms,
    mixed_spread,
    parse_metrics,
    placements,
    progress_units,
    seq_len_needed,
    serve_args,
    serve_starts,
    stand_in_starts,
    window_figures,
)
from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.config import ServiceConfig
from orchestrator.launch.services import synthetic_acceptance


def _config(target: Path, draft: Path, *flags: str) -> ServiceConfig:
    args = parse_args(["serve", "--target", str(target), "--draft", str(draft), *flags])
    return serve_config(args).services


def test_synthetic_flag_reaches_the_target_config(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    plain = _config(target, draft)
    assert plain.synthetic_acceptance_length is None and synthetic_acceptance(plain) is None
    config = _config(target, draft, "--synthetic-acceptance-length", "2.5", "-k", "3")
    assert (config.synthetic_acceptance_length, config.synthetic_num_draft_tokens) == (2.5, 3)
    synthetic = synthetic_acceptance(config)
    assert synthetic.num_draft_tokens == 3 and synthetic.mean_acceptance_length == 2.5
    assert synthetic.unconditional_rates() == (1.0, 0.5, 0.0)


def test_synthetic_flag_refusals(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    with pytest.raises(ValueError, match=r"must be in \[1, 5\]"):
        _config(target, draft, "--synthetic-acceptance-length", "5.5", "-k", "4")
    with pytest.raises(ValueError, match=r"num_draft_tokens in \[1, max_num_draft_tokens=16\]"):
        _config(target, draft, "--synthetic-acceptance-length", "1", "-k", "0")
    with pytest.raises(ValueError, match="go together"):
        ServiceConfig(str(target), synthetic_acceptance_length=2.0)


def test_window_figures_use_the_responses_inside_the_window() -> None:
    rec = Stream(
        times=[0.0, 1.0, 1.01, 1.03, 1.04, 2.0],
        tokens=[3, 1, 3, 2, 5, 1],
        steps=[1, 1, 1, 1, 1, 1],
    )
    f = window_figures(rec, 0.5, 1.5)  # responses at 1.0, 1.01, 1.03, 1.04
    assert f is not None
    assert f["steps"] == 3 and f["tokens"] == 10
    assert f["step_ms"] == pytest.approx(40.0 / 3) and f["tpot_ms"] == pytest.approx(4.0)
    assert f["responses"] == 4 and f["gaps_ms"] == pytest.approx([10.0, 20.0, 10.0])
    assert window_figures(rec, 1.5, 2.5) is None  # one response only


def test_hub_ms_is_the_window_delta_per_step() -> None:
    before = {"specdec:step_seconds_count": 10.0, "specdec:step_seconds_sum": 0.1,
              "specdec:step_verify_seconds_sum": 0.05}  # fmt: skip
    after = {"specdec:step_seconds_count": 30.0, "specdec:step_seconds_sum": 0.3,
             "specdec:step_verify_seconds_sum": 0.17,
             "specdec:step_draft_seconds_sum": 0.04,
             "specdec:draft_fallback_steps_total": 3.0,
             "specdec:draft_ahead_hits_total": 12.0, "specdec:draft_ahead_misses_total": 5.0,
             "specdec:draft_ahead_backups_total": 4.0}  # fmt: skip
    h = hub_ms(before, after)
    assert h["steps"] == 20 and h["step"] == pytest.approx(10.0)
    assert h["fallback_steps"] == 3.0
    assert (h["ahead_hits"], h["ahead_misses"], h["ahead_backups"]) == (12.0, 5.0, 4.0)
    assert h["verify"] == pytest.approx(6.0) and h["draft"] == pytest.approx(2.0)
    assert h["sampler"] == 0.0
    with pytest.raises(RuntimeError, match="no step"):
        hub_ms(after, after)


def test_the_k_of_the_steps_is_read_from_the_metrics_histogram() -> None:
    """The orchestrator's step k histogram, as /metrics serves it: the window's mean k and the
    share of its steps at k = 0 (what dynamic speculation chose)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from orchestrator.core.metrics import K_BUCKETS

    registry = CollectorRegistry()
    k = Histogram("specdec:step_num_draft_tokens", "k", ("model_pair",), registry=registry,
                  buckets=K_BUCKETS).labels("t/d")  # fmt: skip
    step = Histogram("specdec:step_seconds", "s", ("model_pair",), registry=registry).labels("t/d")
    for _ in range(2):
        k.observe(4)
        step.observe(0.01)
    before = parse_metrics(generate_latest(registry).decode())
    for value in (0, 0, 0, 4, 1, 0):
        k.observe(value)
        step.observe(0.005)
    h = hub_ms(before, parse_metrics(generate_latest(registry).decode()))
    assert h["steps"] == 6 and h["step"] == pytest.approx(5.0)
    assert h["k_mean"] == pytest.approx(5 / 6) and h["k0_share"] == pytest.approx(4 / 6)
    assert "k_mean" not in hub_ms(before | {"specdec:step_seconds_count": 0.0}, before)


def test_serve_args_match_the_pipeline_services(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    s = {"paths": {"target": str(target), "draft": str(draft)}, "target_device": "cuda:0",
         "dtype": "bfloat16", "max_slots": 32, "max_seq_len": 576, "num_draft_tokens": 4,
         "graph_sizes": [1, 2, 4, 8, 16, 32]}  # fmt: skip
    args = parse_args(serve_args(s, 3.0, 50051, 9465))
    config = serve_config(args)
    services = config.services
    assert (services.device, services.dtype, services.max_requests) == ("cuda", "bfloat16", 32)
    assert services.max_seq_len == 576 and services.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert services.synthetic_acceptance_length == 3.0 and services.synthetic_num_draft_tokens == 4
    assert config.scheduler.proposer == "draft" and config.scheduler.num_draft_tokens == 4
    assert (config.port, config.metrics_port) == (50051, 9465)
    cpu = serve_config(parse_args(serve_args(s | {"target_device": "cpu"}, None, 1, 2)))
    assert cpu.services.sampler_impl == "torch" and cpu.services.cuda_graph_batch_sizes == ()
    assert cpu.services.synthetic_acceptance_length is None
    assert (services.draft_ahead, services.synthetic_hit_rate) == (0, None)
    ahead = serve_config(parse_args(serve_args(s | {"draft_ahead": 2}, 3.0, 1, 2, 0.8)))
    assert (ahead.services.draft_ahead, ahead.services.synthetic_hit_rate) == (2, 0.8)
    assert services.kv_block_size == 0
    paged = serve_config(parse_args(serve_args(s | {"kv_block_size": 16}, 3.0, 1, 2)))
    assert paged.services.kv_block_size == 16 and paged.services.prefix_caching
    assert (services.synthetic_acceptance_spread, ahead.services.synthetic_hit_rate_spread) == (
        0.0, 0.0,
    )  # fmt: skip


def test_mixed_traffic_spreads_reach_the_services_narrowed_to_their_range(
    checkpoints: tuple[Path, Path],
) -> None:
    """--serve-acceptance-spread / --serve-hit-rate-spread: each serve start gets the spreads,
    narrowed so that every request's L stays in [1, k + 1] and its h in [0, 1]."""
    target, draft = checkpoints
    s = {"paths": {"target": str(target), "draft": str(draft)}, "target_device": "cuda:0",
         "dtype": "bfloat16", "max_slots": 8, "max_seq_len": 256, "num_draft_tokens": 4,
         "graph_sizes": [1, 2, 4, 8], "draft_ahead": 2, "serve_acceptance_spread": 1.5,
         "serve_hit_rate_spread": 0.3}  # fmt: skip
    mixed = serve_config(parse_args(serve_args(s, 3.0, 1, 2, 0.8))).services
    assert mixed.synthetic_acceptance_spread == 1.5
    assert mixed.synthetic_hit_rate_spread == pytest.approx(0.2)  # h = 0.8: room for 0.2
    edge = serve_config(parse_args(serve_args(s, 4.5, 1, 2, 1.0))).services
    assert edge.synthetic_acceptance_spread == 0.5 and edge.synthetic_hit_rate_spread == 0.0
    assert mixed_spread(2.0, 1.0, 1.0, 5.0) == 0.0
    # narrowed to the range's end by a rounding (1.4 - 0.39999...): still a valid start
    low = serve_config(parse_args(serve_args(s, 1.4, 1, 2, 0.8))).services
    assert low.synthetic_acceptance_spread == pytest.approx(0.4)


def test_no_push_rows_pair_each_draft_ahead_row_with_pushes_off(
    checkpoints: tuple[Path, Path],
) -> None:
    """--serve-no-push: beside each draft-ahead start, the same start whose serve flags turn
    pushed chains off; the progress bar counts them."""
    target, draft = checkpoints
    s: dict[str, Any] = {
        "paths": {"target": str(target), "draft": str(draft)}, "target_device": "cpu",
        "dtype": "float32", "max_slots": 4, "max_seq_len": 128, "num_draft_tokens": 4,
        "graph_sizes": [], "draft_ahead": 2, "serve_hit_rates": [1.0, 0.8], "batches": [1],
        "serve_lengths": [3.0], "serve_steps": 8, "ttft_prompt_lens": [64], "ttft_repeats": 1,
        "serve_placements": ["split"],
    }  # fmt: skip
    plain = serve_starts(s, 3.0)
    assert [c for c, *_ in plain] == ["lockstep_L3", "ahead_h1_L3", "ahead_h0.8_L3"]
    paired = serve_starts(s | {"serve_no_push": True}, 3.0)
    assert [c for c, *_ in paired] == ["lockstep_L3", "ahead_h1_L3", "ahead_nopush_h1_L3",
                                       "ahead_h0.8_L3", "ahead_nopush_h0.8_L3"]  # fmt: skip
    for config, hit_rate, dynamic, extra in paired:
        flags = serve_args(s, 3.0, 1, 2, hit_rate, "split", dynamic, None, extra)
        services = serve_config(parse_args(flags)).services
        assert services.draft_push_chains is ("nopush" not in config), config
    more = progress_units(s | {"serve_no_push": True}) - progress_units(s)
    assert more == 2 * len(s["batches"]) * s["serve_steps"]


def test_stand_in_starts_and_their_flags(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    """BENCHMARKING ONLY: the stand-in's starts (lock-step, per hit rate, dynamic) in order, a
    dynamic one with dynamic speculation and no draft-ahead; the progress bar counts them."""
    target, draft = checkpoints
    s: dict[str, Any] = {
        "paths": {"target": str(target), "draft": str(draft)}, "target_device": "cpu",
        "dtype": "float32", "max_slots": 4, "max_seq_len": 128, "num_draft_tokens": 4,
        "graph_sizes": [], "draft_ahead": 2, "batches": [1, 8], "serve_lengths": [1.5],
        "serve_steps": 8, "ttft_prompt_lens": [64], "ttft_repeats": 1,
        "serve_placements": ["shared"], "serve_stand_in": [0.8],
    }  # fmt: skip
    assert stand_in_starts(s | {"serve_stand_in": []}) == []
    every = s | {"serve_stand_in_lockstep": True, "serve_stand_in_dynamic": True}
    starts = stand_in_starts(every)
    assert starts == [("standin_lockstep", None, False), ("standin_ahead_h0.8", 0.8, False),
                      ("standin_dynamic", None, True)]  # fmt: skip
    times = tmp_path / "times.json"
    times.write_text("{}")
    _, hit_rate, dynamic = starts[-1]
    services = serve_config(
        parse_args(serve_args(s, 1.5, 1, 2, hit_rate, "shared", dynamic, times))
    ).services
    assert services.dynamic_speculation and services.draft_ahead == 0
    assert services.draft_stand_in == times
    more = progress_units(every) - progress_units(s)
    assert more == 2 * len(s["batches"]) * s["serve_steps"]


def test_a_tensor_parallel_target_runs_split_on_n_plus_one_gpus(
    checkpoints: tuple[Path, Path],
) -> None:
    target, draft = checkpoints
    s = {"paths": {"target": str(target), "draft": str(draft)}, "target_device": "cuda:0",
         "dtype": "bfloat16", "max_slots": 8, "max_seq_len": 128, "num_draft_tokens": 4,
         "graph_sizes": [1, 8], "target_tp": 2, "serve_placements": None}  # fmt: skip
    config = serve_config(parse_args(serve_args(s, 3.0, 1, 2, placement="split")))
    assert config.services.target_tensor_parallel == 2 and config.placement.num_gpus == 3
    assert placements({"settings": s, "environment": {"gpu_count": 4}}) == ["split"]
    with pytest.raises(ValueError, match="runs the split placement only, on 3 GPUs; this "
                                         "machine has 2"):  # fmt: skip
        placements({"settings": s, "environment": {"gpu_count": 2}})
    with pytest.raises(ValueError, match="split placement only"):
        placements({"settings": s | {"serve_placements": ["shared"]},
                    "environment": {"gpu_count": 4}})  # fmt: skip


def test_sequences_fit_the_serve_rows_and_ttft() -> None:
    s = {"prompt_len": 64, "warmup": 16, "serve_steps": 64, "num_draft_tokens": 4,
         "ttft_prompt_lens": [512, 256]}  # fmt: skip
    assert seq_len_needed(s) == max(64 + 88 * 5, 512 + 2) + 5
    assert seq_len_needed(s | {"ttft_prompt_lens": [512, 4096]}) == 4096 + 2 + 5


def test_serve_goals_against_the_pipeline_rows_and_the_prefill() -> None:
    def row(batch: int, tpot: float, overhead: float) -> dict[str, Any]:
        return {"config": "target_only", "batch": batch, "tpot_ms_median": tpot,
                "overhead_ms_per_step": overhead}  # fmt: skip

    result = {
        "settings": {"batches": [1, 8, 32], "num_draft_tokens": 4},
        "empty_round_trip": {"median_ms": 0.2},
        "inprocess_ms": {"target": {"prefill,512": 20.0}, "draft": {}},
        "rows": [
            {"config": "target_only", "batch": 1, "time_per_output_token_ms": 5.0},
            {"config": "target_only", "batch": 32, "time_per_output_token_ms": 6.0},
        ],
        "serve": {
            "rows": [row(1, 5.05, 0.2), row(8, 9.0, 9.0), row(32, 6.3, 0.4)],  # 8: no goal
            "ttft": [
                {"config": "target_only", "prompt_len": 512, "client_ms_median": 25.0},
                # a cached prefix prefills less than the in-process prefill: no goal
                {
                    "config": "target_only",
                    "prompt_len": 512,
                    "client_ms_median": 5.0,
                    "cached_prefix": True,
                },
            ],
        },
    }
    goals = {(g["goal"], g["batch"]): g for g in e2e_report.serve_goals(result)}
    assert len(goals) == 5
    overhead = "serve target_only: orchestrator overhead ms per step <="
    tpot = "serve target_only: TPOT / Pipeline TPOT <="
    assert goals[(overhead, 1)]["met"] and not goals[(overhead, 32)]["met"]
    assert goals[(tpot, 1)]["value"] == pytest.approx(1.01) and goals[(tpot, 1)]["met"]
    assert goals[(tpot, 32)]["value"] == pytest.approx(1.05) and not goals[(tpot, 32)]["met"]
    ttft = goals[("serve target_only: TTFT (512-token prompt) / in-process prefill <=", 1)]
    assert ttft["value"] == pytest.approx(1.25) and ttft["met"]


def test_a_window_where_the_draft_fell_back_fails_the_benchmark() -> None:
    """A speculative row whose draft missed its deadline measured target-only steps: the report
    names it and the run's exit code says so (gpu_check then fails)."""

    def row(config: str, fallback: float) -> dict[str, Any]:
        return {"placement": "shared", "config": config, "batch": 8, "hub_steps": 32.0,
                "fallback_steps": fallback}  # fmt: skip

    clean = {"serve": {"rows": [row("target_only", 0), row("lockstep_L3", 0)]}}
    assert e2e_report.fallbacks(clean) == []
    assert "Draft fallbacks: none" in "\n".join(e2e_report._fallback_lines(clean))
    bad = {"serve": {"rows": [row("target_only", 0), row("lockstep_L3", 32)]}}
    assert e2e_report.fallbacks(bad) == ["shared lockstep_L3 batch 8: 32 of 32 steps"]
    assert "FAILED" in "\n".join(e2e_report._fallback_lines(bad))


def test_stand_in_flag_reaches_the_draft_config(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """BENCHMARKING ONLY: `--draft-stand-in` needs synthetic acceptance and an existing file."""
    target, draft = checkpoints
    times = tmp_path / "times.json"
    times.write_text("{}")
    s = {"paths": {"target": str(target), "draft": str(draft)}, "target_device": "cuda:0",
         "dtype": "bfloat16", "max_slots": 8, "max_seq_len": 576, "num_draft_tokens": 4,
         "graph_sizes": [1, 2, 4, 8], "draft_ahead": 2}  # fmt: skip
    config = serve_config(parse_args(serve_args(s, 3.0, 1, 2, 0.8, stand_in=times)))
    assert config.services.draft_stand_in == times
    assert serve_config(parse_args(serve_args(s, 3.0, 1, 2))).services.draft_stand_in is None
    with pytest.raises(ValueError, match="needs a draft and synthetic acceptance"):
        _config(target, draft, "--draft-stand-in", str(times))
    with pytest.raises(ValueError, match="is not a file"):
        _config(target, draft, "--synthetic-acceptance-length", "2", "--draft-stand-in",
                str(tmp_path / "missing.json"))  # fmt: skip


def _serve_row(config: str, batch: int, length: float | None, tps: float) -> dict[str, Any]:
    return {"placement": "shared", "config": config, "batch": batch, "synthetic_length": length,
            "tokens_per_s": tps}  # fmt: skip


def test_stand_in_rows_are_marked_and_their_times_shown() -> None:
    rows = [_serve_row("target_only", 1, None, 100.0), _serve_row("lockstep_L3", 1, 3.0, 130.0),
            _serve_row("standin_ahead_h1_L3", 1, 3.0, 250.0)]  # fmt: skip
    assert [e2e_report.label(r) for r in rows] == [
        "shared target_only", "shared lockstep_L3", "shared standin_ahead_h1_L3 (STAND-IN)"
    ]  # fmt: skip
    times = {"gpu": "NVIDIA H100", "forward_s": [0.001, 2e-6], "fork_s": [1e-5, 1e-9],
             "graph_s": [{"batch": 1, "tokens": 1, "seconds": 0.00098},
                         {"batch": 1, "tokens": 2, "seconds": 0.00101}]}  # fmt: skip
    text = "\n".join(e2e_report._stand_in({"stand_in": times}))
    assert "BENCHMARKING ONLY" in text and "NVIDIA H100" in text
    assert "| 1 | 0.980 | 1.010 |" in text
    assert e2e_report._stand_in({}) == []


def test_the_target_alone_again_shows_the_drift_and_is_bounded_by_the_decode() -> None:
    """--serve-target-only-again: its rows' x target-only is the target alone's drift within
    the run, said in a line under the table, and their bound is the decode's, as the first
    target-only rows'; the progress bar counts them."""
    row: dict[str, Any] = {"tokens_per_step_per_request": 1.0, "tpot_ms_median": 5.0,
                           "hub_ms": {"step": 5.0}}  # fmt: skip
    rows = [
        _serve_row("target_only", 8, None, 1000.0) | row,
        _serve_row("lockstep_L3", 8, 3.0, 1300.0) | row | {"tokens_per_step_per_request": 3.0},
        _serve_row("target_only_again", 8, None, 950.0) | row,
    ]
    graphs = {"target": {"1,8": 5.0, "5,8": 6.0}, "draft": {"1,8": 1.0}}
    result = {"settings": {"num_draft_tokens": 4}, "serve": {"rows": rows}, "inprocess_ms": graphs}
    text = "\n".join(e2e_report._side_by_side(result))
    assert "| shared | target_only_again | 8 | 950 | 0.95 | 0.59 |" in text, text
    assert "drifted within the run: batch 8 -5.0%." in text
    assert e2e_report.bound_tokens_per_s(result, rows[2]) == e2e_report.bound_tokens_per_s(
        result, rows[0]
    )
    plain = "\n".join(e2e_report._side_by_side(result | {"serve": {"rows": rows[:2]}}))
    assert "drifted" not in plain
    s: dict[str, Any] = {"batches": [1, 8], "serve_lengths": [3.0], "serve_steps": 8,
                         "ttft_prompt_lens": [64], "ttft_repeats": 1,
                         "serve_placements": ["shared"]}  # fmt: skip
    more = progress_units(s | {"serve_target_only_again": True}) - progress_units(s)
    assert more == len(s["batches"]) * s["serve_steps"]


def test_tokens_per_second_against_l_is_plotted_from_two_lengths(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [_serve_row("target_only", b, None, 100.0 * b) for b in (1, 8)]
    rows += [
        _serve_row(f"{c}_L{x:g}", b, x, 50.0 * b * x)
        for c in ("lockstep", "standin_ahead_h0.8")
        for b in (1, 8)
        for x in (1.5, 3.0)
    ]
    result = {"serve": {"rows": rows}, "environment": {"gpu": "test"}}
    assert e2e_report.plot_lengths(result, tmp_path / "by_length.png")
    assert (tmp_path / "by_length.png").stat().st_size > 10_000
    one = {"serve": {"rows": [r for r in rows if r["synthetic_length"] != 1.5]},
           "environment": {"gpu": "test"}}  # fmt: skip
    assert not e2e_report.plot_lengths(one, tmp_path / "none.png")


def test_results_of_several_gpus_are_named_so_and_runs_merge_for_the_length_plot(
    tmp_path: Path,
) -> None:
    from bench import e2e_bench

    one = {"environment": {"gpu": "NVIDIA H200", "gpu_count": 1}}
    assert e2e_report.name(one) == "e2e_NVIDIA_H200"
    assert e2e_report.name({"environment": {"gpu": "NVIDIA H200", "gpu_count": 2}}) == (
        "e2e_NVIDIA_H200_x2"
    )
    env = {"gpu": "test", "gpu_count": 2}
    runs = [
        {"environment": env, "serve": {"rows": [_serve_row("target_only", 1, None, 100.0 + x),
                                                _serve_row(f"lockstep_L{x:g}", 1, x, 50.0 * x)]}}
        for x in (3.0, 1.5)
    ]  # fmt: skip
    merged = e2e_report.merged_by_length(runs)
    assert [r["config"] for r in merged["serve"]["rows"]] == [
        "target_only", "lockstep_L3", "lockstep_L1.5"
    ]  # fmt: skip
    paths = [tmp_path / "run_l3.json", tmp_path / "run_l15.json"]
    for path, run in zip(paths, runs, strict=True):
        path.write_text(json.dumps(run))
    pytest.importorskip("matplotlib")
    assert e2e_bench.main(["--by-length", *map(str, paths)]) == 0
    assert (tmp_path / "run_l3_by_length.png").stat().st_size > 10_000
    assert e2e_bench.main(["--by-length", str(paths[0])]) == 1  # one length: nothing to draw


def test_the_report_gives_each_draft_ahead_window_its_hit_rate_and_backups() -> None:
    def row(config: str, ahead: dict[str, float] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"placement": "split", "config": config, "batch": 8}
        if ahead is not None:
            out["draft_ahead"] = ahead
        return out

    idle = {"hits": 0.0, "misses": 0.0, "backups": 0.0}
    result = {"serve": {"rows": [row("target_only", idle), row("lockstep_L3", None),
                                 row("ahead_h0.8_L3", {"hits": 30.0, "misses": 10.0,
                                                       "backups": 6.0})]}}  # fmt: skip
    text = "\n".join(e2e_report._ahead_lines(result))
    assert "split ahead_h0.8_L3 batch 8: hit rate 0.75 of 40 asks, 6 backups" in text
    assert "target_only" not in text and "lockstep" not in text
    assert e2e_report._ahead_lines({"serve": {"rows": [row("target_only", idle)]}}) == []


def test_committed_results_render_again() -> None:
    """`e2e_bench --report` on results of earlier runs, whose TTFT rows predate the cached
    prefix and whose settings predate several TTFT lengths."""
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    rendered = 0
    for name in ("e2e_NVIDIA_H200.json", "e2e_runs/paged16_150a954_NVIDIA_H100_x2.json",
                 "e2e_runs/tp32_ba3354d_NVIDIA_H100_x3.json"):  # fmt: skip
        text = e2e_report.markdown(json.loads((results / name).read_text()))
        assert "Time to first token" in text and "| none |" in text
        rendered += 1
    assert rendered == 3
