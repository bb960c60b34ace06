"""`specdec generate` against the fake GenerateService of the client tests (real gRPC)."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator

import pytest

from orchestrator.cli.generate import add_generate_args, run_generate
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.server import ServerConfig
from tests.specdec.test_client import WORDS, FakeGenerate, _serve


@pytest.fixture
def served() -> Iterator[tuple[FakeGenerate, str]]:
    fake = FakeGenerate()
    server = _serve(fake, ServerConfig())
    yield fake, f"127.0.0.1:{server.port}"
    server.stop(0)


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    out, err = io.StringIO(), io.StringIO()
    code = run_generate(parser.parse_args(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_streams_text_then_prints_acceptance(served) -> None:
    fake, address = served
    code, out, err = _run(
        "hello",
        "--address",
        address,
        "--proposer",
        "ngram",
        "-k",
        "2",
        "--stop",
        "\n",
        "--stop",
        "END",
        "--temperature",
        "0",
        "--seed",
        "3",
        "--max-tokens",
        "4",
    )
    assert code == 0, err
    assert out == "".join(WORDS) + "\n"
    assert "finish: stop_token (token 2); 3 prompt tokens, 4 generated in 0.500 s" in err
    assert "acceptance rate 0.375 (3/8 draft tokens), mean acceptance length 1.75" in err
    assert "accepted by position 0.50 0.25" in err
    sent = fake.requests[-1]
    assert sent.text == "hello" and list(sent.stop) == ["\n", "END"]
    assert sent.speculation.proposer == generate_pb2.PROPOSER_NGRAM
    assert sent.speculation.num_draft_tokens == 2
    assert (sent.temperature, sent.seed, sent.max_tokens) == (0.0, 3, 4)


def test_json_prints_the_whole_result(served) -> None:
    fake, address = served
    code, out, err = _run("1, 2,3", "--prompt-ids", "--address", address, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["text"] == "".join(WORDS) and result["token_ids"] == [10, 11, 12, 13]
    assert result["usage"]["acceptance_rate"] == pytest.approx(0.375)
    assert result["usage"]["proposer"] == "ngram" and result["timing"]["e2e_s"] == 0.5
    assert list(fake.requests[-1].token_ids.ids) == [1, 2, 3]


def test_errors_give_a_message_and_exit_code(served) -> None:
    _, address = served
    code, _, err = _run("x", "--address", address, "--temperature", "1000")
    assert code == 1 and "INVALID_ARGUMENT: temperature must be in [0, 100]." in err
    code, _, err = _run("x", "--address", "127.0.0.1:1", "--timeout", "2")
    assert code == 1 and "UNAVAILABLE" in err and "is `specdec serve` running" in err
    code, _, err = _run("1,a", "--prompt-ids", "--address", address)
    assert code == 2 and "--prompt-ids needs integers" in err
