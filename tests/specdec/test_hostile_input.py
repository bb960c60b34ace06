"""Hostile values in the protocol's unsigned fields are refused where each message is parsed,
with a sentence naming the field and its range, and cost only the request or entry at fault:
a client's -1 sent as uint32 must never reach an int32 tensor."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from specdec.limits import INT32_MAX, MAX_SEED, MAX_STEP
from specdec.pb import common_pb2, draft_pb2, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock, DraftProposal, SparseQ, block_to_pb
from specdec.serving.client import make_channel
from specdec.serving.messages import AdmitRequest, ProposeEntry
from specdec.serving.verdicts import VerifyResponse
from tests.specdec.entries import proposal

U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1


def test_sampling_params_ranges() -> None:
    assert SamplingParams(top_k=INT32_MAX).top_k == INT32_MAX
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2147483647\].*got 2147483648"):
        SamplingParams(top_k=2**31)
    with pytest.raises(ValueError, match=rf"seed must be in \[0, {MAX_SEED}\]"):
        SamplingParams(seed=U64_MAX)


def _admit_pb(**changes: int) -> common_pb2.AdmitRequest:
    pb = common_pb2.AdmitRequest(request_id="a", prompt_token_ids=[1, 2], first_step=3)
    pb.sampling.top_k = changes.pop("top_k", 0)
    pb.sampling.seed = changes.pop("seed", 0)
    for name, value in changes.items():
        setattr(pb, name, value)
    return pb


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"top_k": 2**31}, r"^sampling\.top_k must be in \[0, 2147483647\]"),
        ({"top_k": U32_MAX}, r"^sampling\.top_k must be in \[0, 2147483647\]"),
        ({"seed": 2**63}, r"^sampling\.seed must be in \[0, 9223372036854775807\]"),
        ({"first_step": 2**63}, r"^first_step must be in \[0, 9223372036854775807\]"),
    ],
)
def test_admit_request_ranges(changes: dict[str, int], match: str) -> None:
    assert AdmitRequest.from_pb(_admit_pb()).first_step == 3  # well-formed before the change
    with pytest.raises(ValueError, match=match):
        AdmitRequest.from_pb(_admit_pb(**changes))


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("step", U64_MAX, r"^step must be in \[0, 9223372036854775807\], got 18446744073709551615"),
        ("committed_length", U32_MAX, r"^committed_length must be in \[0, 2147483647\]"),
        ("num_draft_tokens", U32_MAX, r"^num_draft_tokens must be in \[0, 2147483647\]"),
    ],
)
def test_propose_entry_ranges(name: str, value: int, match: str) -> None:
    pb = draft_pb2.ProposeEntry(request_id="a", step=MAX_STEP, committed_length=INT32_MAX,
                                num_draft_tokens=INT32_MAX)  # fmt: skip
    ProposeEntry.from_pb(pb)  # the largest values in range are accepted
    setattr(pb, name, value)
    with pytest.raises(ValueError, match=match):
        ProposeEntry.from_pb(pb)


def _block(q: str = "none", k: int = 2) -> common_pb2.DraftBlock:
    ids = torch.tensor([1, 2] * k, dtype=torch.int32).reshape(k, 2)
    sparse = SparseQ(ids, torch.full((k, 2), 0.5)) if q == "sparse" else None
    return block_to_pb([DraftProposal(f"r{i}", 5, 3, tuple(range(k)), sparse) for i in range(3)])


@pytest.mark.parametrize(
    ("column", "value", "match"),
    [
        ("steps", U64_MAX, r"^entries\[1\]\.step must be >= 0 and <= 9223372036854775807, got "),
        ("committed_lengths", U32_MAX, r"^entries\[1\]\.committed_length must be >= 1 and <= "),
    ],
)
def test_draft_block_entry_ranges_fail_only_their_entry(
    column: str, value: int, match: str
) -> None:
    pb = _block()
    getattr(pb, column)[1] = value
    parsed = DraftBlock.from_pb(pb)
    assert list(parsed.errors) == [1]
    assert re.match(match, parsed.errors[1])
    assert proposal(parsed, 2).draft_token_ids == (0, 1)


def test_draft_block_num_draft_tokens_out_of_range_is_the_blocks_error() -> None:
    pb = _block()
    pb.num_draft_tokens[0] = U32_MAX  # entries 1 and 2 can no longer be located
    with pytest.raises(
        ValueError, match=r"^entries\[0\]\.num_draft_tokens must be in \[0, 2147483647\]"
    ):
        DraftBlock.from_pb(pb)


def test_dense_vocab_size_range() -> None:
    pb = _block()
    pb.q_forms[0] = common_pb2.Q_FORM_DENSE
    pb.dense.vocab_size = U32_MAX
    with pytest.raises(ValueError, match=r"^dense\.vocab_size must be in \[1, 16777216\]"):
        DraftBlock.from_pb(pb)


def _timed(parse: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        parse()
    return str(info.value), time.perf_counter() - start


@pytest.mark.parametrize("k", [2, 0])  # k = 0: the q buffers are empty and match any width
def test_huge_support_size_is_refused_before_allocating(k: int) -> None:
    pb = _block("sparse", k)
    DraftBlock.from_pb(pb, max_support_size=1024)
    pb.sparse.support_size = INT32_MAX
    message, seconds = _timed(lambda: DraftBlock.from_pb(pb))
    assert message == (
        "sparse.support_size must be in [1, 16777216] (the largest vocabulary the sampler "
        "takes), got 2147483647."
    )
    assert seconds < 0.5
    message, seconds = _timed(lambda: DraftBlock.from_pb(pb, max_support_size=1024))
    assert message.startswith("sparse.support_size must be in [1, 1024] (this service's")
    assert seconds < 0.5
    pb.sparse.support_size = 3
    with pytest.raises(ValueError, match=r"support_size must be in \[1, 2\] \(the vocabulary\)"):
        DraftBlock.from_pb(pb, max_support_size=1024, vocab_size=2)


# ---- through real gRPC: one hostile request does not disturb the service -------------------


@pytest.fixture(scope="module")
def target_address(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from target_service.config import TargetConfig
    from target_service.server import start
    from tests.draft_service.models import build_checkpoints, runner_config

    target_dir, _ = build_checkpoints(tmp_path_factory.mktemp("ckpt"))
    server, _ = start(TargetConfig(runner_config(Path(target_dir)), sampler_impl="torch"))
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(0)


def test_admit_with_top_k_2_31_is_invalid_and_the_service_keeps_serving(
    target_address: str,
) -> None:
    stub = target_pb2_grpc.TargetServiceStub(make_channel(target_address))
    bad = common_pb2.AdmitRequest(request_id="bad", prompt_token_ids=[3, 4, 5])
    bad.sampling.top_k = 2**31  # a client's -1 as int32 would be 2**32 - 1; both overflow int32
    with pytest.raises(grpc.RpcError) as info:
        stub.Admit(bad, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_k must be in [0, 2147483647]" in (info.value.details() or "")

    good = common_pb2.AdmitRequest(request_id="good", prompt_token_ids=[3, 4, 5])
    good.sampling.temperature, good.sampling.top_k, good.sampling.seed = 0.8, 5, 7
    admitted = stub.Admit(good, timeout=30)
    assert (admitted.committed_length, admitted.next_step) == (3, 0)
    other = common_pb2.AdmitRequest(request_id="other", prompt_token_ids=[6, 7])
    stub.Admit(other, timeout=30)
    # an out-of-range step fails its own entry only; the good request commits its token
    block = block_to_pb([DraftProposal("good", 0, 3, (8, 9)), DraftProposal("other", 0, 2, ())])
    block.steps[1] = U64_MAX
    (response,) = stub.Verify(iter([block]), timeout=60)
    verdicts = VerifyResponse.from_pb(response)
    assert list(verdicts.errors) == [1]
    assert verdicts.errors[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "entries[1].step must be >= 0 and <= 9223372036854775807" in verdicts.errors[1].message
    assert 1 <= len(verdicts.token_ids[0]) <= 3 and verdicts.committed_lengths[0] > 3
