"""bench/hf_assisted_bench.py on the CPU (the tiny CI demo pair, float32): every row is there
with positive figures, specdec's speculation accepted drafts, and, float32 on one CPU, every
configuration's greedy tokens equal transformers' own greedy `generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import hf_assisted_bench

pytestmark = pytest.mark.slow  # a demo pair, transformers' rows and a `specdec serve`


def test_smoke_has_every_row_and_the_same_tokens(tmp_path: Path) -> None:
    assert hf_assisted_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hf_assisted_cpu.json").read_text())
    rows = result["rows"]
    assert list(rows) == [
        "transformers generate",
        "transformers assisted (its defaults)",
        "transformers assisted (k = 4 each step)",
        "specdec, target alone",
        "specdec, k = 4",
    ]
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["ms_per_token"] > 0, name
        assert row["equal_to_greedy"] == row["requests"] == 3, (name, row)
    assert 0 < rows["specdec, k = 4"]["acceptance"] <= 1
    assert rows["specdec, target alone"]["acceptance"] is None
    md = (tmp_path / "hf_assisted_cpu.md").read_text()
    assert "| transformers assisted (k = 4 each step) |" in md
