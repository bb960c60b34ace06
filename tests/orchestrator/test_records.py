"""RequestRecord: verdicts applied exactly once and in order, stops and lengths cut the output at
the right token, counts and responses agree with what was applied."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.core.detokenizer import IncrementalDetokenizer
from orchestrator.core.pair import StepEvent
from orchestrator.core.records import (
    FinishReason,
    RequestRecord,
    StepGapError,
    StopCriteria,
)
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.messages import ErrorReason, RequestError
from tests.orchestrator.bpe import EOS, text_tokenizer, train_bpe

PROMPT = (5, 6, 7)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


NO_LIMIT = StopCriteria()


def _record(criteria: StopCriteria = NO_LIMIT, *, text: bool = False, **kw) -> RequestRecord:
    detok = IncrementalDetokenizer(text_tokenizer(), stop=criteria.stop) if text else None
    kw.setdefault("proposer", "draft")
    kw.setdefault("num_draft_tokens", 3)
    return RequestRecord("r", PROMPT, criteria, detokenizer=detok, **kw)


def _step(step: int, tokens: tuple[int, ...], k: int | None = None) -> StepEvent:
    k = len(tokens) - 1 if k is None else k
    return StepEvent("r", step, tokens, k, len(tokens) - 1)


def test_each_step_is_applied_once_and_a_gap_is_an_error() -> None:
    rec = _record()
    assert rec.apply(_step(0, (1, 2))) is not None
    assert rec.apply(_step(0, (1, 2))) is None  # duplicate
    assert rec.apply(_step(1, (3,))) is not None
    assert rec.apply(_step(0, (9, 9))) is None  # stale
    assert rec.committed == [1, 2, 3]
    with pytest.raises(StepGapError, match="expected the verdict of step 2, got step 4"):
        rec.apply(_step(4, (8,)))
    assert rec.readmission() == ((*PROMPT, 1, 2, 3), 2)


def test_readmission_starts_from_the_first_step() -> None:
    rec = _record(first_step=7)
    assert rec.readmission() == (PROMPT, 7)
    assert rec.apply(_step(6, (1,))) is None
    assert rec.apply(_step(7, (1,))) is not None
    assert rec.readmission() == ((*PROMPT, 1), 8)


def test_max_tokens_keeps_exactly_that_many_tokens_and_drops_later_steps() -> None:
    rec = _record(StopCriteria(max_tokens=4))
    first = rec.apply(_step(0, (1, 2)))
    last = rec.apply(_step(1, (3, 4, 5, 6)))
    assert first is not None and not first.finished
    assert last is not None and last.finished and last.token_ids == (3, 4)
    assert rec.finish_reason == FinishReason.LENGTH
    assert rec.committed == [1, 2, 3, 4]
    assert rec.apply(_step(2, (7,))) is None  # the hub ran on until the release landed
    final = rec.response(last)
    assert final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 4 and final.usage.prompt_tokens == 3


def test_max_seq_len_ends_the_request() -> None:
    rec = _record(StopCriteria(max_seq_len=len(PROMPT) + 2))
    delta = rec.apply(_step(0, (1, 2, 3)))
    assert delta is not None and delta.token_ids == (1, 2)
    assert rec.finish_reason == FinishReason.MAX_SEQ_LEN


def test_a_stop_token_ends_the_request_with_its_id_but_not_its_text() -> None:
    tok = text_tokenizer()
    eos = train_bpe().token_to_id(EOS)
    assert eos is not None
    stop_id = tok.encode("!")[0]
    ids = tok.encode("naïve café")
    rec = _record(StopCriteria(stop_token_ids=frozenset({stop_id, eos})), text=True)
    delta = rec.apply(_step(0, (*ids, stop_id, *tok.encode(" after"))))
    assert delta is not None and delta.finished
    assert delta.token_ids == (*ids, stop_id)
    assert rec.text == delta.text == "naïve café"
    final = rec.response(delta)
    assert final.finish_reason == generate_pb2.FINISH_REASON_STOP_TOKEN
    assert final.WhichOneof("stop_reason") == "stop_token_id" and final.stop_token_id == stop_id


def test_a_stop_string_across_steps_cuts_text_and_tokens() -> None:
    tok = text_tokenizer()
    text = "Emoji: 😀 and then stop here and more text follows."
    ids = tuple(tok.encode(text))
    completing = next(i for i in range(len(ids)) if "stop here" in tok.decode(ids[: i + 1]))
    rec = _record(StopCriteria(stop=("stop here",)), text=True)
    deltas = []
    for step, start in enumerate(range(0, len(ids), 3)):
        delta = rec.apply(_step(step, ids[start : start + 3]))
        if delta is None:
            break
        deltas.append(delta)
    assert "".join(d.text for d in deltas) == "Emoji: 😀 and then "
    assert sum((d.token_ids for d in deltas), ()) == ids[: completing + 1]
    assert rec.finish_reason == FinishReason.STOP_STRING
    final = rec.response(deltas[-1])
    assert final.finish_reason == generate_pb2.FINISH_REASON_STOP_STRING
    assert final.stop_string == "stop here"


def test_streamed_responses_add_up_to_the_complete_response() -> None:
    tok = text_tokenizer()
    ids = tuple(tok.encode("中文分词测试，日本語のテキスト 👍🏽 done"))
    rec = _record(StopCriteria(max_tokens=len(ids)), text=True)
    streamed = []
    for step, start in enumerate(range(0, len(ids), 2)):
        delta = rec.apply(_step(step, ids[start : start + 2], k=4))
        assert delta is not None
        streamed.append(rec.response(delta))
    whole = rec.complete_response()
    assert "".join(r.text for r in streamed) == whole.text == tok.decode(ids)
    assert [t for r in streamed for t in r.token_ids] == list(whole.token_ids) == list(ids)
    assert [s for r in streamed for s in r.steps] == list(whole.steps)
    assert not any(r.HasField("usage") for r in streamed[:-1])
    assert streamed[-1].usage == whole.usage


def test_acceptance_counts_per_request_and_per_position() -> None:
    rec = _record()
    rec.apply(StepEvent("r", 0, (1, 2, 3), 3, 2))  # positions 0, 1 accepted
    rec.apply(StepEvent("r", 1, (4,), 3, 0))  # all rejected
    rec.apply(StepEvent("r", 2, (5,), 0, 0))  # no drafts: not a draft step
    rec.apply(StepEvent("r", 3, (6, 7, 8, 9, 10), 4, 4))
    usage = rec.usage()
    assert (usage.num_steps, usage.num_drafts) == (4, 3)
    assert (usage.num_draft_tokens, usage.num_accepted_tokens) == (10, 6)
    assert list(usage.num_accepted_tokens_per_pos) == [2, 2, 1, 1]
    assert usage.proposer == generate_pb2.PROPOSER_DRAFT and usage.num_draft_tokens_per_step == 3


def test_an_error_verdict_ends_the_request() -> None:
    rec = _record()
    rec.apply(_step(0, (1,)))
    error = RequestError(ErrorReason.CAPACITY, grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    delta = rec.apply(StepEvent("r", 1, (), 0, 0, error))
    assert delta is not None and delta.finished and delta.error == error
    assert rec.done and rec.error == error
    assert rec.apply(_step(2, (3,))) is None


def test_cancel_flushes_held_text_and_timing_uses_the_clock() -> None:
    tok = text_tokenizer()
    clock = Clock()
    rec = _record(StopCriteria(stop=("lazy cat",)), text=True, clock=clock)
    clock.now += 0.5
    rec.mark_sent()
    clock.now += 0.125
    rec.mark_admitted(prefill_s=0.0625)
    rec.mark_sent()  # a re-admission changes neither
    rec.mark_admitted(prefill_s=1.0)
    clock.now += 0.125
    delta = rec.apply(_step(0, tuple(tok.encode("over the lazy"))))
    assert delta is not None and delta.text == "over the "
    clock.now += 1.0
    final = rec.finish()
    assert final is not None and final.text == "lazy" and rec.text == "over the lazy"
    assert rec.finish() is None
    response = rec.response(final)
    assert response.finish_reason == generate_pb2.FINISH_REASON_CANCELLED
    assert response.timing.queue_s == pytest.approx(0.5)
    assert response.timing.admission_s == pytest.approx(0.625)
    assert response.timing.prefill_s == pytest.approx(0.0625)
    assert response.timing.time_to_first_token_s == pytest.approx(0.75)
    assert response.timing.e2e_s == pytest.approx(1.75)


def test_finish_reason_mirrors_the_proto() -> None:
    proto = {
        v.name.removeprefix("FINISH_REASON_"): v.number
        for v in generate_pb2.FinishReason.DESCRIPTOR.values
        if v.number != 0
    }
    assert proto == {r.name: r.value for r in FinishReason}


def _request(**kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2]), **kw)


def _criteria(request: generate_pb2.GenerateRequest, prompt_len: int = 10) -> StopCriteria:
    return StopCriteria.from_pb(
        request, prompt_len=prompt_len, max_seq_len=64, vocab_size=100, eos_token_ids=(2,)
    )


def test_stop_criteria_from_a_request() -> None:
    c = _criteria(_request(max_tokens=54, stop=["x"], stop_token_ids=[7]))
    assert (c.max_tokens, c.stop_token_ids, c.stop, c.max_seq_len) == (54, {2, 7}, ("x",), 64)
    assert _criteria(_request(ignore_eos=True)).stop_token_ids == frozenset()
    assert _criteria(_request()).max_tokens is None
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 54\].*got 55"):
        _criteria(_request(max_tokens=55))
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 54\].*got 0"):
        _criteria(_request(max_tokens=0))
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] must be in \[0, 100\), got 100"):
        _criteria(_request(stop_token_ids=[1, 100]))
    with pytest.raises(ValueError, match=r"stop\[1\] must be 1 to 256 characters"):
        _criteria(_request(stop=["a", ""]))
    with pytest.raises(ValueError, match="stop holds at most 16 strings, got 17"):
        _criteria(_request(stop=["a"] * 17))
    with pytest.raises(ValueError, match="leaves no room"):
        _criteria(_request(), prompt_len=64)


def test_stop_token_ids_at_their_maximum_count_only_the_clients() -> None:
    """64 client ids are allowed with the model's EOS id added (it once counted: "got 65")."""
    ids = [i for i in range(100) if i != 2][:64]
    c = _criteria(_request(stop_token_ids=ids))
    assert c.stop_token_ids == frozenset([*ids, 2])
    with pytest.raises(ValueError, match="stop_token_ids holds at most 64 ids, got 65"):
        _criteria(_request(stop_token_ids=[*ids, 99]))


def test_record_refuses_an_empty_prompt_or_unknown_proposer() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        RequestRecord("r", (), StopCriteria())
    with pytest.raises(ValueError, match="proposer must be one of"):
        RequestRecord("r", PROMPT, StopCriteria(), proposer="eagle")
