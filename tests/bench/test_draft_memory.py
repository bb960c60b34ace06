"""bench/draft_memory.py on the CPU with the tiny draft: the draft runner configured as
`specdec serve` configures it, with and without draft-ahead, in slots and paged; a paged
hypothesis holds two blocks where a slot cache gave it a whole slot."""

import json
from pathlib import Path

import pytest

from bench import draft_memory


def test_smoke_measures_the_four_configurations(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--out", str(out), "--cache", str(tmp_path / "c")]
    assert draft_memory.main(argv) == 0
    r = json.loads((out / "draft_memory_cpu.json").read_text())
    slots0, slots2, paged0, paged2 = r["rows"]
    assert (slots0["kv"], slots2["kv"], paged0["kv"], paged2["kv"]) == (
        "slots", "slots", "paged 16", "paged 16",
    )  # fmt: skip
    hyp = 2 * 5 * 8  # --draft-ahead 2, k = 4, up to 8 requests
    assert slots2["hypotheses"] == paged2["hypotheses"] == hyp
    assert slots2["runner_slots"] - slots0["runner_slots"] == hyp
    assert paged2["kv_blocks"] - paged0["kv_blocks"] == 2 * hyp  # the block copied, one past it
    per_slot = slots0["kv_bytes"] // (slots0["runner_slots"] + 1)  # the scratch slot too
    assert r["extra"]["slots"] == hyp * per_slot
    per_block = paged0["kv_bytes"] // (paged0["kv_blocks"] + 1)
    assert r["extra"]["paged"] == 2 * hyp * per_block
    assert r["extra"]["ratio"] == pytest.approx(2 * 16 / 512)
    assert "goal <= 0.1: met" in (out / "draft_memory_cpu.md").read_text()


def test_bad_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        draft_memory.main(["--smoke", "--out", str(tmp_path), "--draft-ahead", "0"])
