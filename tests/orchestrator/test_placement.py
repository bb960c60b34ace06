"""Placement on a real local Ray cluster with two logical GPUs: draft and target on separate
GPUs, sharing one when there are fewer, on CPU without; custom resources in each service's bundle
(--draft-resources / --target-resources, flags and config file); tokenizer refusal; a killed
draft comes back at a new address. Stand-in actors report where Ray put them instead of loading
models (test_serve runs the real services; tests/deploy/test_multinode places them on two
nodes)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util import placement_group_table

import orchestrator.launch.placement as placement_module
from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.config import PlacementConfig, ServiceConfig
from orchestrator.launch.placement import Placement, _bundles, gpus_per_pair
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
    ray.init(num_cpus=8, num_gpus=2, resources={"draft_node": 2, "target_node": 1},
             include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": root}})  # fmt: skip
    yield
    ray.shutdown()


def services(tmp_path: Path, draft: str | None = "draft", device: str = "auto") -> ServiceConfig:
    for name in ("target", draft):
        if name is not None:
            (tmp_path / name).mkdir(exist_ok=True)
    return ServiceConfig(
        str(tmp_path / "target"), str(tmp_path / draft) if draft else None, device=device
    )


def place(
    tmp_path: Path, pairs: int, config: PlacementConfig | None = None, **kw: object
) -> Placement:
    config = config or PlacementConfig(pairs=pairs)
    placement = Placement(config, services(tmp_path, **kw), StandIn)  # type: ignore[arg-type]
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
    assert _bundles(2, [{}, {}]) == ([{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], [0, 1], [1, 1])
    assert _bundles(1, [{}, {}]) == ([{"CPU": 2, "GPU": 1}], [0, 0], [0.5, 0.5])
    assert _bundles(0, [{}, {}]) == ([{"CPU": 1}, {"CPU": 1}], [0, 1], [0, 0])
    assert _bundles(1, [{}]) == ([{"CPU": 1, "GPU": 1}], [0], [1.0])


def test_a_tensor_parallel_target_takes_n_gpus_of_one_bundle_and_the_draft_one() -> None:
    assert gpus_per_pair(6, 2, 2, "auto", target_gpus=2) == 3  # 2 for the target, 1 draft
    assert gpus_per_pair(4, 1, 1, "auto", target_gpus=4) == 4  # no draft
    assert gpus_per_pair(0, 1, 2, "auto", target_gpus=2) == 0  # CPU: processes, no GPUs
    with pytest.raises(
        ValueError,
        match=r"--target-tensor-parallel 2 needs 3 GPUs per pair .*"
        r"2 pair\(s\) need 6, and the Ray cluster has 5",
    ):
        gpus_per_pair(5, 2, 2, "auto", target_gpus=2)  # never shared: the draft gets its own
    bundles, index, gpus = _bundles(3, [{"t": 1}, {}], target_gpus=2)
    assert bundles == [{"CPU": 1, "GPU": 2, "t": 1}, {"CPU": 1, "GPU": 1}]  # one bundle, one node
    assert index == [0, 1] and gpus == [2, 1]
    assert _bundles(0, [{}, {}], target_gpus=2) == ([{"CPU": 1}, {"CPU": 1}], [0, 1], [0, 0])


def test_each_bundle_carries_its_services_custom_resources() -> None:
    target, draft = {"target_gpu": 1}, {"draft_gpu": 0.5, "fast_net": 1}
    bundles, index, _ = _bundles(2, [target, draft])
    assert bundles == [{"CPU": 1, "GPU": 1, "target_gpu": 1},
                       {"CPU": 1, "GPU": 1, "draft_gpu": 0.5, "fast_net": 1}]  # fmt: skip
    assert index == [0, 1]
    cpu = [{"CPU": 1, "target_gpu": 1}, {"CPU": 1, "draft_gpu": 0.5, "fast_net": 1}]
    assert _bundles(0, [target, draft]) == (cpu, [0, 1], [0, 0])
    # one GPU for both: the one bundle asks for both services' resources, summed
    shared = _bundles(1, [{"x": 1, "y": 2}, {"x": 0.5}])
    assert shared == ([{"CPU": 2, "GPU": 1, "x": 1.5, "y": 2}], [0, 0], [0.5, 0.5])
    assert _bundles(1, [{"x": 1}])[0] == [{"CPU": 1, "GPU": 1, "x": 1}]
    assert target == {"target_gpu": 1}, "the config's mappings are not changed"


def test_resources_from_flags_and_config_file(tmp_path: Path) -> None:
    svc = services(tmp_path)
    base = ["serve", "--target", svc.target, "--draft", str(svc.draft)]
    assert serve_config(parse_args(base)).placement == PlacementConfig()
    flags = ["--draft-resources", '{"draft_gpu": 1}', "--target-resources", '{"target_gpu": 2}']
    placement = serve_config(parse_args(base + flags)).placement
    assert placement.draft_resources == {"draft_gpu": 1}
    assert placement.target_resources == {"target_gpu": 2}
    toml = tmp_path / "serve.toml"  # a table, or the flag's JSON text, both under either name
    toml.write_text(
        f'target = "{svc.target}"\ndraft = "{svc.draft}"\n'
        "draft-resources = {draft_gpu = 1, fast_net = 0.5}\n"
        "target_resources = '{\"target_gpu\": 1}'\n"
    )
    placement = serve_config(parse_args(["serve", "--config", str(toml)])).placement
    assert placement.draft_resources == {"draft_gpu": 1, "fast_net": 0.5}
    assert placement.target_resources == {"target_gpu": 1}
    args = ["serve", "--config", str(toml), "--draft-resources", '{"small_gpu": 1}']
    assert serve_config(parse_args(args)).placement.draft_resources == {"small_gpu": 1}
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"target": svc.target, "target_resources": {"big": 1}}))
    placement = serve_config(parse_args(["serve", "--config", str(js)])).placement
    assert placement.target_resources == {"big": 1} and placement.draft_resources == {}


REFUSALS = [  # (--draft-resources value, the message it gets)
    ("{draft_gpu: 1}", r"--draft-resources must be JSON; .* is not \(Expecting property"),
    ('["draft_gpu"]', r"must be a JSON object of Ray custom resource names to positive amounts"),
    ("1", r"e\.g\. '\{\"draft_gpu\": 1\}'; got 1\."),
    ('{"draft_gpu": 0}', r"--draft-resources: 'draft_gpu' must be a positive number, got 0\."),
    ('{"draft_gpu": -1}', r"'draft_gpu' must be a positive number, got -1\."),
    ('{"draft_gpu": true}', r"'draft_gpu' must be a positive number, got True\."),
    ('{"draft_gpu": "1"}', r"'draft_gpu' must be a positive number, got '1'\."),
    ('{"draft_gpu": NaN}', r"'draft_gpu' must be a positive number, got nan\."),
    ('{"GPU": 1}', r"--draft-resources takes custom resources only: GPU per service comes from"),
    ('{"CPU": 1}', r"--draft-resources takes custom resources only: CPU"),
    ('{"": 1}', r"--draft-resources names resources by non-empty strings, got ''\."),
]


@pytest.mark.parametrize(("value", "message"), REFUSALS)
def test_resources_refusals_name_the_flag(tmp_path: Path, value: str, message: str) -> None:
    svc = services(tmp_path)
    for role in ("draft", "target"):
        flag, text = f"--{role}-resources", value.replace("draft", role)
        with pytest.raises(ValueError, match=message.replace("draft", role)):
            serve_config(parse_args(["serve", "--target", svc.target, flag, text]))


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


def test_bundles_ask_for_the_custom_resources(cluster: None, tmp_path: Path) -> None:
    config = PlacementConfig(draft_resources={"draft_node": 1}, target_resources={"target_node": 1})
    placement = place(tmp_path, 1, config)
    try:
        (pair,) = placement.pairs
        table = placement_group_table(pair.group)
        assert table["strategy"] == "PACK" and table["state"] == "CREATED"
        target, draft = table["bundles"][0], table["bundles"][1]
        assert target["target_node"] == 1 and "draft_node" not in target
        assert draft["draft_node"] == 1 and "target_node" not in draft
        assert ray.available_resources().get("target_node", 0) == 0
        assert ray.available_resources()["draft_node"] == 1
    finally:
        placement.stop(0.0)


def test_resources_no_node_offers_time_out_naming_them(
    cluster: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = PlacementConfig(draft_resources={"nowhere_gpu": 1}, start_timeout_s=1.0)
    with pytest.raises(RuntimeError, match=r"could not reserve .*'nowhere_gpu': 1"):
        place(tmp_path, 1, config)
    assert "no node offers ['nowhere_gpu'] yet" in caplog.text


def test_a_local_cluster_late_to_start_is_started_once_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(placement_module.ray, "init", init)
    monkeypatch.setattr(placement_module.ray, "shutdown", lambda: None)
    monkeypatch.setattr(placement_module.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert placement_module.connect(PlacementConfig(num_cpus=2), 2) is True
    assert len(calls) == 2 and calls[0] == calls[1]

    def other(**kwargs: Any) -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(placement_module.ray, "init", other)
    with pytest.raises(RuntimeError, match="something else"):  # only that timeout is retried
        placement_module.connect(PlacementConfig(num_cpus=2), 2)


def test_a_service_that_fails_to_start_is_one_line(
    cluster: None,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ray prints an actor's creation error from the actor's process, traceback and all,
    whatever the log level: the real ServiceActor hands its service's error to `info` instead,
    which comes back as one line, its traceback logged at DEBUG only."""
    config = services(tmp_path, draft=None, device="cpu")  # an empty directory: no config.json
    placement = Placement(PlacementConfig(pairs=1), config)
    with (
        caplog.at_level(logging.DEBUG, "orchestrator.launch.placement"),
        pytest.raises(RuntimeError) as e,
    ):
        placement.start()
    time.sleep(3)  # the actor's printed lines reach this process asynchronously
    printed = capfd.readouterr().err
    assert "Traceback" not in printed and "creation task" not in printed, printed
    assert str(e.value) == (
        f"The target service of pair 0 failed to start: CheckpointError: The model directory "
        f"'{tmp_path / 'target'}' has no config.json."
    )
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("Traceback" in line and "has no config.json" in line for line in debug)
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG and "Traceback" in r.msg]


