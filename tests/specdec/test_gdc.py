"""Where programmatic dependent launch is on (specdec/gdc.py)."""

import pytest
import torch

from specdec.gdc import launch_options, pdl_enabled


def test_pdl_is_off_on_cpu_under_the_interpreter_and_when_disabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no grid dependency ops
    assert not pdl_enabled(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SPECDEC_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
