"""Placement on a real local Ray cluster with two logical GPUs: draft and target on separate
GPUs, sharing one when there are fewer, on CPU without; tokenizer refusal; a killed draft comes
back at a new address. Stand-in actors report where Ray put them instead of loading models
(test_serve runs the real services)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from orchestrator.config import PlacementConfig, ServiceConfig
from orchestrator.placement import Placement, _bundles, gpus_per_pair
from specdec.serving.messages import ModelInfo


class StandIn:
    """ServiceActor's interface without a service: its address names its process."""

    def __init__(self, role: str, config: ServiceConfig):
        self.role = role
        bad = role == "draft" and config.draft is not None and "other" in config.draft
        self.hash = "other-tokenizer" if bad else "shared-tokenizer"

    def info(self) -> tuple[str, ModelInfo]:
        info = ModelInfo(self.role, 300, 250, self.hash, 128, 8, 16, 1 << 20, "float32")
        return f"{ray.util.get_node_ip_address()}:{os.getpid()}", info

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    def stop(self, grace_s: float) -> None:
        pass


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # the workers import this module by name: give them the repository on their path
    root = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})  # fmt: skip
    yield
    ray.shutdown()


def services(tmp_path: Path, draft: str | None = "draft", device: str = "auto") -> ServiceConfig:
    for name in ("target", draft):
        if name is not None:
            (tmp_path / name).mkdir(exist_ok=True)
    return ServiceConfig(
        str(tmp_path / "target"), str(tmp_path / draft) if draft else None, device=device
    )


def place(tmp_path: Path, pairs: int, **kw: object) -> Placement:
    placement = Placement(PlacementConfig(pairs=pairs), services(tmp_path, **kw), StandIn)  # type: ignore[arg-type]
    placement.start()
    return placement


def gpus(actor: object) -> list[str]:
    return ray.get(actor.gpu_ids.remote())  # type: ignore[attr-defined]


def test_gpus_per_pair_rules() -> None:
    assert gpus_per_pair(8, 4, 2, "auto") == 2  # one GPU per service
    assert gpus_per_pair(4, 4, 2, "auto") == 1  # both services of a pair on one GPU
    assert gpus_per_pair(1, 1, 1, "auto") == 1  # n-gram only: the target alone
    assert gpus_per_pair(0, 4, 2, "auto") == 0  # CPU
    assert gpus_per_pair(8, 4, 2, "cpu") == 0
    with pytest.raises(ValueError, match="pairs=3 need at least 3 GPUs"):
        gpus_per_pair(2, 3, 2, "auto")
    with pytest.raises(ValueError, match="device 'cuda' needs a GPU"):
        gpus_per_pair(0, 1, 2, "cuda")
    assert _bundles(2, 2) == ([{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], [0, 1], 1.0)
    assert _bundles(1, 2) == ([{"CPU": 2, "GPU": 1}], [0, 0], 0.5)
    assert _bundles(0, 2) == ([{"CPU": 1}, {"CPU": 1}], [0, 1], 0.0)


def test_one_pair_gets_a_gpu_per_service(cluster: None, tmp_path: Path) -> None:
    placement = place(tmp_path, 1)
    try:
        (pair,) = placement.pairs
        target, draft = gpus(pair.target), gpus(pair.draft)
        assert len(target) == 1 and len(draft) == 1 and target != draft
    finally:
        placement.stop(0.0)


def test_two_pairs_on_two_gpus_share_one_each(cluster: None, tmp_path: Path) -> None:
    placement = place(tmp_path, 2)
    try:
        per_pair = [(gpus(p.target), gpus(p.draft)) for p in placement.pairs]
        for target, draft in per_pair:
            assert len(target) == 1 and target == draft
        assert per_pair[0][0] != per_pair[1][0]
        with pytest.raises(ValueError, match="pairs=3 need at least 3 GPUs"):
            place(tmp_path, 3)
    finally:
        placement.stop(0.0)


def test_cpu_device_takes_no_gpu_and_ngram_needs_no_draft(cluster: None, tmp_path: Path) -> None:
    placement = place(tmp_path, 1, device="cpu")
    ngram = place(tmp_path, 1, draft=None)
    try:
        assert gpus(placement.pairs[0].target) == gpus(placement.pairs[0].draft) == []
        assert ngram.pairs[0].draft is None and len(gpus(ngram.pairs[0].target)) == 1
    finally:
        placement.stop(0.0)
        ngram.stop(0.0)


def test_incompatible_tokenizer_is_refused(cluster: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Refusing the draft .*must share one"):
        place(tmp_path, 1, draft="other-draft")
    deadline = time.monotonic() + 30  # Ray frees a removed group's resources asynchronously
    while ray.available_resources().get("GPU") != 2.0:
        assert time.monotonic() < deadline, "the refused pair's GPUs were given back"
        time.sleep(0.1)


def test_killed_draft_comes_back_at_a_new_address(cluster: None, tmp_path: Path) -> None:
    placement = place(tmp_path, 1)
    try:
        pair = placement.pairs[0]
        before = pair.draft_address
        assert pair.draft is not None
        ray.kill(pair.draft, no_restart=False)
        deadline = time.monotonic() + 60
        # the kill is asynchronous: the old process may still answer once or twice
        while (found := placement.wait_draft(pair))[0] == before:
            assert time.monotonic() < deadline, "the draft came back"
            time.sleep(0.1)
        address, info = found
        assert pair.draft_address == address and info.tokenizer_hash == "shared-tokenizer"
    finally:
        placement.stop(0.0)
