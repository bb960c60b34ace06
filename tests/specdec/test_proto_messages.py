"""Round trips of the specdec.v1 domain objects, wire format and shape validation."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import grpc
import pytest
import torch

from specdec.pb import common_pb2, generate, target_pb2
from specdec.sampling_params import SamplingParams
from specdec.serving.arrays import pack, unpack
from specdec.serving.blocks import (
    Q_DENSE,
    Q_NONE,
    Q_SPARSE,
    DenseQ,
    DraftBlock,
    DraftProposal,
    SparseQ,
    block_to_pb,
)
from specdec.serving.messages import (
    REASON_CODES,
    AdmitRequest,
    ErrorReason,
    ModelInfo,
    ProposeEntry,
    QForm,
    RequestError,
    check_compatible,
)
from specdec.serving.verdicts import VerifyResponse
from tests.specdec.entries import VerifyResult, proposal, results


def test_error_reason_mirrors_proto_enum() -> None:
    proto = {v.name.removeprefix("ERROR_REASON_"): v.number for v in
             common_pb2.ErrorReason.DESCRIPTOR.values}  # fmt: skip
    assert proto == {r.name: r.value for r in ErrorReason}


def test_every_reason_has_one_status_code() -> None:
    reasons = {r for r in ErrorReason if r != ErrorReason.UNSPECIFIED}
    assert set(REASON_CODES) == reasons
    error = RequestError.of(ErrorReason.CAPACITY, "full")
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.message == "full"


def test_q_form_mirrors_proto_enum() -> None:
    proto = {v.name.removeprefix("Q_FORM_"): v.number for v in common_pb2.QForm.DESCRIPTOR.values}
    assert proto == {f.name: f.value for f in QForm}


def test_generated_modules_are_current() -> None:
    assert generate.main(["--check"]) == 0


def test_check_detects_stale_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(generate.OUT_ROOT / "specdec", tmp_path / "specdec")
    stale = tmp_path / "specdec" / "v1" / "target_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited\n")
    monkeypatch.setattr(generate, "OUT_ROOT", tmp_path)
    assert generate.main(["--check"]) == 1


def test_pack_is_little_endian_row_major() -> None:
    t = torch.tensor([[1.0, -2.5], [0.25, 3.0]], dtype=torch.float32)
    assert pack(t) == struct.pack("<4f", 1.0, -2.5, 0.25, 3.0)
    ids = torch.tensor([1, -1, 70000], dtype=torch.int32)
    assert pack(ids) == struct.pack("<3i", 1, -1, 70000)
    assert torch.equal(unpack(pack(t), torch.float32, (2, 2), "x"), t)


def test_unpack_names_field_on_wrong_size() -> None:
    with pytest.raises(ValueError, match=r"entries\[3\]\.dense\.probs has 8 bytes; expected 24"):
        unpack(b"\0" * 8, torch.float32, (2, 3), "entries[3].dense.probs")


def _q(kind: str, k: int, vocab: int = 11, support: int = 4) -> DenseQ | SparseQ | None:
    if kind == "dense":
        return DenseQ(torch.softmax(torch.randn(k, vocab), -1))
    if kind == "sparse":
        ids = torch.randint(0, vocab, (k, support), dtype=torch.int32)
        ids[:, -1] = -1
        return SparseQ(ids, torch.rand(k, support))
    return None


def _round_trip(proposals: list[DraftProposal]) -> list[DraftProposal]:
    wire = block_to_pb(proposals).SerializeToString()
    parsed = DraftBlock.from_pb(common_pb2.DraftBlock.FromString(wire))
    return [proposal(parsed, i) for i in range(len(parsed))]


@pytest.mark.parametrize("kinds", [["dense"], ["sparse"], ["none"], ["sparse", "none", "dense"]])
@pytest.mark.parametrize("ks", [(0,), (1,), (3, 0, 2)])
def test_draft_block_round_trip(kinds: list[str], ks: tuple[int, ...]) -> None:
    proposals = [
        DraftProposal(f"req-{i}", 7 + i, 12, tuple(range(k)), _q(kinds[i % len(kinds)], k))
        for i, k in enumerate(ks)
    ]
    back = _round_trip(proposals)
    assert len(back) == len(proposals)
    for p, b in zip(proposals, back, strict=True):
        assert isinstance(b, DraftProposal)
        assert (b.request_id, b.step, b.committed_length) == (p.request_id, p.step, 12)
        assert b.draft_token_ids == p.draft_token_ids
        assert type(b.q) is type(p.q)
        if p.q is not None and b.q is not None:
            assert torch.equal(b.q.probs, p.q.probs)
        if isinstance(p.q, SparseQ) and isinstance(b.q, SparseQ):
            assert torch.equal(b.q.token_ids, p.q.token_ids)


def test_sparse_q_of_a_block_is_one_buffer_per_field() -> None:
    proposals = [DraftProposal(f"r{i}", 0, 3, (1, 2), _q("sparse", 2)) for i in range(5)]
    pb = block_to_pb(proposals)
    assert pb.sparse.support_size == 4 and len(pb.sparse.probs) == 5 * 2 * 4 * 4
    assert list(pb.q_forms) == [common_pb2.Q_FORM_SPARSE] * 5
    assert pb.draft_token_ids == pack(torch.tensor([1, 2] * 5, dtype=torch.int32))
    assert not pb.HasField("dense")
    rows = torch.cat([p.q.token_ids for p in proposals if isinstance(p.q, SparseQ)])
    assert pb.sparse.token_ids == pack(rows)


def test_narrower_sparse_rows_are_padded_to_the_block_width() -> None:
    narrow = SparseQ(torch.tensor([[5, 6]], dtype=torch.int32), torch.tensor([[0.5, 0.5]]))
    back = _round_trip([DraftProposal("a", 0, 3, (5,), narrow), DraftProposal("b", 0, 3, (1,),
                        _q("sparse", 1))])  # fmt: skip
    q = back[0].q
    assert isinstance(q, SparseQ)
    assert q.token_ids.tolist() == [[5, 6, -1, -1]] and q.probs.tolist() == [[0.5, 0.5, 0, 0]]


def _block(kind: str) -> common_pb2.DraftBlock:
    return block_to_pb([DraftProposal(f"r{i}", 0, 3, (1, 2), _q(kind, 2)) for i in range(4)])


@pytest.mark.parametrize(
    ("kind", "mutate", "match"),
    [
        ("dense", lambda pb: setattr(pb.dense, "probs", pb.dense.probs[:-4]),
         r"dense\.probs has 348 bytes; expected 352 \(8 x 11 little-endian float32\)"),
        ("dense", lambda pb: setattr(pb.dense, "vocab_size", 0),
         r"dense\.vocab_size must be in \[1, 16777216\], got 0"),
        ("dense", lambda pb: pb.ClearField("dense"),
         r"entries\[0\]\.q_form is DENSE but the block has no dense"),
        ("sparse", lambda pb: setattr(pb.sparse, "token_ids", b"\0" * 12),
         r"sparse\.token_ids has 12 bytes; expected 128"),
        ("sparse", lambda pb: setattr(pb.sparse, "probs", b""), r"sparse\.probs has 0 bytes"),
        ("sparse", lambda pb: setattr(pb.sparse, "support_size", 0),
         r"sparse\.support_size must be in \[1, 16777216\] \(the largest vocabulary the "
         r"sampler takes\), got 0"),
        ("sparse", lambda pb: setattr(pb, "draft_token_ids", pb.draft_token_ids[:-4]),
         r"draft_token_ids has 28 bytes; expected 32 \(the entries' num_draft_tokens sum to 8"),
        ("sparse", lambda pb: (pb.num_draft_tokens.__setitem__(3, 3),
                               setattr(pb, "draft_token_ids", pb.draft_token_ids + b"\0" * 4)),
         r"sparse\.token_ids has 128 bytes; expected 144 \(9 x 4 .*\)\. Rows: 9, the draft "
         r"tokens of the Q_FORM_SPARSE entries\."),
        ("none", lambda pb: pb.q_forms.__setitem__(2, common_pb2.Q_FORM_SPARSE),
         r"entries\[2\]\.q_form is SPARSE but the block has no sparse"),
        ("none", lambda pb: pb.steps.pop(),
         r"steps has 3 values for 4 request_ids; every column needs one per entry"),
        ("none", lambda pb: pb.q_forms.append(common_pb2.Q_FORM_NONE),
         r"q_forms has 5 values for 4 request_ids"),
        ("none", lambda pb: pb.q_forms.__setitem__(1, 5),
         r"entries\[1\]\.q_form is 5; expected Q_FORM_NONE"),
    ],
)  # fmt: skip
def test_block_shape_errors_name_the_field(kind, mutate, match) -> None:  # type: ignore[no-untyped-def]
    pb = _block(kind)
    DraftBlock.from_pb(pb)  # well-formed before the mutation
    mutate(pb)
    with pytest.raises(ValueError, match=match):
        DraftBlock.from_pb(pb)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda pb: pb.committed_lengths.__setitem__(2, 0),
         r"^entries\[2\]\.committed_length must be >= 1"),
        (lambda pb: pb.request_ids.__setitem__(2, ""),
         r"^entries\[2\]\.request_id must be a non-empty"),
    ],
)  # fmt: skip
def test_malformed_entry_is_only_that_entrys_error(mutate, match) -> None:  # type: ignore[no-untyped-def]
    pb = _block("sparse")
    mutate(pb)
    parsed = DraftBlock.from_pb(pb)
    assert list(parsed.errors) == [2] and re.match(match, parsed.errors[2])
    with pytest.raises(ValueError, match=match):
        proposal(parsed, 2)
    last = proposal(parsed, 3)
    assert isinstance(last.q, SparseQ) and last.request_id == "r3"
    assert parsed.sparse is not None and torch.equal(last.q.probs, parsed.sparse.probs[6:8])


def test_q_rows_must_match_draft_tokens() -> None:
    with pytest.raises(ValueError, match="q has 3 rows for 2 draft tokens"):
        DraftProposal("a", 0, 3, (1, 2), _q("dense", 3))


def test_verdicts_round_trip_as_columns() -> None:
    err = RequestError(ErrorReason.STALE_STEP, grpc.StatusCode.FAILED_PRECONDITION, "old step")
    dup_err = RequestError(ErrorReason.DUPLICATE_STEP, grpc.StatusCode.ALREADY_EXISTS, "again")
    verdicts = VerifyResponse.pending(["a", "b", "c", "d"], [3, 1, 0, 9])
    verdicts.commit(0, [5, 6, 9], 2, 3, 40)
    verdicts.fail(1, err)
    verdicts.commit(2, [7], 0, 1, 12)
    verdicts.fail(2, dup_err)
    verdicts.commit(3, [4], 0, 0, 30)  # k = 0: one decoded token
    pb = target_pb2.VerifyResponse.FromString(verdicts.to_pb().SerializeToString())
    assert list(pb.num_accepted) == [2, 0, 0, 0] and list(pb.token_ids) == [5, 6, 9, 7, 4]
    assert [e.index for e in pb.errors] == [1, 2]
    back = VerifyResponse.from_pb(pb)
    assert results(back) == [
        VerifyResult("a", 3, (5, 6, 9), (True, True, False), 40),
        VerifyResult("b", 1, error=err),
        VerifyResult("c", 0, (7,), (False,), 12, dup_err),
        VerifyResult("d", 9, (4,), (), 30),
    ]
    assert back.errors == {1: err, 2: dup_err} and back.num_draft_tokens == [3, 0, 1, 0]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda pb: pb.token_ids.append(1), "columns have different lengths"),
        (lambda pb: pb.steps.pop(), "columns have different lengths"),
        (lambda pb: pb.errors.add(index=1), "errors name an index past its 1 verdicts"),
    ],
)  # fmt: skip
def test_verify_response_with_inconsistent_columns_is_refused(mutate, match) -> None:  # type: ignore[no-untyped-def]
    verdicts = VerifyResponse.pending(["a"], [3])
    verdicts.commit(0, [5, 6], 1, 2, 40)
    pb = verdicts.to_pb()
    mutate(pb)
    with pytest.raises(ValueError, match=match):
        VerifyResponse.from_pb(pb)


def test_admission_round_trip_and_sampling_defaults() -> None:
    adm = AdmitRequest("r", (1, 2, 3), SamplingParams(0.7, 5, 0.9, 2**62), first_step=4)
    assert AdmitRequest.from_pb(adm.to_pb()) == adm
    bare = AdmitRequest.from_pb(common_pb2.AdmitRequest(request_id="r", prompt_token_ids=[1]))
    assert bare.sampling == SamplingParams()  # unset temperature / top_p mean 1


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        (common_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
        (common_pb2.SamplingParams(temperature=float("nan")), "sampling.temperature"),
        (common_pb2.SamplingParams(top_p=0.0), "sampling.top_p"),
        (common_pb2.SamplingParams(seed=2**63), "sampling.seed"),
    ],
)
def test_invalid_sampling_params_name_field(sampling, match) -> None:  # type: ignore[no-untyped-def]
    pb = common_pb2.AdmitRequest(request_id="r", prompt_token_ids=[1], sampling=sampling)
    with pytest.raises(ValueError, match=match):
        AdmitRequest.from_pb(pb)


def test_admission_checks() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must hold"):
        AdmitRequest("r", ())
    with pytest.raises(ValueError, match=r"prompt_token_ids holds 99, outside .*\[0, 50\)"):
        AdmitRequest("r", (1, 99)).check_vocab(50)
    with pytest.raises(ValueError, match=r"prompt_token_ids has 4 tokens; at most 3 fit"):
        AdmitRequest("r", (1, 2, 3, 4)).check_limits(50, max_seq_len=4)
    with pytest.raises(ValueError, match="outside"):
        AdmitRequest("r", (1, 99)).check_limits(50, max_seq_len=100)
    AdmitRequest("r", (1, 2, 3)).check_limits(50, max_seq_len=4)  # room for one new token


def _info(**kw: object) -> ModelInfo:
    base: dict[str, object] = dict(
        architecture="LlamaForCausalLM", vocab_size=64, tokenizer_vocab_size=60,
        tokenizer_hash="abc", max_seq_len=128, max_requests=8, max_num_draft_tokens=8,
        max_message_bytes=1 << 20, dtype="float32",
    )  # fmt: skip
    return ModelInfo(**{**base, **kw})  # type: ignore[arg-type]


def test_model_info_round_trip_and_compatibility() -> None:
    info = _info()
    assert ModelInfo.from_pb(info.to_pb()) == info
    check_compatible(info, _info(vocab_size=96))  # padded sizes may differ
    with pytest.raises(ValueError, match=r"tokenizer .* differs"):
        check_compatible(info, _info(tokenizer_hash="xyz"))
    with pytest.raises(ValueError, match="has 50 ids and the target's 60"):
        check_compatible(info, _info(tokenizer_vocab_size=50))
    with pytest.raises(ValueError, match="tokenizer_vocab_size must be in"):
        _info(tokenizer_vocab_size=65)


def test_propose_ask_round_trip() -> None:
    ask = ProposeEntry("r", 2, (4, 5), 9, 3)
    assert ProposeEntry.from_pb(ask.to_pb()) == ask


def test_runtime_floors_match_the_generated_modules() -> None:
    """pyproject's grpcio / protobuf floors are the versions the generated modules check for."""
    text = (generate.ROOT / "pyproject.toml").read_text()
    grpc_floor = re.search(r'"grpcio>=([\d.]+)"', text)
    proto_floor = re.search(r'"protobuf>=([\d.]+),<(\d+)"', text)
    assert grpc_floor is not None and proto_floor is not None
    v1 = generate.OUT_ROOT / "specdec" / "v1"
    for path in v1.glob("*_pb2_grpc.py"):
        assert f"GRPC_GENERATED_VERSION = '{grpc_floor[1]}'" in path.read_text(), path
    for path in v1.glob("*_pb2.py"):
        gencode = re.search(r"PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", path.read_text())
        assert gencode is not None and ".".join(gencode.groups()) == proto_floor[1], path
        assert int(gencode[1]) + 1 == int(proto_floor[2]), path


