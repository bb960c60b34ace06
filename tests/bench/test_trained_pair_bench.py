"""bench/trained_pair_bench.py on the CPU with the demo's tiny pair (trained here, cached), through
`specdec serve` with real acceptance: every config at each temperature and batch, draft tokens
accepted, and draft-ahead's asks answered from chains at temperature 0 (with the fan-out spread,
which `specdec serve --draft-ahead-spread` turns on); bad flags refused."""

import json
from pathlib import Path

import pytest

from bench import trained_pair_bench


def test_smoke_has_every_row_with_real_acceptance(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "cache"),
            "--temperatures", "0", "0.7", "--batches", "1", "2", "--timeout-s", "300",
            "--spread", "--repeats", "2", "--dynamic"]  # fmt: skip
    assert trained_pair_bench.main(argv) == 0
    r = json.loads((out / "trained_pair_cpu.json").read_text())
    rows = {(row["config"], row["temperature"], row["batch"]): row for row in r["rows"]}
    assert set(rows) == {(c, t, b) for c in trained_pair_bench.CONFIGS for t in (0.0, 0.7)
                         for b in (1, 2)}  # fmt: skip
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    for row in rows.values():  # two windows of the same streams; the median one's row kept
        runs = row["tokens_per_s_runs"]
        assert len(runs) == 2 and runs == sorted(runs) and row["tokens_per_s"] == runs[1]
    for key, row in rows.items():
        if key[0] == "target_only":
            assert row["acceptance_length"] is None and row["hit_rate"] is None
        elif key[0] == "dynamic":  # its k is the target's choice, 0 included: no L to expect
            assert row["hit_rate"] is None
        else:  # the tiny distilled draft guesses its target's greedy tokens often
            assert row["acceptance_length"] is not None and row["acceptance_length"] > 1.0, key
    assert rows[("ahead", 0.0, 1)]["asks"] > 0 and rows[("ahead", 0.0, 1)]["hit_rate"] > 0
    assert r["training"]["target"]["parameters"] > r["training"]["draft"]["parameters"]
    md = (out / "trained_pair_cpu.md").read_text()
    assert "x target-only" in md and "fan-out spread" in md and r["settings"]["spread"]


def test_bad_flags_are_refused(tmp_path: Path) -> None:
    for bad in (["--batches", "0"], ["--temperatures", "3"], ["--draft-ahead", "0"],
                ["--repeats", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            trained_pair_bench.main(["--smoke", "--out", str(tmp_path), *bad])
