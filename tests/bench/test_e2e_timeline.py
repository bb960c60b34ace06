"""The serve rows' GPU figures (bench.e2e_timeline): busy fractions are unions of spans
clipped to the window, and processes on one GPU share one lane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import e2e_serve, e2e_timeline


def _write(directory: Path, pid: int, gpu: str, spans: list[list[Any]]) -> None:
    lines = [json.dumps({"pid": pid, "device": "cuda:0", "gpu": gpu, "name": "H100"})]
    lines += [json.dumps(s) for s in spans]
    (directory / f"trace-{pid}-cuda0.jsonl").write_text("\n".join(lines) + "\n")


def test_busy_is_the_union_of_spans_inside_the_window() -> None:
    spans = [["verify", 1.0, 3.0], ["sampler", 2.5, 4.0], ["verify", 6.0, 7.0], ["x", 9, 12]]
    # (1, 4) and (6, 7) overlap the window (2, 10) for 2 + 1 + 1 seconds
    assert e2e_timeline.busy(spans, 2.0, 10.0) == pytest.approx(4 / 8)
    assert e2e_timeline.busy([], 0.0, 1.0) == 0.0


def test_services_sharing_a_gpu_make_one_lane(tmp_path: Path) -> None:
    _write(tmp_path, 1, "GPU-a", [["draft", 0.0, 0.2], ["ahead", 0.5, 0.6]])
    _write(tmp_path, 2, "GPU-b", [["verify", 0.1, 0.4], ["sampler", 0.4, 0.45]])
    split = e2e_timeline.window(tmp_path, 0.0, 1.0, keep_timeline=True)
    assert split["busy"] == {
        "GPU 0 (draft)": pytest.approx(0.3),
        "GPU 1 (target)": pytest.approx(0.35),
    }
    assert [s[0] for s in split["timeline"]["GPU 0 (draft)"]] == ["draft", "ahead"]
    _write(tmp_path, 2, "GPU-a", [["verify", 0.1, 0.4]])
    shared = e2e_timeline.window(tmp_path, 0.0, 1.0, keep_timeline=False)
    assert shared == {
        "busy": {"GPU 0 (draft + target)": pytest.approx(0.5)}, "host": {}, "host_ms": {}
    }  # fmt: skip


def test_host_spans_have_a_lane_of_their_own_and_count_in_no_gpu(tmp_path: Path) -> None:
    _write(tmp_path, 1, "GPU-a", [["ahead", 0.0, 0.5], ["host:pass ahead", 0.0, 0.6],
                                  ["host:answer", 0.6, 0.7]])  # fmt: skip
    _write(tmp_path, 2, "GPU-b", [["verify", 0.1, 0.4], ["host:wait for drafts", 0.4, 0.7]])
    w = e2e_timeline.window(tmp_path, 0.0, 1.0, keep_timeline=True)
    assert w["busy"] == {"GPU 0 (draft)": pytest.approx(0.5), "GPU 1 (target)": pytest.approx(0.3)}
    assert w["host"] == {
        "answer": pytest.approx(0.1), "pass ahead": pytest.approx(0.6),
        "wait for drafts": pytest.approx(0.3),
    }  # fmt: skip
    assert w["host_ms"] == {
        "answer": pytest.approx(100), "pass ahead": pytest.approx(600),
        "wait for drafts": pytest.approx(300),
    }  # fmt: skip
    assert list(w["timeline"]) == [
        "GPU 0 (draft)", "GPU 1 (target)", "host of draft (GPU 0)", "host of target (GPU 1)"
    ]  # fmt: skip
    assert [s[0] for s in w["timeline"]["host of draft (GPU 0)"]] == [
        "host:pass ahead", "host:answer"
    ]  # fmt: skip


def test_a_host_span_in_both_services_lanes_counts_both(tmp_path: Path) -> None:
    """A collection ("host:gc") runs in either service: its share is the union of both lanes'
    spans and its median length is over all of them (one lane's must not replace the
    other's)."""
    _write(tmp_path, 1, "GPU-a", [["host:gc", 0.0, 0.1], ["host:gc", 0.5, 0.52]])
    _write(tmp_path, 2, "GPU-b", [["host:gc", 0.05, 0.2], ["host:gc", 0.8, 0.84]])
    w = e2e_timeline.window(tmp_path, 0.0, 1.0, keep_timeline=False)
    assert w["host"] == {"gc": pytest.approx(0.2 + 0.02 + 0.04)}  # (0, 0.2) is one union
    assert w["host_ms"] == {"gc": pytest.approx((40 + 100) / 2)}  # lengths 100, 20, 150, 40


def test_gpus_are_numbered_among_gpus_and_a_service_without_one_is_the_cpu(
    tmp_path: Path,
) -> None:
    """The draft stand-in's process has no GPU: its lane is "CPU", and the target's GPU is
    still GPU 0 (numbered by UUID among the GPUs, whatever order the files are read in)."""
    _write(tmp_path, 1, "cpu", [["draft", 0.0, 0.2]])
    _write(tmp_path, 2, "GPU-b", [["verify", 0.1, 0.4]])
    assert set(e2e_timeline.window(tmp_path, 0.0, 1.0, False)["busy"]) == {
        "CPU (draft)", "GPU 0 (target)"
    }  # fmt: skip
    _write(tmp_path, 0, "GPU-a", [["ahead", 0.0, 0.1]])
    assert set(e2e_timeline.window(tmp_path, 0.0, 1.0, False)["busy"]) == {
        "CPU (draft)", "GPU 0 (draft)", "GPU 1 (target)"
    }  # fmt: skip


def test_a_line_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    _write(tmp_path, 1, "GPU-a", [["verify", 0.0, 0.1]])
    with (tmp_path / "trace-1-cuda0.jsonl").open("a") as f:
        f.write('["verify", 0.2, ')
    [process] = e2e_timeline.read(tmp_path)
    assert process["spans"] == [["verify", 0.0, 0.1]]


def test_the_split_placement_needs_two_gpus() -> None:
    def result(device: str, gpus: int, asked: list[str] | None = None) -> dict[str, Any]:
        return {
            "settings": {"target_device": device, "serve_placements": asked},
            "environment": {"gpu_count": gpus},
        }

    assert e2e_serve.placements(result("cuda:0", 2)) == ["shared", "split"]
    assert e2e_serve.placements(result("cuda:0", 1)) == ["shared"]
    assert e2e_serve.placements(result("cpu", 0)) == ["shared"]
    assert e2e_serve.placements(result("cuda:0", 2, ["split"])) == ["split"]
    with pytest.raises(ValueError, match="needs two GPUs; this machine has 1"):
        e2e_serve.placements(result("cuda:0", 1, ["split"]))


def test_the_shared_placement_shows_specdec_serve_one_gpu() -> None:
    s = {"target_device": "cuda:0", "paths": {"target": "t", "draft": "d"}, "dtype": "bfloat16"}
    s |= {"max_slots": 8, "max_seq_len": 512, "num_draft_tokens": 4, "graph_sizes": [1, 8]}
    shared = e2e_serve.serve_args(s, 3.0, 1, 2, placement="shared")
    assert shared[shared.index("--num-gpus") + 1] == "1"
    assert "--num-gpus" not in e2e_serve.serve_args(s, 3.0, 1, 2, placement="split")


def test_dynamic_speculation_rows_start_serve_with_it() -> None:
    s = {"target_device": "cpu", "paths": {"target": "t", "draft": "d"}, "dtype": "float32"}
    s |= {"max_slots": 8, "max_seq_len": 512, "num_draft_tokens": 4}
    assert "--dynamic-speculation" in e2e_serve.serve_args(s, 1.5, 1, 2, dynamic=True)
    assert "--dynamic-speculation" not in e2e_serve.serve_args(s, 1.5, 1, 2)
