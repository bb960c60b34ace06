"""The block contract over real gRPC: any order, k = 0, steps, duplicates, unknown ids, and bad
input on both services — each a per-request error with a specific status; everyone else is
still served and the service keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from bench.local import LocalPair
from draft_service.config import DraftConfig
from draft_service.server import start as start_draft
from specdec.errors import CheckpointError
from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftProposal, DraftQ, SparseQ, block_to_pb
from specdec.serving.client import LockstepStream, make_channel
from specdec.serving.messages import AdmitRequest, ErrorReason
from specdec.serving.server import ServerConfig
from specdec.serving.verdicts import VerifyResponse
from target_service.config import TargetConfig
from target_service.server import start as start_target
from tests.draft_service.models import (
    TOKENIZER_VOCAB,
    model_draft,
    runner_config,
    services,
)
from tests.specdec._runner_models import tiny_tokenizer
from tests.specdec.entries import VerifyResult, results

PROMPT = [5, 17, 42, 9, 77]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def svc(checkpoints: tuple[Path, Path]) -> Iterator[LocalPair]:
    with services(checkpoints[0], model_draft(checkpoints[1]), sampler_impl="torch") as s:
        yield s


_counter = iter(range(10**6))
_admitted: list[str] = []


@pytest.fixture(autouse=True)
def _release(svc: LocalPair) -> Iterator[None]:
    """Frees every request a test admitted (16 KV slots per service)."""
    yield
    ids = common_pb2.ReleaseRequest(request_ids=_admitted)
    for address in (svc.target_address, svc.draft_address):
        stub_cls = (
            target_pb2_grpc.TargetServiceStub
            if address == svc.target_address
            else draft_pb2_grpc.DraftServiceStub
        )
        with make_channel(address) as channel:
            stub_cls(channel).Release(ids, timeout=10)
    _admitted.clear()


@pytest.fixture
def target(svc: LocalPair) -> target_pb2_grpc.TargetServiceStub:
    return target_pb2_grpc.TargetServiceStub(make_channel(svc.target_address))


def _admit(target: target_pb2_grpc.TargetServiceStub, seed: int = 1, temp: float = 1.0) -> str:
    rid = f"req{next(_counter)}"
    _admitted.append(rid)
    target.Admit(AdmitRequest(rid, tuple(PROMPT), SamplingParams(temp, seed=seed)).to_pb())
    return rid


def _q(form: str, k: int, seed: int = 0) -> tuple[tuple[int, ...], DraftQ]:
    """k draft tokens sampled from a random q of the given form."""
    gen = torch.Generator().manual_seed(seed)
    if form == "none":
        return tuple(torch.randint(0, TOKENIZER_VOCAB, (k,), generator=gen).tolist()), None
    probs = torch.softmax(torch.randn(k, TOKENIZER_VOCAB, generator=gen) * 3, -1)
    tokens = torch.multinomial(probs, 1, generator=gen).flatten() if k else torch.zeros(0)
    if form == "dense":
        return tuple(int(t) for t in tokens), DenseQ(probs)
    ids = probs.topk(8, dim=-1).indices
    for row, token in zip(ids, tokens, strict=True):
        if token not in row:
            row[-1] = token  # the sampled token is in the support
    sparse = torch.softmax(torch.randn(k, ids.shape[1], generator=gen), -1)
    return tuple(int(t) for t in tokens), SparseQ(ids.int(), sparse)


def _verify(
    target: target_pb2_grpc.TargetServiceStub, block: list[DraftProposal] | common_pb2.DraftBlock
) -> list[VerifyResult]:
    """One block: DraftProposals, or a DraftBlock message as is."""
    pb = block_to_pb(block) if isinstance(block, list) else block
    with LockstepStream(target.Verify) as stream:
        response = stream(pb)
    return results(VerifyResponse.from_pb(response))


def test_any_order_and_k_2_0_1_each_against_its_own_q(
    target: target_pb2_grpc.TargetServiceStub,
) -> None:
    drafts = {"a": _q("dense", 2, 1), "b": _q("none", 0, 2), "c": _q("sparse", 1, 3)}
    seeds = {"a": 11, "b": 12, "c": 13}

    def run(order: list[list[str]]) -> dict[str, VerifyResult]:
        ids = {x: _admit(target, seeds[x]) for x in "abc"}
        out = {}
        for block in order:
            entries = [DraftProposal(ids[x], 0, len(PROMPT), *drafts[x]) for x in block]
            results = _verify(target, entries)
            assert [r.request_id for r in results] == [ids[x] for x in block]
            out |= {x: r for x, r in zip(block, results, strict=True)}
        return out

    in_order, shuffled = run([["a", "b", "c"]]), run([["c", "a", "b"]])
    alone = run([["a"], ["b"], ["c"]])
    for x in "abc":
        assert in_order[x].error is None
        strip = (in_order[x].token_ids, in_order[x].accepted, in_order[x].committed_length)
        assert strip == (shuffled[x].token_ids, shuffled[x].accepted, shuffled[x].committed_length)
        assert strip == (alone[x].token_ids, alone[x].accepted, alone[x].committed_length)
    assert len(in_order["b"].token_ids) == 1 and in_order["b"].accepted == ()
    assert len(in_order["a"].accepted) == 2 and len(in_order["c"].accepted) == 1


def _reason(result: VerifyResult) -> ErrorReason | None:
    return None if result.error is None else result.error.reason


def test_steps_duplicates_unknown_ids(target: target_pb2_grpc.TargetServiceStub) -> None:
    rid, other = _admit(target), _admit(target)
    n = len(PROMPT)
    first = _verify(target, [DraftProposal(rid, 0, n, *_q("none", 2))])[0]
    assert first.error is None and first.committed_length == n + len(first.token_ids)
    again = _verify(target, [DraftProposal(rid, 0, n, *_q("none", 2))])[0]
    assert _reason(again) == ErrorReason.DUPLICATE_STEP and again.error is not None
    assert again.error.code == grpc.StatusCode.ALREADY_EXISTS
    assert again.token_ids == first.token_ids  # the original verdict, applied once
    n1 = first.committed_length
    block = [
        DraftProposal("nobody", 0, n, *_q("none", 1)),
        DraftProposal(rid, 1, n1, *_q("none", 1)),
        DraftProposal(other, 0, n + 3, *_q("none", 1)),
    ]
    unknown, ok, mismatch = _verify(target, block)
    assert _reason(unknown) == ErrorReason.UNKNOWN_REQUEST
    assert unknown.error is not None and unknown.error.code == grpc.StatusCode.NOT_FOUND
    assert ok.error is None and ok.committed_length > n1
    assert _reason(mismatch) == ErrorReason.COMMITTED_LENGTH_MISMATCH
    assert _reason(_verify(target, [DraftProposal(rid, 0, n, *_q("none", 1))])[0]) == (
        ErrorReason.STALE_STEP
    )
    future = _verify(target, [DraftProposal(rid, 7, ok.committed_length, *_q("none", 1))])[0]
    assert _reason(future) == ErrorReason.FUTURE_STEP
    assert future.error is not None and future.error.code == grpc.StatusCode.FAILED_PRECONDITION
    twice = [DraftProposal(other, 0, n, *_q("none", 1))] * 2
    assert [_reason(r) for r in _verify(target, twice)] == [ErrorReason.DUPLICATE_ENTRY] * 2
    assert _verify(target, [DraftProposal(other, 0, n, *_q("none", 1))])[0].error is None


def test_good_entries_among_every_kind_of_bad_one_are_exact(
    target: target_pb2_grpc.TargetServiceStub,
) -> None:
    """One block mixing good entries of every q form with entries failing each check. The target
    verifies the block's columns: the failing entries' q rows are left out of the sampler's
    tensors, so each good verdict must equal the verdict of its entry alone."""
    drafts = {"a": _q("sparse", 2, 1), "b": _q("dense", 3, 2), "c": _q("none", 1, 3),
              "d": _q("sparse", 1, 4), "e": _q("dense", 2, 5)}  # fmt: skip
    seeds = {x: 20 + i for i, x in enumerate(drafts)}
    n, r = len(PROMPT), ErrorReason
    good = {x: _admit(target, seeds[x]) for x in drafts}
    dup_step, mismatch, future, twice, malformed, nan, oov = (_admit(target) for _ in range(7))
    first = _verify(target, [DraftProposal(dup_step, 0, n, *_q("none", 1))])[0]
    nan_tokens, nan_q = _q("sparse", 2, 6)
    assert nan_q is not None
    nan_q.probs[1, 0] = float("nan")
    oov_tokens, oov_q = _q("dense", 2, 7)
    entries = [
        (DraftProposal("nobody", 0, n, *_q("sparse", 2, 8)), r.UNKNOWN_REQUEST),
        (DraftProposal(good["a"], 0, n, *drafts["a"]), None),
        (DraftProposal(twice, 0, n, *_q("sparse", 1, 9)), r.DUPLICATE_ENTRY),
        (DraftProposal(mismatch, 0, n + 1, *_q("dense", 2, 10)), r.COMMITTED_LENGTH_MISMATCH),
        (DraftProposal(good["b"], 0, n, *drafts["b"]), None),
        (DraftProposal(future, 3, n, *_q("sparse", 2, 11)), r.FUTURE_STEP),
        (DraftProposal(dup_step, 0, n, *_q("none", 1)), r.DUPLICATE_STEP),
        (DraftProposal(good["c"], 0, n, *drafts["c"]), None),
        (DraftProposal(twice, 0, n, *_q("sparse", 1, 9)), r.DUPLICATE_ENTRY),
        (DraftProposal(malformed, 0, n, *_q("dense", 1, 12)), r.INVALID_ARGUMENT),
        (DraftProposal(good["d"], 0, n, *drafts["d"]), None),
        (DraftProposal(nan, 0, n, nan_tokens, nan_q), r.INVALID_DRAFT_PROBS),
        (DraftProposal(oov, 0, n, (oov_tokens[0], 260), oov_q), r.TOKEN_OUT_OF_VOCAB),
        (DraftProposal(good["e"], 0, n, *drafts["e"]), None),
    ]
    pb = block_to_pb([p for p, _ in entries])
    pb.committed_lengths[9] = 0  # a malformed entry: only a DraftBlock can carry it
    results = _verify(target, pb)
    assert [_reason(res) for res in results] == [reason for _, reason in entries]
    assert results[6].token_ids == first.token_ids  # the duplicate step repeats its verdict
    messages = [res.error.message if res.error else "" for res in results]
    assert messages[9].startswith("entries[9].committed_length must be >= 1")
    assert messages[11].startswith("entries[11].q: draft_probs contain NaN")
    assert messages[12].startswith("entries[12].draft_token_ids holds 260")
    target.Release(common_pb2.ReleaseRequest(request_ids=_admitted))
    position = {p.request_id: i for i, (p, _) in enumerate(entries)}
    mixed = {x: results[position[rid]] for x, rid in good.items()}
    for x, (tokens, q) in drafts.items():
        alone = _verify(target, [DraftProposal(_admit(target, seeds[x]), 0, n, tokens, q)])[0]
        assert alone.error is None and mixed[x].error is None
        got = (mixed[x].token_ids, mixed[x].accepted, mixed[x].committed_length)
        assert got == (alone.token_ids, alone.accepted, alone.committed_length), x


def _bad_block(
    kind: str, rid: str, good: str, n: int
) -> tuple[common_pb2.DraftBlock, ErrorReason, str, bool]:
    """A block [bad, good] with `kind` broken in the bad entry's rows, the bad entry's reason
    and message, and whether the breakage is the block's (then both entries fail)."""
    form = "sparse" if kind.startswith("sparse") else "dense"
    tokens, q = _q(form, 2, seed=4)
    pb = block_to_pb(
        [DraftProposal(rid, 0, n, tokens, q), DraftProposal(good, 0, n, *_q(form, 2, 9))]
    )
    target = pb.dense if form == "dense" else pb.sparse
    probs = torch.frombuffer(bytearray(target.probs), dtype=torch.float32)
    width = len(probs) // 4  # the bad entry owns rows 0 and 1
    r = ErrorReason
    cases = {
        "nan": (float("nan"), r.INVALID_DRAFT_PROBS, "entries[0].q: draft_probs contain NaN"),
        "inf": (float("inf"), r.INVALID_DRAFT_PROBS, "entries[0].q: draft_probs contain NaN, inf"),
        "negative": (-0.5, r.INVALID_DRAFT_PROBS, "negative"),
        "sparse_nan": (float("nan"), r.INVALID_DRAFT_PROBS, "entries[0].q: draft_probs contain"),
    }
    if kind in cases:
        value, reason, text = cases[kind]
        probs[3] = value
        target.probs = probs.numpy().tobytes()
        return pb, reason, text, False
    if kind == "unnormalised":
        probs[: 2 * width] *= 0.5
        target.probs = probs.numpy().tobytes()
        return (
            pb,
            r.DRAFT_PROBS_NOT_NORMALIZED,
            "entries[0].q: draft_probs rows must sum to 1",
            False,
        )
    if kind == "out_of_support":
        row = probs.view(4, TOKENIZER_VOCAB)
        row[0] += row[0, tokens[0]] / (TOKENIZER_VOCAB - 1)
        row[0, tokens[0]] = 0.0
        target.probs = row.numpy().tobytes()
        return (
            pb,
            r.DRAFT_TOKEN_OUT_OF_SUPPORT,
            "entries[0].q: a draft token has probability 0",
            False,
        )
    if kind == "short_bytes":
        target.probs = target.probs[:-4]
        return pb, r.INVALID_ARGUMENT, "dense.probs has", True
    if kind == "sparse_ids_shape":
        pb.sparse.token_ids = pb.sparse.token_ids[:8]
        return pb, r.INVALID_ARGUMENT, "sparse.token_ids has 8 bytes", True
    if kind == "sparse_id_out_of_vocab":
        ids = torch.frombuffer(bytearray(pb.sparse.token_ids), dtype=torch.int32)
        mine = ids[: 2 * width]
        others = mine != tokens[0]
        mine[others] = torch.where(mine[others] >= 0, 299, -1).int()
        pb.sparse.token_ids = ids.numpy().tobytes()
        return pb, r.INVALID_DRAFT_PROBS, "outside the vocabulary", False
    if kind == "token_out_of_vocab":
        ids = torch.frombuffer(bytearray(pb.draft_token_ids), dtype=torch.int32)
        ids[1] = 260  # entries[0]'s second draft: a padding row of the target's embedding
        pb.draft_token_ids = ids.numpy().tobytes()
        return pb, r.TOKEN_OUT_OF_VOCAB, "entries[0].draft_token_ids holds 260", False
    assert kind == "too_many_drafts"
    pb = block_to_pb(
        [DraftProposal(rid, 0, n, *_q("none", 17)), DraftProposal(good, 0, n, *_q(form, 2, 9))]
    )
    return pb, r.INVALID_ARGUMENT, "entries[0].draft_token_ids has 17 tokens; at most 16", False


