"""Fixtures the service tests share: one tiny checkpoint pair per module, and the target alone
as the greedy reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.runner import ModelRunner
from tests.draft_service.models import build_checkpoints, runner_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a tiny Llama pair sharing one tokenizer."""
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def reference(checkpoints: tuple[Path, Path]) -> ModelRunner:
    """The target checkpoint in a runner of its own: target-only greedy decoding."""
    return ModelRunner.load(runner_config(checkpoints[0], max_slots=1))
