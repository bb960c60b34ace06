"""bench/chunked_prefill_bench.py on the CPU with the tiny pair, through `specdec serve`: a row
per chunk size, with the running streams' time per token before and during the long prompt's
prefill and its time to first token; bad flags refused."""

import contextlib
import json
from pathlib import Path

import pytest

from bench import chunked_prefill_bench
from bench.e2e_serve import Stream


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
        ratio = row["during"]["p99_ms"] / row["before"]["p50_ms"]
        assert row["p99_during_over_p50_before"] == pytest.approx(ratio)
    # chunked, the streams step while the prompt is prefilled: more of their responses then
    assert r["rows"]["64"]["responses_during"] > r["rows"]["0"]["responses_during"]
    assert "--prefill-chunk-tokens" in (out / "chunked_prefill_cpu.md").read_text()


def test_bad_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        chunked_prefill_bench.main(["--smoke", "--out", str(tmp_path), "--chunks", "-1"])


def test_windows_count_the_stalled_response_and_skip_the_warm_up() -> None:
    """A whole prefill from t = 10 to 13 stalls a stream: its response at 13.01 (a 3 s wait)
    arrived after the long prompt's first token (13) and is still "during"; the baseline
    leaves out the warm-up's slow responses and the one in flight at the arrival."""
    times = [0.0, 5.0, 9.0, 9.5, 9.6, 9.7, 13.01, 13.02]
    rec = Stream(times=times, tokens=[1] * len(times))
    during = chunked_prefill_bench._gaps([rec], 10.0, 13.0)
    assert during == pytest.approx([3310.0])
    before = chunked_prefill_bench._gaps([rec], 0.0, 10.0, skip=4, whole=True)  # warm-up: 3
    assert before == pytest.approx([100.0, 100.0])  # 9.5 -> 9.6 -> 9.7; not 9 -> 9.5 nor 9.7 -> 13


def test_a_cut_run_keeps_the_rows_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk size's row is written as soon as it is measured: a run stopped during the
    second (a time limit's SIGTERM) leaves the first in the JSON and the report."""
    calls = []

    def measure(serve, args, vocab):
        calls.append(serve)
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return {"ttft_ms": 12.5, "responses_during": 3}

    monkeypatch.setattr(chunked_prefill_bench, "serving",
                        lambda *a, **k: contextlib.nullcontext("serve"))  # fmt: skip
    monkeypatch.setattr(chunked_prefill_bench, "measure", measure)
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "c"), "--chunks", "0", "64"]
    with pytest.raises(KeyboardInterrupt):
        chunked_prefill_bench.main(argv)
    r = json.loads((out / "chunked_prefill_cpu.json").read_text())
    assert r["rows"] == {"0": {"ttft_ms": 12.5, "responses_during": 3}}
    assert "| 0 | 12.5 |" in (out / "chunked_prefill_cpu.md").read_text()
