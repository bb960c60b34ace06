"""bench/e2e_bench.py --smoke runs the whole flow on the CPU (checkpoints, service
processes, gRPC, timing split, greedy check, then `specdec serve` on a real local Ray cluster
driven by specdec.client, report), and --report regenerates the report from its JSON.
The smoke run takes over a minute here, so those tests are marked slow."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import e2e_report
from bench.e2e_bench import parse

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("target_only", "lockstep_L1.5", "lockstep_L3")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "bench" / "e2e_bench.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("e2e")
    done = _bench("--smoke", "--out", str(out), "--cache", str(out / "models"))  # serve: default
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "e2e_cpu.json").read_text())


@pytest.mark.slow  # the smoke run takes 80 to 110 s on 2 busy cores
def test_smoke_has_every_row_with_positive_times(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, result = smoke
    rows = {(r["config"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(c, b) for c in CONFIGS for b in (1, 4)}
    for (config, _), r in rows.items():
        assert r["steps"] == 6 and r["step_ms_median"] > 0 and r["step_ms_p90"] > 0
        assert r["tokens_per_s"] > 0 and r["time_per_output_token_ms"] > 0
        split = r["split_ms_mean"]
        # the services report their own time: forwards are seen, and the parts add up
        assert split["verify_forward"] > 0 and split["transport"] > 0
        assert (split["draft_forward"] > 0) == (config != "target_only")
        assert sum(split.values()) == pytest.approx(r["step_ms_mean"], rel=0.02)
        per_step = r["tokens_per_step_per_request"]
        if config == "target_only":
            assert per_step == 1.0
        else:  # the synthetic length decides how many tokens a step commits, on average
            assert per_step == pytest.approx(r["synthetic_length"], abs=0.75)
    for key in ("1,1", "5,1", "1,4", "5,4"):
        assert result["inprocess_ms"]["target"][key] > 0
    assert result["empty_round_trip"]["median_ms"] > 0
    greedy = result["greedy_check"]
    assert greedy["passed"] and len(greedy["speculative"]) == 4
    assert greedy["target_only"] == greedy["speculative"]
    assert result["greedy_diagnosis"] is None  # --smoke: identical tokens, nothing to diagnose
    for steps in greedy["speculative_steps"]:  # recorded for a replay: k + 1 at most per step
        assert sum(steps) >= 8 and all(1 <= n <= 5 for n in steps)
    assert {g["batch"] for g in result["goals"]} == {1, 4}
    assert (out / "e2e_cpu.md").is_file() and (out / "e2e_cpu.png").is_file()


@pytest.mark.slow  # the smoke run takes 80 to 110 s on 2 busy cores
def test_smoke_through_serve_has_every_row(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, result = smoke
    serve = result["serve"]
    rows = {(r["config"], r["batch"]): r for r in serve["rows"]}
    configs = ("target_only", "lockstep_L3", "ahead_h1_L3")
    assert set(rows) == {(c, b) for c in configs for b in (1, 4)}
    for (config, _), r in rows.items():
        for key in ("tpot_ms_median", "client_step_ms_median", "steps_per_s", "tokens_per_s",
                    "window_s"):  # fmt: skip
            assert r[key] > 0, (config, key, r[key])
        hub = r["hub_ms"]
        assert hub["step"] > 0 and hub["verify"] > 0 and hub["sampler"] > 0
        if config == "ahead_h1_L3":  # every ask in the window found its chain: no forward
            assert hub["draft"] < rows[("lockstep_L3", r["batch"])]["hub_ms"]["draft"]
        else:
            assert (hub["draft"] > 0) == (config != "target_only")
        assert r["overhead_ms_per_step"] == pytest.approx(r["client_step_ms_median"] - hub["step"])
        if config == "target_only":  # no step served a draft request: no k to read
            assert "k_mean" not in hub
        else:  # k = 4, less only at a request's last tokens
            assert 2 < hub["k_mean"] <= 4 and 0 <= hub["k0_share"] < 0.5, hub
        assert r["placement"] == "shared" and r["tpot_ms_p99"] >= r["tpot_ms_median"] / 2 > 0
        # both services' device work on the one CPU, traced through specdec serve's actors
        [(lane, busy)] = r["gpus"]["busy"].items()
        assert lane.startswith("CPU (") and 0 < busy <= 1
        if r["batch"] == 1:
            names = {s[0] for s in r["gpus"]["timeline"][lane]}
            drafted = {"target_only": set(), "lockstep_L3": {"draft"}, "ahead_h1_L3": {"ahead"}}
            assert "verify" in names and names & {"draft", "ahead"} >= drafted[config]
            assert config != "target_only" or not names & {"draft", "ahead"}
            # the services' host threads on the critical path: lanes of their own
            lanes = {"host of target (CPU)", "host of draft (CPU)"}
            assert config == "target_only" or lanes <= set(r["gpus"]["timeline"])
        host = r["gpus"]["host"]  # shares of the window
        if config != "target_only":  # the hub waited for drafts the draft answered
            assert 0 < host["wait for drafts"] <= 1 and 0 < host["answer"] <= 1
        if config == "ahead_h1_L3":
            assert 0 < host["pass ahead"] <= 1
        assert r["hub_steps"] >= 2 and r["client_responses_median"] >= 2
        assert r["fallback_steps"] == 0  # else the bench exits 1 (fixture: returncode 0)
        per_step = r["tokens_per_step_per_request"]
        if config == "target_only":
            assert per_step == 1.0
        else:  # the synthetic length reached the target through specdec serve
            assert per_step == pytest.approx(3.0, abs=0.75)
    ttft = {t["config"]: t for t in serve["ttft"]}
    assert set(ttft) == {"target_only", "lockstep_L3"}
    for t in ttft.values():
        assert t["prompt_len"] == 64 and t["client_ms_median"] > 0 and t["server_ms_median"] > 0
    assert result["inprocess_ms"]["target"]["prefill,64"] > 0
    # serve stopped on SIGTERM by itself (its Ray cluster with it), not killed
    assert len(serve["stops"]) == 2 and all("SIGTERM: exit code 0" in s for s in serve["stops"])
    goals = [g for g in result["goals"] if g["goal"].startswith("serve ")]
    assert len(goals) == 2 * 2 * 2 + 2 + 2  # draft-ahead rows have no Pipeline row to compare
    assert "Draft fallbacks: none" in (smoke[0] / "e2e_cpu.md").read_text()


@pytest.mark.slow  # the smoke run takes 80 to 110 s on 2 busy cores
def test_report_regenerates_markdown(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, result = smoke
    (out / "e2e_cpu.md").unlink()
    done = _bench("--report", str(out / "e2e_cpu.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "e2e_cpu.md").read_text()
    assert text == e2e_report.markdown(result) and text in done.stdout
    assert text.startswith("## System benchmark (`bench/e2e_bench.py`), cpu, ")
    assert "identical tokens (passed)" in text and "| lockstep_L3 | 4 |" in text
    assert "### Through specdec serve and the client" in text
    assert "| target_only | 64 |" in text  # the TTFT table
    assert "| shared | ahead_h1_L3 | 4 |" in text  # side by side
    assert (out / "e2e_cpu_timeline.png").is_file()


def test_goals_compare_against_the_bounds() -> None:
    args = parse(["--smoke"])
    result = {
        "settings": {"num_draft_tokens": 4},
        "empty_round_trip": {"median_ms": 0.5},
        "inprocess_ms": {"target": {"1,1": 4.0, "5,1": 5.0}, "draft": {"1,1": 1.0}},
        "rows": [
            {"config": "target_only", "batch": 1, "step_ms_median": 4.5, "tokens_per_s": 200.0},
            {"config": "lockstep_L3", "batch": 1, "step_ms_median": 11.0, "tokens_per_s": 270.0},
        ],
    }
    goals = {g["goal"].split()[0]: g for g in e2e_report.goals(result)}
    assert goals["target_only"]["limit"] == pytest.approx(4.4) and not goals["target_only"]["met"]
    # 1.15 * (4 * 1.0 + 5.0) + 2 * 0.5
    assert goals["lockstep_L3"]["limit"] == pytest.approx(11.35) and goals["lockstep_L3"]["met"]
    assert goals["tokens/s"]["value"] == pytest.approx(1.35) and not goals["tokens/s"]["met"]
    assert args.batches == [1, 4] and args.steps == 6


def test_a_run_stopped_after_its_serve_rows_leaves_their_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped during the greedy check's diagnosis (which comes after every serve row)
    leaves e2e_partial.md beside e2e_partial.json, rendered from what was measured: here the
    partial results of a GPU run that its call's time limit stopped; a run stopped before any
    row leaves the JSON alone."""
    from bench.e2e_bench import partial_report

    measured = Path(__file__).resolve().parents[2] / "bench/results/e2e_runs"
    result = json.loads((measured / "dynamic_L1.5_ced9e9f_NVIDIA_H200_x2.json").read_text())
    assert result["greedy_diagnosis"] is None  # stopped while diagnosing
    path = partial_report(result, tmp_path)
    assert path == tmp_path / "e2e_partial.md"
    text = path.read_text()
    assert text.startswith("_Partial: the run stopped before its end")
    assert "| split | dynamic_L1.5 | 8 | 1033 | 0.72 |" in text
    empty = {"command": "x", "date": "d", "settings": result["settings"], "rows": [],
             "greedy_check": None, "greedy_diagnosis": None, "serve": None}  # fmt: skip
    assert partial_report(empty, tmp_path / "none") is None
    assert "no partial report" in capsys.readouterr().err


