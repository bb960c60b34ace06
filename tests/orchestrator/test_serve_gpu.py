"""The product on a GPU, started as a user starts it: `specdec serve` from the command line on a
local Ray cluster (both services as Ray actors on the one GPU Ray gives them), greedy requests
streamed through `specdec.client` and `specdec generate`, `/metrics` read, then a clean stop;
and the services' own mains with their devices named explicitly (`cuda:0`, `cuda`).

These are the tests that would have caught a service refusing the index-less "cuda" a Ray actor
is given. Greedy speculative output is compared with the same server's target-only output
(proposer "off"), both in float32 on one GPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.pipeline import Pipeline
from specdec.client import Client
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ([5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [100, 37, 200, 4, 17])
NEW_TOKENS = 24
START_S = 300.0  # a cold GPU machine: Ray's start, two model loads, graph capture


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def specdec_command() -> list[str]:
    """The console entry point where the package is installed, else what it runs."""
    exe = shutil.which("specdec")
    if exe is not None:
        return [exe]
    return [
        sys.executable,
        "-c",
        "import sys; from orchestrator.cli.main import main; sys.exit(main())",
    ]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return os.environ | {"PYTHONPATH": f"{root}:{path}" if path else root}


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    address: str
    metrics_url: str
    log: Path


def _wait_for_serving(process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if "specdec: serving" in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            pytest.fail(f"specdec serve exited with {process.returncode}:\n{log.read_text()}")
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"specdec serve did not start in {START_S:.0f} s:\n{log.read_text()}")


@contextmanager
def serve(checkpoints: tuple[Path, Path], log: Path, *extra: str) -> Iterator[Served]:
    target, draft = checkpoints
    port, metrics_port = _free_port(), _free_port()
    argv = [
        *specdec_command(), "serve", "--target", str(target), "--draft", str(draft),
        "-k", "3", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--max-seq-len", "256", *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        _wait_for_serving(process, log)
        yield Served(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # what Ctrl-C sends
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                pytest.fail(f"specdec serve did not stop within 90 s of SIGINT:\n{log.read_text()}")


def _greedy(client: Client, proposer: str) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        out = client.complete(
            list(prompt), max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
            proposer=proposer, num_draft_tokens=3,
        )  # fmt: skip
        outputs.append(list(out.token_ids))
    return outputs


def _metric(url: str, name: str, proposer: str | None) -> float:
    text = urlopen(url, timeout=10).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("proposer") == proposer
    )


def _gpu_used_mib_each() -> list[int]:
    """Memory in use on each GPU this process may use (nvidia-smi: a container may not list
    other processes' pids), those CUDA_VISIBLE_DEVICES names where it is set: nvidia-smi lists
    every GPU of the host, and another job on the others (a GPU check beside a benchmark on a
    4-GPU host) moved their memory under these tests."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    which = ["-i", visible] if visible else []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", *which],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [int(line) for line in out.split()]


def _gpu_used_mib() -> int:
    return sum(_gpu_used_mib_each())


def _num_gpus() -> int:
    try:
        return len(_gpu_used_mib_each())
    except (OSError, subprocess.CalledProcessError):
        return 0


TWO_GPUS = pytest.mark.skipif(_num_gpus() < 2, reason="needs two GPUs")


