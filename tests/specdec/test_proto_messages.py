"""Round trips of the specdec.v1 domain objects, wire format and shape validation."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import grpc
import pytest
import torch

from specdec.pb import common_pb2, generate, target_pb2
from specdec.sampling_params import SamplingParams
from specdec.serving.arrays import pack, unpack
from specdec.serving.blocks import DenseQ, DraftProposal, ProposeAsk, SparseQ, VerifyResult
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


@pytest.mark.parametrize("kind", ["dense", "sparse", "none"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_draft_proposal_round_trip(kind: str, k: int) -> None:
    q = _q(kind, k)
    proposal = DraftProposal("req-1", 7, 12, tuple(range(k)), q)
    pb = common_pb2.DraftEntry.FromString(proposal.to_pb().SerializeToString())
    back = DraftProposal.from_pb(pb)
    assert (back.request_id, back.step, back.committed_length) == ("req-1", 7, 12)
    assert back.draft_token_ids == tuple(range(k))
    assert type(back.q) is type(q)
    if q is not None and back.q is not None:
        assert torch.equal(back.q.probs, q.probs)
    if isinstance(q, SparseQ) and isinstance(back.q, SparseQ):
        assert torch.equal(back.q.token_ids, q.token_ids)


def test_dense_probs_length_must_be_k_times_vocab_times_4() -> None:
    pb = DraftProposal("a", 0, 3, (1, 2), _q("dense", 2)).to_pb()
    pb.dense.probs = pb.dense.probs[:-4]
    with pytest.raises(ValueError, match=r"entries\[0\]\.dense\.probs has 84 bytes; expected 88"):
        DraftProposal.from_pb(pb, "entries[0]")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda pb: setattr(pb.sparse, "token_ids", b"\0" * 12), r"sparse\.token_ids has 12"),
        (lambda pb: setattr(pb.sparse, "probs", b""), r"sparse\.probs has 0 bytes"),
        (lambda pb: setattr(pb.sparse, "support_size", 0), r"sparse\.support_size must be > 0"),
        (lambda pb: setattr(pb, "committed_length", 0), r"committed_length must be >= 1"),
        (lambda pb: setattr(pb, "request_id", ""), r"request_id must be a non-empty"),
    ],
)
def test_sparse_and_entry_validation_names_field(mutate, match) -> None:  # type: ignore[no-untyped-def]
    pb = DraftProposal("a", 0, 3, (1, 2), _q("sparse", 2)).to_pb()
    mutate(pb)
    with pytest.raises(ValueError, match=match):
        DraftProposal.from_pb(pb, "entries[0]")


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
