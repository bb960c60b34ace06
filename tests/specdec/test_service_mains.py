"""`python -m draft_service` / `python -m target_service`: a bad config or checkpoint is one line
on stderr naming the service and exit code 2, nothing started (specdec.serving.cli.serve); the
command line's defaults are the config dataclasses' own; max_seq_len defaults to the checkpoint's
limit; synthetic acceptance flags parse and validate."""

import json
import logging
from pathlib import Path

import pytest

from draft_service.__main__ import build_parser as draft_parser
from draft_service.__main__ import draft_config
from draft_service.__main__ import main as draft_main
from draft_service.config import DraftConfig
from specdec.runner import ModelRunner, RunnerConfig
from specdec.serving.cli import MAX_DEFAULT_SEQ_LEN, default_of
from specdec.serving.server import ServerConfig
from target_service.__main__ import build_parser as target_parser
from target_service.__main__ import main as target_main
from target_service.__main__ import target_config
from target_service.config import TargetConfig
from target_service.synthetic import SyntheticAcceptance
from tests.specdec._runner_models import BASE, hf_model, save_checkpoint

CHECKPOINT_LIMIT = BASE["max_position_embeddings"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model("llama3"), tmp_path_factory.mktemp("ckpt") / "llama3")


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


def test_defaults_are_the_config_dataclasses(checkpoint: Path) -> None:
    runner = RunnerConfig(str(checkpoint), max_seq_len=CHECKPOINT_LIMIT)
    target = target_config(target_parser().parse_args(["--model", str(checkpoint)]))
    assert target == TargetConfig(runner, ServerConfig(port=50052))
    draft = draft_config(draft_parser().parse_args(["--model", str(checkpoint)]))
    assert draft == DraftConfig(runner=runner, server=ServerConfig(port=50051))


def test_max_seq_len_defaults_to_the_checkpoint_limit(checkpoint: Path) -> None:
    config = target_config(target_parser().parse_args(["--model", str(checkpoint)]))
    assert config.runner.max_seq_len == CHECKPOINT_LIMIT < default_of(RunnerConfig, "max_seq_len")
    runner = ModelRunner.load(config.runner)  # the real loading path accepts it
    assert runner.info.max_seq_len == CHECKPOINT_LIMIT
    explicit = ["--model", str(checkpoint), "--max-seq-len", "64"]
    assert target_config(target_parser().parse_args(explicit)).runner.max_seq_len == 64


def test_max_seq_len_above_the_checkpoint_limit_fails_clearly(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    too_long = str(2 * CHECKPOINT_LIMIT)
    assert draft_main(["--model", str(checkpoint), "--max-seq-len", too_long]) == 2
    assert capsys.readouterr().err == (
        f"draft_service: max_seq_len={too_long} exceeds the model's "
        f"max_position_embeddings={CHECKPOINT_LIMIT}.\n"
    )


def test_max_seq_len_default_is_capped(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    config = target_config(target_parser().parse_args(["--model", str(tmp_path)]))
    assert config.runner.max_seq_len == MAX_DEFAULT_SEQ_LEN


def _synthetic(checkpoint: Path, *flags: str) -> SyntheticAcceptance | None:
    args = target_parser().parse_args(["--model", str(checkpoint), *flags])
    return target_config(args).synthetic


def test_synthetic_flags(checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _synthetic(checkpoint) is None
    with caplog.at_level(logging.WARNING, logger="target_service"):
        length = _synthetic(
            checkpoint, "--synthetic-acceptance-length", "3", "--synthetic-num-draft-tokens", "4"
        )
    assert length == SyntheticAcceptance(4, mean_acceptance_length=3.0)
    assert "BENCHMARKING ONLY" in caplog.text and "(1.0, 1.0, 0.0, 0.0)" in caplog.text
    assert _synthetic(checkpoint, "--synthetic-rates", "1,0.5") == SyntheticAcceptance(
        2, rates=(1.0, 0.5)
    )
    help_text = target_parser().format_help()
    assert "BENCHMARKING ONLY: output is NOT distributed as the target's" in " ".join(
        help_text.split()
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--synthetic-acceptance-length", "2"], "needs --synthetic-num-draft-tokens"),
        (["--synthetic-num-draft-tokens", "4"], "needs --synthetic-acceptance-length or"),
        (["--synthetic-rates", "1,x"], "comma-separated numbers, got '1,x'"),
        (["--synthetic-rates", "0.5,1"], "rates must be non-increasing"),
        (
            ["--synthetic-acceptance-length", "6", "--synthetic-num-draft-tokens", "4"],
            "mean_acceptance_length must be in [1, 5]",
        ),
        (
            ["--synthetic-rates", "1,1,1", "--max-num-draft-tokens", "2"],
            "num_draft_tokens must be in [1, max_num_draft_tokens=2], got 3",
        ),
        (["--max-support-size", "0"], "max_support_size must be >= 1, got 0."),
    ],
)
def test_bad_synthetic_or_support_flags_exit_2(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert target_main(["--model", str(checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("target_service: ") and message in err and err.count("\n") == 1


def test_synthetic_length_and_rates_are_exclusive(checkpoint: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        target_parser().parse_args(
            [
                "--model",
                str(checkpoint),
                "--synthetic-rates",
                "1",
                "--synthetic-acceptance-length",
                "2",
            ]
        )
    assert exc.value.code == 2


def test_saguaro_scale_flag(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ahead = ["--model", str(checkpoint), "--max-slots", "8", "--draft-ahead", "2",
             "--draft-ahead-slots", "4"]  # fmt: skip
    config = draft_config(draft_parser().parse_args([*ahead, "--saguaro-scale", "0.5"]))
    assert (config.draft_ahead, config.saguaro_scale) == (2, 0.5)
    for flags, message in [
        ([*ahead, "--saguaro-scale", "0"], "saguaro_scale must be in (0, 1] (1: off), got 0.0."),
        ([*ahead, "--saguaro-scale", "1.5"], "saguaro_scale must be in (0, 1] (1: off), got 1.5."),
        (["--model", str(checkpoint), "--saguaro-scale", "0.5"],
         "saguaro_scale below 1 needs draft_ahead"),
    ]:  # fmt: skip
        assert draft_main(flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("draft_service: ") and message in err and err.count("\n") == 1