def test_a_dead_service_is_not_waited_for_once_the_stop_begins(
    cluster: None, tmp_path: Path
) -> None:
    """A service that dies during the stop is not restarted: the wait for it ends at once
    (it would otherwise ask Ray for restart_timeout_s, here 20 s)."""
    placement = place(tmp_path, 1, PlacementConfig(pairs=1, restart_timeout_s=20.0))
    try:
        pair = placement.pairs[0]
        assert pair.draft is not None
        ray.kill(pair.draft, no_restart=True)
        placement.stopping.set()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="is not waited for: serve is stopping"):
            placement.wait_draft(pair)
        assert time.monotonic() - start < 2.0
    finally:
        placement.stop(0.0)


def test_no_wait_calls_ray_once_ray_has_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a SIGTERM to every process of a systemd unit, Ray's GCS and raylet are gone and
    Ray is no longer initialised here: a call then would start a new local cluster (Ray's
    auto-init), after which Ray's core worker aborted the process. The wait and the stop
    make none."""

    def no_call(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Ray call after Ray stopped")

    monkeypatch.setattr(placement_module.ray, "is_initialized", lambda: False)
    for name in ("get", "kill"):
        monkeypatch.setattr(placement_module.ray, name, no_call)
    config = PlacementConfig(pairs=1, restart_timeout_s=30.0)
    placement = Placement(config, services(tmp_path), StandIn)  # type: ignore[arg-type]

    class Gone:
        class info:  # an actor method's handle
            @staticmethod
            def remote() -> None:
                raise AssertionError("a Ray call after Ray stopped")

    with pytest.raises(RuntimeError, match="cannot come back: Ray has stopped"):
        placement._wait(Gone(), "target", 0)
    placement._actors = [Gone()]
    placement.stop(1.0)  # returns without a call
    assert placement.stopping.is_set() and placement._actors == []
