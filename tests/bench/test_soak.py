"""bench/soak.py for about 20 s (5 s of them warm-up): 256 concurrent greedy streams against a
real `specdec serve` on the CPU, every request's tokens equal to its prompt's solo run, none
misrouted, no step lost or repeated, and the report written. Memory flatness is reported but
judged only on the long run (`bench/soak.py`'s default is 10 minutes): seconds are mostly
warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_soak_for_20_seconds(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    code = soak.main(["--duration-s", "20", "--warmup-s", "5", "--streams", "256",
                      "--max-growth-pct", "100", "--out", str(out)])  # fmt: skip
    result = json.loads((out / "soak.json").read_text())
    assert code == 0 and result["passed"], result["failures"]
    assert result["requests"] >= 256, "every stream finished at least one request"
    assert result["tokens"] == result["requests"] * result["settings"]["max_tokens"]
    assert (result["mismatched"], result["misrouted"], result["step_errors"]) == (0, 0, 0)
    assert result["errors"] == 0
    assert 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"]
    assert 0 < result["tpot_s"]["p50"] <= result["tpot_s"]["p99"]
    assert result["acceptance_rate"] > 0, "drafts were accepted"
    names = {m["name"] for m in result["memory"]}
    assert any("ServiceActor" in n for n in names) and any("orchestrator serve" in n for n in names)
    assert "| time to first token p50 / p99 |" in (out / "soak.md").read_text()
