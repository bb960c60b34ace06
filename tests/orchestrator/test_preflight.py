"""`specdec serve` refuses bad checkpoints, flags that do not fit them and ports it cannot bind
with one line naming the flag and the file, exit code 2, before any Ray process starts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.launch.preflight import check_before_ray

ROOT = Path(__file__).resolve().parents[2]


def _serve(flags: list[str], ray_dir: Path) -> subprocess.CompletedProcess[str]:
    """`specdec serve FLAGS` with Ray's temporary directory at `ray_dir`: a Ray start, even one
    that fails, creates its session directory there."""
    ray_dir.mkdir()
    env = os.environ | {"RAY_TMPDIR": str(ray_dir)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--host", "127.0.0.1", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _copy(source: Path, to: Path, *drop: str) -> Path:
    shutil.copytree(source, to)
    for pattern in drop:
        for file in to.glob(pattern):
            file.unlink()
    return to


@pytest.fixture(scope="module")
def bad(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The fixture's pair, and checkpoints each wrong in one way."""
    from tests.specdec._runner_models import tiny_tokenizer

    target, draft = checkpoints
    root = tmp_path_factory.mktemp("bad")
    dirs = {"target": target, "draft": draft, "empty": root / "empty"}
    dirs["empty"].mkdir()
    dirs["no_weights"] = _copy(target, root / "no-weights", "*.safetensors")
    dirs["no_tokenizer"] = _copy(target, root / "no-tokenizer", "tokenizer*")
    dirs["other"] = _copy(draft, root / "other")  # a tokenizer with one more token
    tok = tiny_tokenizer()
    tok.add_tokens(["extra-word"])
    tok.save_pretrained(str(dirs["other"]))
    dirs["long"] = _copy(target, root / "long")  # max_position_embeddings 512, not 256
    config = dirs["long"] / "config.json"
    config.write_text(config.read_text().replace('"max_position_embeddings": 256,',
                                                 '"max_position_embeddings": 512,'))  # fmt: skip
    return dirs


CASES = {  # flags ({name}: a directory of `bad`) -> the start of the one line
    "--target {empty}": "--target '{empty}' has no config.json",
    "--target {target} --draft {empty}": "--draft '{empty}' has no config.json",
    "--target {no_weights}": "--target '{no_weights}' has no *.safetensors files",
    "--target {no_tokenizer}": "--target '{no_tokenizer}' has no tokenizer: none of tokenizer.",
    "--target {target} --draft {draft} --max-seq-len 1000":
        "--max-seq-len 1000 exceeds the target's max_position_embeddings 256",
    "--target {long} --draft {draft} --max-seq-len 300":
        "--max-seq-len 300 exceeds the draft's max_position_embeddings 256",
    "--target {target} --draft {other}": "Refusing the draft '{other}' for the target",
    "--target {target} --draft {draft} --target-tensor-parallel 4":
        "--target-tensor-parallel 4: A tensor-parallel size of 4 does not divide the model's "
        "num_key_value_heads (2)",
    "--target {target} --target-tensor-parallel 3":
        "--target-tensor-parallel 3: A tensor-parallel size of 3 does not divide the model's "
        "num_attention_heads (4)",
}  # fmt: skip


@pytest.mark.parametrize("flags", list(CASES))
def test_a_bad_checkpoint_is_one_line_before_ray(
    flags: str, bad: dict[str, Path], tmp_path: Path
) -> None:
    names = {name: str(path) for name, path in bad.items()}
    ray_dir = tmp_path / "ray"
    out = _serve([*flags.format(**names).split(), "--port", "0", "--metrics-port", "-1"], ray_dir)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("specdec serve: " + CASES[flags].format(**names)), lines[0]
    assert not any(ray_dir.iterdir()), "Ray was started"


def test_a_port_in_use_is_one_line_before_ray(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """No grpc core line ("Failed to add port") before serve's own; the HTTP and metrics
    ports are checked as well, and one port given to two flags is named as such."""
    target = str(checkpoints[0])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        runs = {
            flag: _serve(["--target", target, "--port", "0", flag, str(port)], tmp_path / flag)
            for flag in ("--port", "--http-port", "--metrics-port")
        }
    for flag, out in runs.items():
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"specdec serve: Cannot listen on 127.0.0.1:{port} ({flag} {port}): the port is in "
            f"use by another process (another specdec serve?). Stop what uses it, or pass "
            f"another port to {flag} (0 picks a free one)."
        ]
    both = ["--http-port", "9999", "--metrics-port", "9999"]
    twice = _serve(["--target", target, "--port", "0", *both], tmp_path / "twice")
    assert twice.returncode == 2
    assert twice.stderr.strip() == (
        "specdec serve: --http-port and --metrics-port are both 9999: give each its own port."
    )
    for ray_dir in tmp_path.iterdir():
        assert not any(ray_dir.iterdir()), "Ray was started"


def test_a_good_pair_passes(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    flags = ["serve", "--target", str(target), "--draft", str(draft), "--port", "0",
             "--http-port", "0", "--metrics-port", "0", "--max-seq-len", "256"]  # fmt: skip
    check_before_ray(serve_config(parse_args(flags)))
