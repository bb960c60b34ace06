"""bench/tp_scaling.py on the CPU: a tiny target at N = 1 and N = 2 (gloo), each in its own
process, and the report comparing them."""

import json
from pathlib import Path

from bench import tp_scaling


def test_smoke_measures_both_sizes_and_reports_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert tp_scaling.main(["--smoke", "--out", str(out), "--cache", str(tmp_path / "c")]) == 0
    result = json.loads((out / "tp_scaling_8b_cpu.json").read_text())
    assert [r["tp"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["ms"]) == {"1,1", "5,1", "1,4", "5,4"}
        assert all(ms > 0 for ms in row["ms"].values())
    md = (out / "tp_scaling_8b_cpu.md").read_text()
    assert "| 2 | 4 |" in md and "x)" in md  # N = 2's rows carry their ratio to N = 1


def test_the_baseline_is_required() -> None:
    import pytest

    with pytest.raises(SystemExit):
        tp_scaling.parse(["--tp", "2"])