def test_block_with_a_short_column_is_every_entrys_error() -> None:
    from target_service.servicer import block_error

    pb = _block("sparse")
    pb.steps.pop()
    with pytest.raises(ValueError, match="steps has 3 values") as info:
        DraftBlock.from_pb(pb)
    verdicts = block_error(pb, info.value)
    assert verdicts.request_ids == ["r0", "r1", "r2", "r3"] and verdicts.steps == [0, 0, 0, 0]
    assert sorted(verdicts.errors) == [0, 1, 2, 3]
    assert {e.reason for e in verdicts.errors.values()} == {ErrorReason.INVALID_ARGUMENT}


def test_parsed_block_locates_each_entrys_tokens_and_q_rows() -> None:
    forms = ["sparse", "none", "dense", "sparse", "dense", "sparse"]
    ks = [2, 0, 1, 3, 0, 1]
    proposals = [
        DraftProposal(f"r{i}", i, 5, tuple(range(10 * i, 10 * i + k)), _q(form, k))
        for i, (form, k) in enumerate(zip(forms, ks, strict=True))
    ]
    parsed = DraftBlock.from_pb(block_to_pb(proposals))
    assert parsed.q_forms == [Q_SPARSE, Q_NONE, Q_DENSE, Q_SPARSE, Q_DENSE, Q_SPARSE]
    assert parsed.token_starts == [0, 2, 2, 3, 6, 6, 7] and parsed.q_starts == [0, 0, 0, 2, 1, 5]
    assert parsed.sparse is not None and parsed.sparse.probs.shape == (6, 4)
    assert parsed.dense is not None and parsed.dense.probs.shape == (1, 11)
    assert parsed.draft_tokens([2, 3]) == [20, 30, 31, 32] and parsed.tokens(1) == []
    assert parsed.q_rows(Q_SPARSE, [0, 3, 5]) is parsed.sparse  # all of its form: no copy
    assert parsed.q_rows(Q_NONE, [1]) is None
    subset = parsed.q_rows(Q_SPARSE, [0, 5])
    assert isinstance(subset, SparseQ)
    assert torch.equal(subset.probs, parsed.sparse.probs[[0, 1, 5]])
    assert torch.equal(subset.token_ids, parsed.sparse.token_ids[[0, 1, 5]])
    for i, p in enumerate(proposals):
        back = proposal(parsed, i)
        assert (back.request_id, back.step, back.draft_token_ids) == (f"r{i}", i, p.draft_token_ids)
        if p.q is not None and back.q is not None:
            assert torch.equal(back.q.probs, p.q.probs)


