"""Where programmatic dependent launch is on (specdec/gdc.py)."""

import pytest
import torch

from specdec.gdc import PDL_MAX_TOKENS, launch_options, pdl_enabled


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


@pytest.mark.gpu
def test_pdl_is_on_for_short_steps_only_on_hopper() -> None:
    """Decode and verify steps of a few requests launch with PDL, wide steps without (PDL made
    64 requests x 5 tokens 9% slower on an H200)."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("PDL needs compute capability 9 or later")
    assert pdl_enabled(dev) and pdl_enabled(dev, 1) and pdl_enabled(dev, PDL_MAX_TOKENS)
    assert not pdl_enabled(dev, PDL_MAX_TOKENS + 1)