def test_serve_rows_are_the_default() -> None:
    assert parse(["--smoke"]).serve and parse(["--smoke", "--serve"]).serve
    assert not parse(["--smoke", "--no-serve"]).serve


def test_the_plot_shows_speed_up_over_target_only_per_batch_and_path(tmp_path: Path) -> None:
    def rows(tps: dict[int, tuple[float, float]]) -> list[dict[str, Any]]:
        return [{"config": config, "batch": b, "tokens_per_s": pair[i], "step_ms_median": 1.0}
                for b, pair in tps.items()
                for i, config in enumerate(("target_only", "lockstep_L3"))]  # fmt: skip

    result = {
        "settings": {"num_draft_tokens": 4, "batches": [1, 8]},
        "environment": {"gpu": "test"},
        "inprocess_ms": {
            "target": {"1,1": 4.0, "5,1": 5.0, "1,8": 4.0, "5,8": 5.0},
            "draft": {"1,1": 1.0, "1,8": 1.0},
        },
        "rows": rows({1: (200.0, 300.0), 8: (1000.0, 1100.0)}),
        "serve": {"rows": rows({1: (250.0, 500.0)})},
    }
    gains = e2e_report.speedups(result)
    assert gains == {
        "Pipeline lockstep_L3": {1: pytest.approx(1.5), 8: pytest.approx(1.1)},
        "served lockstep_L3": {1: pytest.approx(2.0)},
    }
    assert e2e_report.plot(result, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").read_bytes().startswith(b"\x89PNG")


def test_the_default_checkpoint_cache_is_this_users() -> None:
    """A cache another user wrote is not this one's to read: a fresh clone's tests, run as a
    second user on a machine where root had run them, could not open root's weights."""
    from bench import e2e_models, soak

    assert parse([]).cache == e2e_models.DEFAULT_CACHE
    assert soak.parse([]).cache == e2e_models.DEFAULT_CACHE
    assert e2e_models.DEFAULT_CACHE.name == f"specdec_e2e_models-{os.getuid()}"


def test_the_pipeline_services_take_the_paged_cache_flag() -> None:
    from bench.e2e_bench import service_args
    from specdec.serving.cli import runner_config
    from target_service.__main__ import build_parser

    s = {"dtype": "float32", "max_slots": 4, "max_seq_len": 128, "kv_block_size": 16}
    args = build_parser().parse_args(service_args(s, "/ckpt", "cpu"))
    config = runner_config(args)
    assert (config.kv_block_size, config.prefix_caching) == (16, True)
    plain = build_parser().parse_args(service_args(s | {"kv_block_size": 0}, "/ckpt", "cpu"))
    assert runner_config(plain).kv_block_size == 0