@pytest.mark.parametrize(
    "device_flags",
    [[], ["--device", "cuda"], ["--draft-ahead", "2"],
     pytest.param(["--num-gpus", "1"], marks=TWO_GPUS)],
    ids=["auto", "cuda", "draft-ahead", "one-of-two-gpus"],
)  # fmt: skip
def test_specdec_serve_on_one_gpu(
    checkpoints: tuple[Path, Path], tmp_path: Path, device_flags: list[str]
) -> None:
    before, before_each = _gpu_used_mib(), _gpu_used_mib_each()
    with serve(checkpoints, tmp_path / "serve.log", *device_flags) as served:
        # two CUDA contexts (about 500 MiB each) and the services' KV caches
        assert _gpu_used_mib() - before >= 600, "both services run on the GPUs"
        grown = [a - b for a, b in zip(_gpu_used_mib_each(), before_each, strict=True)]
        if "--num-gpus" in device_flags:  # Ray sees one GPU: both services share it
            assert sum(g >= 300 for g in grown) == 1, f"MiB grown per GPU: {grown}"
        elif len(before_each) >= 2:  # Ray places the draft and the target on different GPUs
            assert sum(g >= 300 for g in grown) >= 2, f"MiB grown per GPU: {grown}"
        with Client(served.address, timeout=120) as client:
            target_only = _greedy(client, "off")
            assert all(len(t) == NEW_TOKENS for t in target_only)
            assert _greedy(client, "draft") == target_only
            assert _greedy(client, "ngram") == target_only
            streamed = [d.token_ids for d in client.generate(
                list(PROMPTS[0]), max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                proposer="draft", num_draft_tokens=3,
            )]  # fmt: skip
            assert [t for chunk in streamed for t in chunk] == target_only[0]
            assert len(streamed) > 1, "the output streams in several responses"
        drafted = _metric(served.metrics_url, "specdec:spec_decode_num_draft_tokens_total", "draft")
        accepted = _metric(
            served.metrics_url, "specdec:spec_decode_num_accepted_tokens_total", "draft"
        )
        assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
        if "--draft-ahead" in device_flags:  # greedy on a draft close to the target: it guesses
            hits = _metric(served.metrics_url, "specdec:draft_ahead_hits_total", None)
            assert hits > 0, "no ask was answered from drafts made ahead"
        generated = subprocess.run(
            [*specdec_command(), "generate", "w5 w6 w7 w8", "--address", served.address,
             "--max-tokens", "8", "--temperature", "0", "--ignore-eos"],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert generated.returncode == 0, generated.stderr
        assert len(generated.stdout.split()) >= 4, generated.stdout
    assert served.process.returncode == 0, served.log.read_text()
    deadline = time.monotonic() + 30  # the actors' processes exit after the driver
    while _gpu_used_mib() - before > 100 and time.monotonic() < deadline:
        time.sleep(1.0)
    assert _gpu_used_mib() - before <= 100, "nothing left holding the GPU after the stop"


@contextmanager
def _main(module: str, log: Path, *args: str) -> Iterator[str]:
    port = _free_port()
    argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
    address = f"127.0.0.1:{port}"
    try:
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=START_S)
        except grpc.FutureTimeoutError:
            pytest.fail(f"{module} did not answer in {START_S:.0f} s:\n{log.read_text()}")
        finally:
            channel.close()
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("draft_device", "target_device"),
    [
        ("cuda:0", "cuda"),
        pytest.param("cuda:0", "cuda:1", marks=TWO_GPUS),
    ],
)  # fmt: skip
def test_service_mains_with_devices_named(
    checkpoints: tuple[Path, Path], tmp_path: Path, draft_device: str, target_device: str
) -> None:
    """Greedy through the services' mains equals target-only; with two GPUs the target (its
    runner, CUDA graphs and compiled sampler) runs on cuda:1 and the draft on cuda:0."""
    target, draft = checkpoints
    common = ["--max-seq-len", "256", "--cuda-graph-batch-sizes", "1", "4"]
    with (
        _main("draft_service", tmp_path / "draft.log", "--model", str(draft),
              "--device", draft_device, *common) as draft_address,
        _main("target_service", tmp_path / "target.log", "--model", str(target),
              "--device", target_device, "--draft-address", draft_address,
              *common) as target_address,
    ):  # fmt: skip
        channels = [grpc.insecure_channel(a) for a in (draft_address, target_address)]
        try:
            outputs = []
            for draft_channel in (None, channels[0]):
                pipe = Pipeline(draft_channel, channels[1])
                ids = [f"{'spec' if draft_channel else 'off'}{i}" for i in range(len(PROMPTS))]
                for rid, prompt in zip(ids, PROMPTS, strict=True):
                    pipe.admit(rid, prompt, SamplingParams(temperature=0.0))
                pipe.generate(dict.fromkeys(ids, 3 if draft_channel else 0), NEW_TOKENS)
                outputs.append([pipe.requests[r].generated[:NEW_TOKENS] for r in ids])
                pipe.release(ids)
            assert outputs[1] == outputs[0]
            assert all(len(o) == NEW_TOKENS for o in outputs[0])
        finally:
            for c in channels:
                c.close()
