"""Every form a service's device takes resolves to one with an index: "cuda" (what a Ray actor
is given, its GPU chosen by CUDA_VISIBLE_DEVICES) is the current CUDA device, "cuda:N" stays N,
"cpu" stays the CPU. `torch.cuda.set_device` refuses an index-less "cuda"; that refusal stopped
`specdec serve` on every GPU. The CUDA calls are replaced here, so no GPU is needed."""

import pytest
import torch

from specdec.runner import RunnerConfig, resolve_device


@pytest.fixture
def current_gpu_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


@pytest.mark.usefixtures("current_gpu_2")
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cuda", torch.device("cuda", 2)),
        ("cuda:0", torch.device("cuda", 0)),
        ("cuda:1", torch.device("cuda", 1)),
        (torch.device("cuda"), torch.device("cuda", 2)),
        ("cpu", torch.device("cpu")),
    ],
)
def test_resolve_device(spec: str | torch.device, expected: torch.device) -> None:
    assert resolve_device(spec) == expected


@pytest.mark.usefixtures("current_gpu_2")
def test_runner_config_device_has_an_index() -> None:
    assert RunnerConfig("ckpt", device="cuda").torch_device == torch.device("cuda", 2)
    assert RunnerConfig("ckpt", device="cuda:3").torch_device == torch.device("cuda", 3)
    assert RunnerConfig("ckpt").torch_device == torch.device("cpu")


def test_set_device_gets_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a service does with its runner's device at start-up (`ModelRunner.own_device`)."""
    from specdec.runner.runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    runner = ModelRunner.__new__(ModelRunner)
    runner._device = RunnerConfig("ckpt", device="cuda").torch_device
    runner.own_device()
    assert calls == [torch.device("cuda", 0)]
    assert calls[0].index is not None
