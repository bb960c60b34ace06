"""bench/chunked_prefill_bench.py on the CPU with the tiny pair, through `specdec serve`: a row
per chunk size, with the running streams' time per token before and during the long prompt's
prefill and its time to first token; bad flags refused."""

import json
from pathlib import Path

import pytest

from bench import chunked_prefill_bench


def test_smoke_reports_each_chunk_size(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "c"), "--chunks", "0", "64",
            "--timeout-s", "300"]  # fmt: skip
    assert chunked_prefill_bench.main(argv) == 0
    r = json.loads((out / "chunked_prefill_cpu.json").read_text())
    assert set(r["rows"]) == {"0", "64"}
    for row in r["rows"].values():
        assert row["ttft_ms"] > 0 and row["during"]["p50_ms"] > 0 and row["before"]["p50_ms"] > 0
        assert row["during"]["p99_ms"] >= row["during"]["p50_ms"]
    # chunked, the streams step while the prompt is prefilled: more of their responses then
    assert r["rows"]["64"]["responses_during"] > r["rows"]["0"]["responses_during"]
    assert "--prefill-chunk-tokens" in (out / "chunked_prefill_cpu.md").read_text()


def test_bad_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        chunked_prefill_bench.main(["--smoke", "--out", str(tmp_path), "--chunks", "-1"])