BAD = [
    "nan", "inf", "negative", "sparse_nan", "unnormalised", "out_of_support", "short_bytes",
    "sparse_ids_shape", "sparse_id_out_of_vocab", "token_out_of_vocab", "too_many_drafts",
]  # fmt: skip


@pytest.mark.parametrize("kind", BAD)
def test_bad_draft_input_is_that_requests_error(
    target: target_pb2_grpc.TargetServiceStub, kind: str
) -> None:
    bad, good = _admit(target), _admit(target)
    n = len(PROMPT)
    pb, reason, text, whole_block = _bad_block(kind, bad, good, n)
    results = _verify(target, pb)
    assert _reason(results[0]) == reason and results[0].error is not None
    assert results[0].error.code == INVALID
    assert text in results[0].error.message, results[0].error.message
    if whole_block:  # a malformed buffer cannot be pinned on one entry: each fails, alone
        assert results[1].error is not None and results[1].error.message == results[0].error.message
        assert _verify(target, [DraftProposal(good, 0, n, *_q("dense", 2, 9))])[0].error is None
    else:
        assert results[1].error is None and len(results[1].token_ids) >= 1
    retry = _verify(target, [DraftProposal(bad, 0, n, *_q("sparse", 2, 5))])[0]
    assert retry.error is None, "the bad request's state must be intact after its error"


