"""bench/ttft_bench.py on the CPU with the tiny pair, through `specdec serve` with paged KV: a row
per (length, proposer, prefix), the cached prompts found in the target's prefix cache and the
fresh ones not, speculation's ratio to the target alone; bad flags refused."""

import json
from pathlib import Path

import pytest

from bench import ttft_bench


def test_smoke_reports_every_length_proposer_and_prefix(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "c"), "--lengths", "96",
            "200", "--repeats", "1", "--kv-block-size", "16",
            "--timeout-s", "300"]  # fmt: skip
    assert ttft_bench.main(argv) == 0
    r = json.loads((out / "ttft_cpu.json").read_text())
    got = {(row["prompt_len"], row["proposer"], row["cached_prefix"]) for row in r["rows"]}
    assert {row["config"] for row in r["rows"]} == {"target_only", "lockstep"}
    assert got == {(n, p, c) for n in (96, 200) for p in ("off", "draft") for c in (False, True)}
    for row in r["rows"]:
        assert row["client_ms_median"] > 0 and row["server_ms_median"] > 0
        assert row["repeats"] == 1
        if row["cached_prefix"]:  # every full block of the resent start was found
            assert row["cached_tokens"] == row["prompt_len"] - 64
            assert row["prefix_hit_tokens_min"] >= (row["prompt_len"] - 64) // 16 * 16 - 16
        else:
            assert row["prefix_hit_tokens_min"] == 0
    assert {(x["prompt_len"], x["cached_prefix"]) for x in r["ratios"]} == {
        (n, c) for n in (96, 200) for c in (False, True)
    }
    assert all(x["ratio"] > 0 and x["goal"] is None for x in r["ratios"])
    assert "| 200 | cached | draft |" in (out / "ttft_cpu.md").read_text()


BAD = [["--lengths", "1"], ["--repeats", "0"], ["--kv-block-size", "-1"]]


@pytest.mark.parametrize("flags", BAD)
def test_bad_flags_are_refused(tmp_path: Path, flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        ttft_bench.main(["--smoke", "--out", str(tmp_path), *flags])