def test_parsed_block_entry_errors() -> None:
    pb = _block("sparse")
    pb.committed_lengths[1] = 0
    pb.request_ids[1] = ""  # the id is named first, as DraftProposal checks it first
    pb.committed_lengths[3] = 0
    parsed = DraftBlock.from_pb(pb)
    assert parsed.errors == {
        1: "entries[1].request_id must be a non-empty string.",
        3: "entries[3].committed_length must be >= 1 and <= 2147483647, got 0.",
    }


def test_empty_block_parses() -> None:
    parsed = DraftBlock.from_pb(block_to_pb([]))
    assert len(parsed) == 0 and parsed.sparse is None and parsed.dense is None
    assert len(VerifyResponse.from_pb(VerifyResponse.pending([], []).to_pb())) == 0


def test_block_built_from_columns_is_checked() -> None:
    sparse = _q("sparse", 3)
    assert isinstance(sparse, SparseQ)
    block = DraftBlock.build(["a", "b"], [0, 1], [3, 4], [2, 1], [Q_SPARSE, Q_SPARSE],
                                [5, 6, 7], sparse=sparse)  # fmt: skip
    back = DraftBlock.from_pb(common_pb2.DraftBlock.FromString(block.to_pb().SerializeToString()))
    assert back.tokens(1) == [7] and back.sparse is not None
    assert torch.equal(back.sparse.probs, sparse.probs)
    with pytest.raises(ValueError, match="committed_lengths has 1 values for 2 request_ids"):
        DraftBlock.build(["a", "b"], [0, 1], [3], [2, 1], [Q_SPARSE] * 2, [5, 6, 7])
    with pytest.raises(ValueError, match="draft_token_ids has 2 ids; the entries' num_draft"):
        DraftBlock.build(["a", "b"], [0, 1], [3, 4], [2, 1], [Q_SPARSE] * 2, [5, 6])
    with pytest.raises(
        ValueError,
        match="sparse q has no tensor; the block has Q_FORM_SPARSE entries whose k_i sum to 3",
    ):
        DraftBlock.build(["a", "b"], [0, 1], [3, 4], [2, 1], [Q_SPARSE] * 2, [5, 6, 7])
    with pytest.raises(
        ValueError,
        match="sparse q has 3 rows; the block has Q_FORM_SPARSE entries whose k_i sum to 2",
    ):
        DraftBlock.build(["a", "b"], [0, 1], [3, 4], [2, 1], [Q_SPARSE, Q_NONE], [5, 6, 7],
                            sparse=sparse)  # fmt: skip