@pytest.mark.parametrize("stub_kind", ["target", "draft"])
@pytest.mark.parametrize(
    ("prompt", "sampling", "text"),
    [
        ([1, 2], common_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
        ([1, 2], common_pb2.SamplingParams(top_p=1.5), "sampling.top_p"),
        ([1, 999], common_pb2.SamplingParams(), "prompt_token_ids holds 999"),
        ([], common_pb2.SamplingParams(), "prompt_token_ids must hold"),
    ],
)
def test_invalid_admission(svc: LocalPair, stub_kind: str, prompt, sampling, text) -> None:  # type: ignore[no-untyped-def]
    if stub_kind == "target":
        stub = target_pb2_grpc.TargetServiceStub(make_channel(svc.target_address))
    else:
        stub = draft_pb2_grpc.DraftServiceStub(make_channel(svc.draft_address))
    req = common_pb2.AdmitRequest(request_id="x", prompt_token_ids=prompt, sampling=sampling)
    with pytest.raises(grpc.RpcError) as info:
        stub.Admit(req, timeout=10)
    assert info.value.code() == INVALID and text in info.value.details()
    ok = common_pb2.AdmitRequest(
        request_id=f"ok-{stub_kind}-{next(_counter)}", prompt_token_ids=[3, 4]
    )
    assert stub.Admit(ok, timeout=10).committed_length == 2


def test_draft_bad_asks_are_per_request_errors(svc: LocalPair) -> None:
    stub = draft_pb2_grpc.DraftServiceStub(make_channel(svc.draft_address))
    ids = [f"d{next(_counter)}" for _ in range(5)]
    _admitted.extend(ids)
    for rid in ids:
        stub.Admit(AdmitRequest(rid, tuple(PROMPT), SamplingParams(seed=3)).to_pb())
    n = len(PROMPT)
    asks = [
        draft_pb2.ProposeEntry(request_id=ids[0], step=0, committed_length=n, num_draft_tokens=3),
        draft_pb2.ProposeEntry(request_id="ghost", step=0, committed_length=n, num_draft_tokens=1),
        draft_pb2.ProposeEntry(request_id=ids[1], step=0, committed_length=n, num_draft_tokens=99),
        draft_pb2.ProposeEntry(
            request_id=ids[2], step=0, committed_length=n + 1, new_token_ids=[400],
            num_draft_tokens=1,
        ),
        draft_pb2.ProposeEntry(request_id=ids[3], step=0, committed_length=9, num_draft_tokens=1),
        # a later step is taken only where its new tokens reach the committed length
        draft_pb2.ProposeEntry(request_id=ids[4], step=3, committed_length=n + 2,
                               new_token_ids=[5], num_draft_tokens=1),
    ]  # fmt: skip
    with LockstepStream(stub.Propose) as stream:
        response = stream(draft_pb2.ProposeBlock(entries=asks))
    block = response.block
    assert list(block.request_ids) == [ids[0]] and list(block.steps) == [0]
    assert list(block.num_draft_tokens) == [3] and block.committed_lengths[0] == n
    assert list(block.q_forms) == [common_pb2.Q_FORM_SPARSE]
    assert len(response.block.draft_token_ids) == 3 * 4
    assert len(response.block.sparse.probs) == 3 * response.block.sparse.support_size * 4
    reasons = {e.request_id: ErrorReason(e.error.reason) for e in response.errors}
    assert reasons == {
        "ghost": ErrorReason.UNKNOWN_REQUEST,
        ids[1]: ErrorReason.INVALID_ARGUMENT,
        ids[2]: ErrorReason.TOKEN_OUT_OF_VOCAB,
        ids[3]: ErrorReason.COMMITTED_LENGTH_MISMATCH,
        ids[4]: ErrorReason.COMMITTED_LENGTH_MISMATCH,
    }
    assert all(e.error.message for e in response.errors)


def test_oversized_block_is_refused_and_service_keeps_serving(
    checkpoints: tuple[Path, Path],
) -> None:
    small = ServerConfig(max_message_bytes=64 * 1024)
    with services(checkpoints[0], model_draft(checkpoints[1]), small, "torch") as s:
        target = target_pb2_grpc.TargetServiceStub(make_channel(s.target_address))
        rid = _admit(target)
        n = len(PROMPT)
        big = [DraftProposal(rid, 0, n, (1,), DenseQ(torch.full((1, 20000), 1 / 20000)))]
        with pytest.raises(grpc.RpcError) as info:
            _verify(target, big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _verify(target, [DraftProposal(rid, 0, n, *_q("dense", 2))])[0].error is None


def test_incompatible_draft_tokenizer_is_refused_at_start(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    tok = tiny_tokenizer()
    tok.add_tokens(["extra-word"])
    tok.save_pretrained(str(tmp_path / "other"))
    draft, _ = start_draft(DraftConfig(proposer="ngram", tokenizer_path=str(tmp_path / "other")))
    try:
        cfg = TargetConfig(runner_config(checkpoints[0]), draft_address=f"127.0.0.1:{draft.port}")
        with pytest.raises(CheckpointError, match=r"Refusing the draft .* tokenizer"):
            start_target(cfg)
    finally:
        draft.stop(0)
