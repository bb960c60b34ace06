"""bench/paged_bench.py on the CPU with a tiny model: step times of fixed slots and a paged
cache side by side, the capacity of the slots' memory as blocks (every request decoded to its
full length), and a prefix hit's prefill against a miss's."""

import json
from pathlib import Path

from bench import paged_bench


def test_smoke_measures_steps_capacity_and_prefix_hits(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "c")]
    assert paged_bench.main(argv) == 0
    r = json.loads((out / "paged_cpu.json").read_text())
    assert set(r["steps"]) == {"slots", "paged 4"}
    assert all(ms > 0 for times in r["steps"].values() for ms in times.values())
    c = r["capacity"]
    # 2 slots of 64 positions as blocks of 4, for requests of 16 tokens: 8x, less the scratch
    assert c["paged_hold"] > c["slots_hold"] and c["decoded_to"] == [15]
    assert r["prefix"]["caching"]["again_ms"] > 0
    assert "holds" in (out / "paged_cpu.md").read_text()
