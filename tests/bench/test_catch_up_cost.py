"""bench/experiments/catch_up_cost.py --smoke: the draft engine on the CPU takes asks that bring
several new tokens, and the experiment reports each (batch, tail) cell with the re-admission
beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.experiments import catch_up_cost


def test_smoke_reports_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = catch_up_cost.main(["--smoke", "--out", str(tmp_path), "--cache",
                                 str(tmp_path / "ckpt"), "--batches", "1", "3", "--tails", "1",
                                 "5", "--reps", "2"])  # fmt: skip
    cells = [(r["batch"], r["tail"]) for r in result["rows"]]
    assert cells == [(1, 1), (1, 5), (3, 1), (3, 5)]
    for r in result["rows"]:
        assert r["first_ms"] > 0 and r["median_ms"] > 0 and r["readmit_ms"] > 0
        # the prompt, then per ask its new tokens: the re-admission holds them all
        assert r["tokens"] == catch_up_cost.PROMPT_LEN + 2 * r["tail"]
    assert json.loads((tmp_path / "catch_up_cpu.json").read_text()) == result
    assert "| 3 | 5 |" in capsys.readouterr().out


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        catch_up_cost.main(["--smoke", "--out", str(tmp_path), "--tails", "0"])
