"""How large a message each port takes (`specdec.message_limits`): the derived limits hold the
largest well-formed message they are derived for, `--max-request-bytes` replaces the client
port's limit, and the port refuses what is over it before any project code runs."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.launch.services import message_bytes
from orchestrator.server import Orchestrator
from specdec.message_limits import (
    checkpoint_vocab_size,
    max_prompt_chars,
    request_bytes,
    served_seq_len,
    service_message_bytes,
)
from specdec.pb import draft_pb2, target_pb2
from specdec.pb.specdec.v1 import generate_pb2 as pb
from specdec.pb.specdec.v1 import generate_pb2_grpc
from specdec.serving.blocks import Q_DENSE, DenseQ, DraftBlock
from specdec.serving.client import make_channel

LONG_ID = "r" * 128  # request ids are client text: longer than a uuid


def test_the_client_limit_holds_the_longest_prompt_in_the_widest_utf8() -> None:
    seq_len = 512
    text = "\U0001f600" * max_prompt_chars(seq_len)  # 4 bytes of UTF-8 each
    request = pb.GenerateRequest(
        text=text, request_id=LONG_ID, stop=["x" * 256] * 16, max_tokens=seq_len
    )
    assert request.ByteSize() <= request_bytes(seq_len)
    longer = pb.GenerateRequest(text=text + "\U0001f600" * 20_000)
    assert longer.ByteSize() > request_bytes(seq_len)


def test_the_service_limit_holds_a_dense_block_and_a_full_readmission() -> None:
    requests, k, vocab, seq_len = 16, 16, 32_000, 8192
    limit = service_message_bytes(requests, k, vocab, seq_len)
    ids = [f"{LONG_ID}{i}" for i in range(requests)]
    block = DraftBlock.build(
        ids, [2**40] * requests, [seq_len - k] * requests, [k] * requests,
        [Q_DENSE] * requests, [vocab - 1] * (requests * k),
        dense=DenseQ(torch.rand(requests * k, vocab)),
    )  # fmt: skip
    propose = draft_pb2.ProposeResponse(block=block.to_pb())
    assert propose.ByteSize() <= limit
    held = 128  # enough requests that the tokens outweigh the slack
    records = [
        target_pb2.DraftRecord(
            request_id=f"{LONG_ID}{i}", token_ids=[2**31 - 1] * seq_len, next_step=2**40
        )
        for i in range(held)
    ]
    readmit = target_pb2.ServeControl(set_draft=target_pb2.SetDraft(address="h" * 255,
                                                                     records=records))  # fmt: skip
    assert readmit.ByteSize() <= service_message_bytes(held, 1, 2, seq_len)
    # the dense term is what a block needs: a quarter of it would not hold this one
    assert propose.ByteSize() > service_message_bytes(requests, k // 4, vocab, seq_len)


def test_the_services_limit_comes_from_their_checkpoints(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    args = ["serve", "--target", str(target), "--draft", str(draft), "--max-requests", "8",
            "--max-seq-len", "96"]  # fmt: skip
    services = serve_config(parse_args(args)).services
    vocab = max(checkpoint_vocab_size(target), checkpoint_vocab_size(draft))
    assert vocab > 0
    want = service_message_bytes(8, services.max_num_draft_tokens, vocab, 96)
    assert message_bytes(services) == want


def test_max_request_bytes_replaces_the_client_ports_limit(checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    base = ["serve", "--target", str(target), "--draft", str(draft), "--host", "127.0.0.1",
            "--port", "0", "--metrics-port", "-1"]  # fmt: skip
    derived = serve_config(parse_args(base))
    assert derived.request_bytes == request_bytes(served_seq_len(str(target), None))
    config = serve_config(parse_args([*base, "--max-request-bytes", "4096"]))
    assert config.request_bytes == 4096
    for bad in ("100", str(2**31)):
        with pytest.raises(ValueError, match=r"max_request_bytes must be in \[1024, 2147483647\]"):
            serve_config(parse_args([*base, "--max-request-bytes", bad]))
    orchestrator = Orchestrator(config)  # only its client port is started: no pair is needed
    port = orchestrator.server.start()
    try:
        with make_channel(f"127.0.0.1:{port}", max_message_bytes=1 << 20) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(pb.GenerateRequest(text="x" * 8192, max_tokens=1), timeout=30)
    finally:
        orchestrator.server.stop(0)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (info.value.details() or "")
