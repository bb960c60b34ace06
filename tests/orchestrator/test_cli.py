"""The `specdec` command line: flags and --config files to ServeConfig, clear refusals, and
`specdec serve` + `specdec generate` as real processes (SIGTERM stops the server cleanly)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.main import build_parser, parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.config import (
    PlacementConfig,
    SchedulerConfig,
    ServeConfig,
    ServiceConfig,
    resolve_dtype,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_config_dataclasses(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    config = serve_config(parse_args(["serve", "--target", str(target), "--draft", str(draft)]))
    expected = ServeConfig(ServiceConfig(str(target), str(draft)))
    assert config == expected
    assert config.placement == PlacementConfig() and config.scheduler == SchedulerConfig()


def test_flags_override_the_config_file(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = checkpoints
    toml = tmp_path / "serve.toml"
    toml.write_text(f'target = "{target}"\ndraft = "{draft}"\nk = 2\nmax-queue = 7\npairs = 2\n')
    config = serve_config(parse_args(["serve", "--config", str(toml), "--pairs", "3"]))
    assert config.scheduler.num_draft_tokens == 2 and config.scheduler.max_queue == 7
    assert config.placement.pairs == 3 and config.services.draft == str(draft)
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"target": str(target), "proposer": "off", "metrics_port": -1}))
    config = serve_config(parse_args(["serve", "--config", str(js)]))
    assert config.scheduler.proposer == "off" and config.metrics_port is None


def test_pushed_chains_are_on_unless_turned_off(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft)]
    assert serve_config(parse_args(base)).services.draft_push_chains is True
    assert (
        serve_config(parse_args([*base, "--no-draft-push-chains"])).services.draft_push_chains
        is False
    )
    toml = tmp_path / "serve.toml"
    toml.write_text(f'target = "{target}"\ndraft = "{draft}"\ndraft-push-chains = false\n')
    assert (
        serve_config(parse_args(["serve", "--config", str(toml)])).services.draft_push_chains
        is False
    )


def test_http_port_is_off_unless_given(checkpoints: tuple[Path, Path]) -> None:
    serve = ["serve", "--target", str(checkpoints[0])]
    assert serve_config(parse_args(serve)).http_port is None
    assert serve_config(parse_args([*serve, "--http-port", "0"])).http_port == 0
    with pytest.raises(ValueError, match=r"http_port must be in \[0, 65535\], got 70000"):
        serve_config(parse_args([*serve, "--http-port", "70000"]))


def test_refusals_name_the_problem(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    target, _ = checkpoints
    hint = re.escape("huggingface-cli download meta-llama/Llama-3.1-8B --local-dir DIR")
    with pytest.raises(ValueError, match=hint):
        serve_config(parse_args(["serve", "--target", "meta-llama/Llama-3.1-8B"]))
    no_draft = serve_config(parse_args(["serve", "--target", str(target)]))
    assert no_draft.scheduler.proposer == "ngram"
    with pytest.raises(ValueError, match="proposer 'draft' needs a draft model"):
        serve_config(parse_args(["serve", "--target", str(target), "--proposer", "draft"]))
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, max_num_draft_tok"):
        serve_config(parse_args(["serve", "--target", str(target), "-k", "17"]))
    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(bad)])


def test_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "
        "import orchestrator.cli.main, orchestrator.server"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--help"], check=True, cwd=ROOT, capture_output=True
    )
    assert b"serve" in out.stdout and b"generate" in out.stdout and b"demo" in out.stdout


@pytest.fixture
def server(checkpoints: tuple[Path, Path]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    target, draft = checkpoints
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "orchestrator", "serve", "--target", str(target), "--draft",
           str(draft), "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len", "128",
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grace-s", "2",
           "--num-cpus", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once SERVING
    try:
        assert "serving target on 127.0.0.1:" in line, line
        yield proc, line.strip().rsplit(" ", 1)[-1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_then_generate_then_sigterm(server: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = server
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "generate", "5 6 7 8", "--prompt-ids", "--address",
         address, "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 6, result
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_draft_deadline_flag(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft)]
    assert serve_config(parse_args(base)).services.draft_deadline_s == 0.3
    chosen = serve_config(parse_args([*base, "--draft-deadline-ms", "150"])).services
    assert chosen.draft_deadline_s == pytest.approx(0.15)
    with pytest.raises(ValueError, match=r"draft_deadline_s must be in \(0, 3600\] seconds"):
        serve_config(parse_args([*base, "--draft-deadline-ms", "0"]))


def test_draft_ahead_sizes_the_draft_slots(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft), "--max-requests", "16"]
    services = serve_config(parse_args([*base, "-k", "3", "--draft-ahead", "2"])).services
    assert (services.draft_ahead, services.draft_ahead_slots) == (2, 2 * (3 + 1) * 8)
    off = serve_config(parse_args(base)).services
    assert (off.draft_ahead, off.draft_ahead_slots) == (0, 0)
    with pytest.raises(ValueError, match="draft_ahead needs a draft model"):
        serve_config(parse_args(["serve", "--target", str(target), "--draft-ahead", "1"]))


def test_saguaro_scale_flag_and_config_key(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft), "--draft-ahead", "2"]
    assert serve_config(parse_args(base)).services.saguaro_scale == 1.0
    chosen = serve_config(parse_args([*base, "--saguaro-scale", "0.25"])).services
    assert chosen.saguaro_scale == 0.25
    toml = tmp_path / "serve.toml"
    toml.write_text(
        f'target = "{target}"\ndraft = "{draft}"\ndraft-ahead = 1\nsaguaro-scale = 0.5\n'
    )
    assert serve_config(parse_args(["serve", "--config", str(toml)])).services.saguaro_scale == 0.5
    with pytest.raises(ValueError, match=r"saguaro_scale must be in \(0, 1\] \(1: off\), got 0.0"):
        serve_config(parse_args([*base, "--saguaro-scale", "0"]))
    with pytest.raises(ValueError, match="saguaro_scale below 1 needs draft_ahead"):
        serve_config(parse_args([*base[:-2], "--saguaro-scale", "0.5"]))


def test_draft_ahead_spread_flag_and_config_key(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft), "--draft-ahead", "2"]
    assert not serve_config(parse_args(base)).services.draft_ahead_spread
    assert serve_config(parse_args([*base, "--draft-ahead-spread"])).services.draft_ahead_spread
    toml = tmp_path / "serve.toml"
    toml.write_text(
        f'target = "{target}"\ndraft = "{draft}"\ndraft-ahead = 1\ndraft-ahead-spread = true\n'
    )
    assert serve_config(parse_args(["serve", "--config", str(toml)])).services.draft_ahead_spread
    with pytest.raises(ValueError, match=r"draft_ahead_spread spreads .* got draft_ahead 0"):
        serve_config(parse_args([*base[:-2], "--draft-ahead-spread"]))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return build_parser()[1]


def test_every_flag_has_help_and_shows_its_default() -> None:
    for name, parser in _subparsers().items():
        for action in parser._actions:
            assert action.help, f"specdec {name} {action.option_strings or action.dest}: no help"
    serve = _subparsers()["serve"].format_help()
    assert "default draft tokens per step (default: 4)" in serve
    assert "(default: 50050)" in serve and "(default: auto)" in serve
    assert "(default: None)" not in serve, "flags without a default say so in their own words"


def test_the_flags_a_service_takes_too_are_declared_once() -> None:
    """Every flag `specdec serve` shares with a service's main (python -m draft_service or
    target_service) comes from specdec.serving.flags: one help each (serve's --device and
    --dtype explain their "auto" too)."""
    from draft_service.__main__ import build_parser as draft_parser
    from target_service.__main__ import build_parser as target_parser

    serve = _subparsers()["serve"]
    common = ["--cuda-graph-batch-sizes", "--device", "--drain-s", "--dtype", "--grace-s",
              "--host", "--kv-block-size", "--kv-blocks", "--max-num-draft-tokens",
              "--max-seq-len", "--no-prefix-caching", "--port", "--prefill-chunk-tokens",
              "--prefix-caching", "--tls-cert", "--tls-client-ca", "--tls-key"]  # fmt: skip
    own = {
        "draft": ["--draft-ahead", "--draft-ahead-backup", "--draft-ahead-spread",
                  "--no-draft-ahead-spread", "--q-form", "--saguaro-scale", "--support-size",
                  "--synthetic-hit-rate", "--synthetic-hit-rate-spread"],
        "target": ["--draft-deadline-ms", "--draft-push-chains", "--dynamic-speculation",
                   "--no-draft-push-chains", "--no-dynamic-speculation", "--sampler-impl",
                   "--synthetic-acceptance-length", "--synthetic-acceptance-spread"],
    }  # fmt: skip
    # spelled alike, meant otherwise: the draft main's --max-requests caps its n-gram requests
    # (serve's: the KV slots of a pair), its --proposer picks model or n-gram (serve's: a
    # request's default)
    unlike = {"--max-requests", "--proposer", "-h", "--help"}
    for role, service in (("draft", draft_parser()), ("target", target_parser())):
        helps = [{o: a.help for a in p._actions for o in a.option_strings}
                 for p in (serve, service)]  # fmt: skip
        shared = sorted(helps[0].keys() & helps[1].keys() - unlike)
        assert shared == sorted(common + own[role]), role
        for flag in shared:
            assert str(helps[0][flag]).startswith(str(helps[1][flag])), (role, flag)


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
def test_num_draft_tokens_is_spelled_alike_everywhere(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"serve": ["serve", "--target", "t"], "generate": ["generate", "hi"],
            "demo": ["demo"]}[command]  # fmt: skip
    assert parse_args([*base, "-k", "2"]).num_draft_tokens == 2
    assert parse_args([*base, "--num-draft-tokens", "3"]).num_draft_tokens == 3
    with pytest.raises(SystemExit):
        parse_args([*base, "--k", "2"])  # the old serve/generate spelling is gone
    err = capsys.readouterr().err  # no flag --k (an abbreviation of two --kv-* is ambiguous)
    assert "unrecognized arguments: --k" in err or "ambiguous option: --k could match" in err


def test_version_is_the_package_metadata() -> None:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "--version"], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == f"specdec {importlib.metadata.version('specdec')}"


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoint_s_on_gpu(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    from orchestrator.launch.services import _runner

    target = checkpoints[0]
    config = serve_config(parse_args(["serve", "--target", str(target)]))
    assert config.services.dtype == "auto"
    assert _runner(config.services, str(target), "cpu").dtype == "float32"
    for saved, expected in (("bfloat16", "bfloat16"), ("float16", "float16"), ("int8", "float32")):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": saved}))
        assert resolve_dtype("auto", str(tmp_path), "cuda") == expected
        assert resolve_dtype("auto", str(tmp_path), "cpu") == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))  # newer name
    assert resolve_dtype("auto", str(tmp_path), "cuda") == "bfloat16"
    assert resolve_dtype("float16", str(tmp_path), "cpu") == "float16", "explicit wins"


def test_serve_refuses_a_grpc_port_in_use(checkpoints: tuple[Path, Path]) -> None:
    """A gRPC server on the port first (SO_REUSEPORT on, grpc's default): `specdec serve` on
    the same port exits at once naming it, before starting Ray."""
    from concurrent import futures

    import grpc

    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator", "serve", "--target", str(checkpoints[0]),
             "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        first.stop(0)
    assert out.returncode == 2
    assert f"127.0.0.1:{port} (--port {port}): the port is in use" in out.stderr
    assert "Stop what uses it, or pass another port to --port" in out.stderr
    assert "ray" not in out.stderr.lower(), out.stderr


def test_a_draft_with_another_tokenizer_is_refused_before_any_model_loads(
    checkpoints: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizers are compared from their files first: neither Ray nor a service (which
    loads the models) is started for a mismatched pair, in process or from the command line."""
    import shutil

    import orchestrator.server
    from orchestrator.server import Orchestrator
    from tests.specdec._runner_models import tiny_tokenizer

    target, draft = checkpoints
    other = tmp_path / "other-draft"
    shutil.copytree(draft, other)
    tok = tiny_tokenizer()
    tok.add_tokens(["extra-word"])
    tok.save_pretrained(str(other))

    def must_not_run(*_args: object, **_kw: object) -> None:
        raise AssertionError("Ray was started (and the models loaded) for a mismatched pair")

    monkeypatch.setattr(orchestrator.server, "connect", must_not_run)
    monkeypatch.setattr(orchestrator.server.Placement, "start", must_not_run)
    config = serve_config(parse_args(["serve", "--target", str(target), "--draft", str(other)]))
    with pytest.raises(
        ValueError,
        match=r"Refusing the draft .* their tokenizers differ \(251 and"
        r" 250 ids; e\.g\. 'extra-word': 250\); draft and target must share one",
    ):
        Orchestrator(config).start()
    from orchestrator.core.detokenizer import check_shared_tokenizer

    check_shared_tokenizer(target, draft)  # padded embedding sizes differ; the vocabulary not
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--target", str(target), "--draft",
         str(other), "--port", "0", "--metrics-port", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Refusing the draft" in out.stderr and "Traceback" not in out.stderr
    assert "Started a local Ray instance" not in out.stderr
