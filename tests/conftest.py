"""Test set-up: Triton kernels run under the interpreter when there is no GPU; the fixtures the
service, pipeline and orchestrator tests share (one tiny checkpoint pair per module, and the
target alone as the greedy reference)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from specdec.forking import grpc_fork_handlers_off

if TYPE_CHECKING:
    from specdec.runner import ModelRunner

# the test process serves gRPC and starts processes: gRPC's fork handlers off (specdec/forking.py)
grpc_fork_handlers_off()

# before anything imports a kernel: @triton.jit reads it when the kernel is defined
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a tiny Llama pair sharing one tokenizer."""
    from tests.draft_service.models import build_checkpoints

    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def reference(checkpoints: tuple[Path, Path]) -> ModelRunner:
    """The target checkpoint in a runner of its own: target-only greedy decoding."""
    from specdec.runner import ModelRunner
    from tests.draft_service.models import runner_config

    return ModelRunner.load(runner_config(checkpoints[0], max_slots=1))
