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
    DenseQ,
    DraftProposal,
    ProposeAsk,
    SparseQ,
    VerifyResult,
    block_to_pb,
    proposals_from_pb,
)
from specdec.serving.messages import (
    Admission,
    ErrorReason,
    ModelInfo,
    RequestError,
    check_compatible,
)


def test_error_reason_mirrors_proto_enum() -> None:
    proto = {v.name.removeprefix("ERROR_REASON_"): v.number for v in
             common_pb2.ErrorReason.DESCRIPTOR.values}  # fmt: skip
    assert proto == {r.name: r.value for r in ErrorReason}


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


def _round_trip(proposals: list[DraftProposal]) -> list[DraftProposal | ValueError]:
    wire = block_to_pb(proposals).SerializeToString()
    return proposals_from_pb(common_pb2.DraftBlock.FromString(wire))


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
    assert all(e.q_form == common_pb2.Q_FORM_SPARSE for e in pb.entries)
    assert not pb.HasField("dense")
    rows = torch.cat([p.q.token_ids for p in proposals if isinstance(p.q, SparseQ)])
    assert pb.sparse.token_ids == pack(rows)


def test_narrower_sparse_rows_are_padded_to_the_block_width() -> None:
    narrow = SparseQ(torch.tensor([[5, 6]], dtype=torch.int32), torch.tensor([[0.5, 0.5]]))
    back = _round_trip([DraftProposal("a", 0, 3, (5,), narrow), DraftProposal("b", 0, 3, (1,),
                        _q("sparse", 1))])  # fmt: skip
    q = back[0].q if isinstance(back[0], DraftProposal) else None
    assert isinstance(q, SparseQ)
    assert q.token_ids.tolist() == [[5, 6, -1, -1]] and q.probs.tolist() == [[0.5, 0.5, 0, 0]]


def _block(kind: str) -> common_pb2.DraftBlock:
    return block_to_pb([DraftProposal(f"r{i}", 0, 3, (1, 2), _q(kind, 2)) for i in range(4)])


@pytest.mark.parametrize(
    ("kind", "mutate", "match"),
    [
        ("dense", lambda pb: setattr(pb.dense, "probs", pb.dense.probs[:-4]),
         r"dense\.probs has 348 bytes; expected 352 \(8 x 11 little-endian float32\)"),
        ("dense", lambda pb: setattr(pb.dense, "vocab_size", 0), r"dense\.vocab_size must be > 0"),
        ("dense", lambda pb: pb.ClearField("dense"),
         r"entries\[0\]\.q_form is DENSE but the block has no dense"),
        ("sparse", lambda pb: setattr(pb.sparse, "token_ids", b"\0" * 12),
         r"sparse\.token_ids has 12 bytes; expected 128"),
        ("sparse", lambda pb: setattr(pb.sparse, "probs", b""), r"sparse\.probs has 0 bytes"),
        ("sparse", lambda pb: setattr(pb.sparse, "support_size", 0),
         r"sparse\.support_size must be > 0"),
        ("sparse", lambda pb: pb.entries[3].draft_token_ids.append(7),
         r"sparse\.token_ids has 128 bytes; expected 144 \(9 x 4 .*\)\. Rows: 9, the draft "
         r"tokens of the Q_FORM_SPARSE entries\."),
        ("none", lambda pb: setattr(pb.entries[2], "q_form", common_pb2.Q_FORM_SPARSE),
         r"entries\[2\]\.q_form is SPARSE but the block has no sparse"),
        ("none", lambda pb: setattr(pb.entries[1], "q_form", 5),
         r"entries\[1\]\.q_form is 5; expected Q_FORM_NONE"),
    ],
)  # fmt: skip
def test_block_shape_errors_name_the_field(kind, mutate, match) -> None:  # type: ignore[no-untyped-def]
    pb = _block(kind)
    proposals_from_pb(pb)  # well-formed before the mutation
    mutate(pb)
    with pytest.raises(ValueError, match=match):
        proposals_from_pb(pb)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda e: setattr(e, "committed_length", 0),
         r"^entries\[2\]\.committed_length must be >= 1"),
        (lambda e: setattr(e, "request_id", ""),
         r"^entries\[2\]\.request_id must be a non-empty"),
    ],
)  # fmt: skip
def test_malformed_entry_is_only_that_entrys_error(mutate, match) -> None:  # type: ignore[no-untyped-def]
    pb = _block("sparse")
    mutate(pb.entries[2])
    parsed = proposals_from_pb(pb)
    assert [type(p) for p in parsed] == [DraftProposal, DraftProposal, ValueError, DraftProposal]
    assert re.match(match, str(parsed[2]))
    last = parsed[3]
    assert isinstance(last, DraftProposal) and isinstance(last.q, SparseQ)
    assert last.q.token_ids.data_ptr() != 0 and last.request_id == "r3"


def test_q_rows_must_match_draft_tokens() -> None:
    with pytest.raises(ValueError, match="q has 3 rows for 2 draft tokens"):
        DraftProposal("a", 0, 3, (1, 2), _q("dense", 3))


def test_verify_result_round_trip_with_error() -> None:
    ok = VerifyResult("a", 3, (5, 6, 9), (True, True, False), 40)
    pb = target_pb2.VerifyResult.FromString(ok.to_pb().SerializeToString())
    assert pb.num_accepted == 2 and VerifyResult.from_pb(pb) == ok
    err = RequestError(ErrorReason.STALE_STEP, grpc.StatusCode.FAILED_PRECONDITION, "old step")
    bad = VerifyResult("b", 1, error=err)
    assert VerifyResult.from_pb(bad.to_pb()) == bad


def test_admission_round_trip_and_sampling_defaults() -> None:
    adm = Admission("r", (1, 2, 3), SamplingParams(0.7, 5, 0.9, 2**62), first_step=4)
    assert Admission.from_pb(adm.to_pb()) == adm
    bare = Admission.from_pb(common_pb2.AdmitRequest(request_id="r", prompt_token_ids=[1]))
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
        Admission.from_pb(pb)


def test_admission_checks() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must hold"):
        Admission("r", ())
    with pytest.raises(ValueError, match=r"prompt_token_ids holds 99, outside .*\[0, 50\)"):
        Admission("r", (1, 99)).check_vocab(50)


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
    ask = ProposeAsk("r", 2, (4, 5), 9, 3)
    assert ProposeAsk.from_pb(ask.to_pb()) == ask


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
