"""`specdec demo --quick` end to end: trains the CI pair, serves it through Ray, queries it."""

import io
import re
from pathlib import Path

import pytest

from orchestrator.cli.main import parse_args
from orchestrator.demo import run as demo


def test_quick_demo_prints_the_metrics_and_they_match_the_responses(tmp_path: Path) -> None:
    args = parse_args(["demo", "--quick", "--no-progress", "--cache-dir", str(tmp_path)])
    assert args.func is demo.run_demo
    out = io.StringIO()
    spec, off = demo.run(args, out)
    text = out.getvalue()

    # greedy speculative decoding is exact: the draft changes no token of the output
    assert spec.texts == off.texts and all(spec.texts)
    # /metrics (counted from the hub's steps) agrees with each response's usage
    for run in (spec, off):
        f = run.figures
        assert f.drafts == sum(u.num_drafts for u in run.usages)
        assert f.draft_tokens == sum(u.num_draft_tokens for u in run.usages)
        assert f.accepted == sum(u.num_accepted_tokens for u in run.usages)
        assert f.tokens == sum(u.completion_tokens for u in run.usages) > 0
        assert f.seconds > 0
    assert 0 < spec.figures.drafts <= spec.figures.draft_tokens <= 4 * spec.figures.drafts
    assert off.figures.drafts == 0 and off.figures.mean_acceptance_length is None
    length = spec.figures.mean_acceptance_length
    assert length is not None and 1 <= length <= 5

    # the printed table is those figures
    rate = spec.figures.acceptance_rate
    assert rate is not None
    assert f"draft{rate:>22.3f}{length:>18.3f}{spec.figures.tokens_per_s:>10.1f}" in text
    assert f"off{'-':>24}{'-':>18}{off.figures.tokens_per_s:>10.1f}" in text
    assert "figures read from http://127.0.0.1:" in text and "/metrics" in text
    for prompt in demo.QUICK_PROMPTS:
        assert text.count(prompt) == 2
    assert "target: Llama, 2 layers x 64" in text and "distilled from the target" in text
    # how long training took, and that it ran every step of the recipe
    assert re.search(r"in \d+ s\):\n", text)
    assert re.search(r"150 steps in \d+ s, loss", text) and re.search(r"100 steps in \d+ s\n", text)


def test_bad_arguments_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse_args(["demo", "--quick", "-k", "0", "--cache-dir", str(tmp_path)])
    assert demo.run_demo(args) == 2
    assert "--num-draft-tokens must be in [1, 64], got 0." in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # refused before anything was built
