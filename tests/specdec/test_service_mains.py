"""`python -m draft_service` / `python -m target_service`: a bad config or checkpoint is one line
on stderr naming the service and exit code 2, nothing started (specdec.serving.cli.serve)."""

from pathlib import Path

import pytest

from draft_service.__main__ import main as draft_main
from target_service.__main__ import main as target_main


def test_bad_configs_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert draft_main(["--proposer", "ngram"]) == 2
    assert capsys.readouterr().err == (
        "draft_service: proposer 'ngram' needs tokenizer_path (the shared tokenizer).\n"
    )
    assert target_main(["--model", f"{tmp_path}/missing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("target_service: ") and "missing" in err and err.count("\n") == 1
