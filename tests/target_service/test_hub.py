"""The step loop with the target as hub (`TargetService.Serve`), over real gRPC with tiny
models: greedy output equals target-only greedy decoding for every proposer with requests
joining at different steps; releases and the stream's end free both services; the draft dying
mid-generation changes no output and speculation resumes after set_draft; a failed step fails
only its requests; one stream at a time."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from bench.local import LocalPair
from orchestrator.core.pair import Admitted, StepReport
from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.pb.specdec.v1 import generate_pb2
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.client import make_channel
from specdec.serving.messages import AdmitRequest, ErrorReason, RequestError
from tests.draft_service.models import (
    TOKENIZER_VOCAB,
    greedy_reference,
)
from tests.target_service.hub_helpers import GREEDY, Driver, hub_services


@pytest.fixture(scope="module")
def svc(checkpoints: tuple[Path, Path]) -> Iterator[LocalPair]:
    with hub_services(*checkpoints) as s:
        yield s


def _prompt(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(2, TOKENIZER_VOCAB, (4 + seed % 4,), generator=gen).tolist()
    return head + head[:2] + head  # repeats, so prompt lookup finds matches


def _check_outputs(driver: Driver, reference: ModelRunner) -> None:
    for rid, rec in driver.records.items():
        assert rec.error is None, f"{rid}: {rec.error}"
        assert len(rec.generated) >= driver.max_new_tokens, rid
        want = greedy_reference(reference, rec.prompt, len(rec.generated))
        assert rec.generated == want, f"request {rid} ({rec.proposer})"


def _waited_for_admission(steps: list[int], k: int, rid: str) -> int:
    """How many of a draft request's first steps (after the admission's own) ran at k = 0: a
    step waits once for the draft's admission, and on a loaded machine the admission can
    outlast it, by design. Asserts that every step after those drafted k, and that some did."""
    waited = steps.index(k) if k in steps else len(steps)
    assert steps[:waited] == [0] * waited, (rid, steps)
    assert steps[waited:] == [k] * (len(steps) - waited) and waited < len(steps), (rid, steps)
    return waited


def _held(svc: LocalPair, rid: str) -> bool:
    try:
        svc.target_engine.tokens(rid)
    except KeyError:
        return False
    return True


def test_greedy_equals_target_only_for_every_proposer(
    svc: LocalPair, reference: ModelRunner
) -> None:
    driver = Driver(svc.target_address, max_new_tokens=14)
    driver.admit("draft4", _prompt(0), "draft", 4)
    driver.admit("ngram3", _prompt(1), "ngram", 3)
    driver.admit("off", _prompt(2), "off", 4)
    later = {  # joins after this many step reports (continuous batching)
        2: [("draft2", _prompt(3), "draft", 2), ("ngram4", _prompt(4), "ngram", 4)],
        4: [("draft0", _prompt(5), "draft", 0), ("draft6", _prompt(6), "draft", 6)],
    }

    def on_step(n: int) -> None:
        for rid, prompt, proposer, k in later.get(n, []):
            driver.admit(rid, prompt, proposer, k)  # type: ignore[arg-type]

    driver.run(on_step)
    driver.client.close()
    _check_outputs(driver, reference)
    recs = driver.records
    for rid, k in (("draft4", 4), ("draft2", 2), ("draft6", 6)):  # once drafted, never demoted
        first, *steps = [e.num_draft_tokens for e in recs[rid].events]
        assert first == 0, "the first token comes from the admission's own forward"
        assert _waited_for_admission(steps, k, rid) <= 3, (rid, steps)
    assert sum(e.num_accepted for rid in ("draft4", "draft2", "draft6")
               for e in recs[rid].events) > 0, "no draft was ever accepted"  # fmt: skip
    assert sum(e.num_draft_tokens for rid in ("ngram3", "ngram4") for e in recs[rid].events) > 0
    for rid in ("off", "draft0"):
        assert all(e.num_draft_tokens == 0 for e in recs[rid].events), rid
    assert max(len(r.events) for r in driver.reports) >= 5, "requests never shared a step"
    assert all(r.draft_up and r.step_s > 0 and r.verify_s > 0 for r in driver.reports)
    assert any(r.draft_s > 0 for r in driver.reports)


def test_release_and_stream_end_free_both_services(svc: LocalPair) -> None:
    driver = Driver(svc.target_address, max_new_tokens=1000)
    rids = ["a", "b", "c"]
    for i, rid in enumerate(rids):
        driver.admit(rid, _prompt(10 + i), "draft", 3)
    driver.until(lambda: len(driver.reports) >= 2)
    assert all(_held(svc, rid) for rid in rids)
    driver.client.release(["b"])
    driver.records["b"].done = True
    seen = len(driver.reports)
    driver.until(lambda: any("b" not in {e.request_id for e in r.events}
                             for r in driver.reports[seen:]))  # fmt: skip
    assert not _held(svc, "b")
    assert svc.draft_engine.release(["b"]) == 0, "the draft still held b"
    assert _held(svc, "a") and _held(svc, "c")
    assert driver.client.num_running == 2
    driver.client.close()
    assert not any(_held(svc, rid) for rid in rids)
    assert svc.draft_engine.release(rids) == 0, "the draft still held requests"


def test_draft_death_changes_no_output_and_speculation_resumes(
    checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    with hub_services(*checkpoints) as own:
        driver = Driver(own.target_address, max_new_tokens=40)
        for i in range(3):
            driver.admit(f"r{i}", _prompt(20 + i), "draft", 4)
        driver.admit("ng", _prompt(23), "ngram", 2)
        behind: list[str] = []

        def on_step(n: int) -> None:
            if n == 2:
                own.draft.stop(0)
            if n == 5:
                address = own.restart_draft()
                records = {rid: (tuple(r.tokens), r.next_step)
                           for rid, r in driver.records.items()}  # fmt: skip
                driver.client.set_draft(address, records)
                behind.extend(rid for rid, (tokens, _) in records.items()
                              if len(tokens) < len(own.target_engine.tokens(rid)))  # fmt: skip

        driver.run(on_step)
        driver.client.close()
        _check_outputs(driver, reference)
        assert behind, "no record was behind the hub: the top-up was not exercised"
        assert driver.draft_events == ["down", "up"]
        reports = driver.reports
        down = next(i for i, r in enumerate(reports) if not r.draft_up)
        up = next(i for i, r in enumerate(reports) if i > down and r.draft_up)
        for r in reports[down:up]:  # k = 0 while down, prompt lookup goes on
            assert all(e.num_draft_tokens == 0 for e in r.events if e.request_id != "ng")
        after = [e for r in reports[up:] for e in r.events if e.request_id.startswith("r")]
        assert any(e.num_draft_tokens > 0 for e in after), "speculation did not resume"
        assert not any(own.draft_engine.release([rid]) for rid in driver.records)


def test_stalled_draft_runs_target_only_then_resumes_by_itself(
    checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    """The draft's engine held (its Propose, Admit and Release wait) for a few steps: past the
    deadline the hub runs the draft requests at k = 0 and says why; once the engine is free the
    hub resynchronises the draft with no set_draft, speculation resumes, and the output is
    target-only greedy. The late answer is never applied: each verdict comes once, in order."""
    with hub_services(*checkpoints) as own:
        driver = Driver(own.target_address, max_new_tokens=40)
        for i in range(3):
            driver.admit(f"s{i}", _prompt(40 + i), "draft", 3)
        engine_lock = own.draft_engine._lock
        held_at: list[int] = []

        def on_step(n: int) -> None:
            if n == 3:
                engine_lock.acquire()
                held_at.append(n)
            if n == 5:  # admitted while the draft is stalled: it gets there on the resync
                driver.admit("joined", _prompt(43), "draft", 3)
            if n == 10:
                engine_lock.release()
                held_at.append(n)

        driver.run(on_step)
        driver.client.close()
        _check_outputs(driver, reference)
        assert held_at == [3, 10] and driver.draft_events == [], "stalled, never down"
        reports = driver.reports
        assert all(r.draft_up for r in reports)
        stalled = [i for i, r in enumerate(reports) if r.fallback == "deadline"]
        assert stalled and stalled[0] >= 3, [r.fallback for r in reports]  # the hub runs ahead
        assert stalled == list(range(stalled[0], stalled[-1] + 1)), "one stall, one resync"
        for i in stalled:
            assert reports[i].num_fallback_requests in (3, 4)  # 4 once "joined" is in
            assert all(e.num_draft_tokens == 0 for e in reports[i].events)
        after = [e for r in reports[stalled[-1] + 1 :] for e in r.events]
        assert any(e.num_draft_tokens > 0 for e in after), "speculation did not resume"
        assert any(e.num_draft_tokens > 0 for e in after if e.request_id == "joined")
        assert not any(r.fallback for r in reports[stalled[-1] + 1 :])
        assert not any(own.draft_engine.release([rid]) for rid in driver.records)


def test_failed_step_fails_only_its_requests(
    svc: LocalPair, reference: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = svc.target_engine
    verify = engine.verify_timed
    calls = []

    def fail_third(block: object, launched: object = None) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return verify(block, launched)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "verify_timed", fail_third)
    driver = Driver(svc.target_address, max_new_tokens=8)
    driver.admit("x", _prompt(30), "draft", 3)
    driver.admit("y", _prompt(31), "ngram", 3)
    driver.until(lambda: all(r.done for r in driver.records.values()))
    for rid in ("x", "y"):
        error = driver.records[rid].error
        assert error is not None and error.reason == ErrorReason.STEP_FAILED, rid
        assert error.code == grpc.StatusCode.INTERNAL and "injected" in error.message
        assert not _held(svc, rid)
    driver.admit("z", _prompt(32), "draft", 3)  # the loop goes on
    driver.run()
    driver.client.close()
    assert driver.records["z"].generated[:8] == greedy_reference(reference, _prompt(32), 8)


def test_failed_draft_admission_runs_the_request_at_k0(
    svc: LocalPair, reference: ModelRunner
) -> None:
    prompt = _prompt(50)
    svc.draft_engine.admit(AdmitRequest("dup", tuple(prompt), GREEDY))  # the draft refuses "dup"
    try:
        driver = Driver(svc.target_address, max_new_tokens=6)
        driver.admit("dup", prompt, "draft", 3)
        driver.run()
        driver.client.close()
    finally:
        assert svc.draft_engine.release(["dup"]) == 1
    _check_outputs(driver, reference)
    admitted = driver.records["dup"].admitted
    assert isinstance(admitted, Admitted), "a draft failure failed the request"
    assert admitted.committed_length == len(prompt) + 1 and admitted.prefill_s > 0
    assert admitted.first is not None and admitted.first.step == 0
    assert all(e.num_draft_tokens == 0 for e in driver.records["dup"].events)


def test_failed_target_admission_is_undone_on_the_draft(svc: LocalPair) -> None:
    prompt = _prompt(51)
    svc.target_engine.admit(AdmitRequest("twice", tuple(prompt), GREEDY))  # the target refuses
    try:
        driver = Driver(svc.target_address, max_new_tokens=6)
        driver.admit("twice", prompt, "draft", 3)
        driver.until(lambda: driver.records["twice"].admitted is not None)
        driver.client.close()
    finally:
        assert svc.target_engine.release(["twice"]) == 1
    result = driver.records["twice"].admitted
    assert isinstance(result, RequestError) and "already admitted" in result.message
    assert svc.draft_engine.release(["twice"]) == 0, "the draft kept the refused request"


def test_admission_errors_are_answered(svc: LocalPair) -> None:
    driver = Driver(svc.target_address, max_new_tokens=4)
    driver.admit("bad", [1, TOKENIZER_VOCAB + 3], "ngram", 2)
    driver.until(lambda: driver.records["bad"].admitted is not None)
    result = driver.records["bad"].admitted
    assert isinstance(result, RequestError) and result.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in result.message
    driver.client.close()
    # PROPOSER_DEFAULT is the orchestrator's to resolve: the hub refuses it.
    with make_channel(svc.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        admit = target_pb2.ServeAdmit(
            request=common_pb2.AdmitRequest(request_id="d", prompt_token_ids=[1, 2]),
            proposer=generate_pb2.PROPOSER_DEFAULT,
        )
        events = stub.Serve(iter([target_pb2.ServeControl(admit=admit)]), timeout=30)
        kinds = [(e.WhichOneof("event"), e) for e in events]
    assert [k for k, _ in kinds] == ["started", "admitted"]
    answer = kinds[1][1].admitted
    assert (
        answer.error.reason == ErrorReason.INVALID_ARGUMENT and "PROPOSER_" in answer.error.message
    )


def test_cancelled_stream_releases_its_requests(svc: LocalPair) -> None:
    admit = target_pb2.ServeAdmit(
        request=common_pb2.AdmitRequest(request_id="cut", prompt_token_ids=_prompt(60)),
        proposer=generate_pb2.PROPOSER_DRAFT,
        num_draft_tokens=2,
    )
    controls: queue.SimpleQueue[target_pb2.ServeControl] = queue.SimpleQueue()
    controls.put(target_pb2.ServeControl(admit=admit))
    with make_channel(svc.target_address) as channel:
        call = target_pb2_grpc.TargetServiceStub(channel).Serve(iter(controls.get, None))
        kinds = [next(call).WhichOneof("event") for _ in range(3)]
        assert kinds == ["started", "admitted", "step"]
        assert _held(svc, "cut")
        call.cancel()  # the orchestrator went away without closing
        deadline = time.monotonic() + 10
        while _held(svc, "cut") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not _held(svc, "cut")
    assert svc.draft_engine.release(["cut"]) == 0, "the draft still held the request"
    deadline = time.monotonic() + 10
    while True:  # the hub frees its gate just after releasing (closing the draft link)
        try:
            Driver(svc.target_address, max_new_tokens=1).client.close()
            break
        except ConnectionError:
            assert time.monotonic() < deadline, "the cancelled stream still holds the hub"
            time.sleep(0.05)


def test_second_serve_stream_is_refused(svc: LocalPair) -> None:
    driver = Driver(svc.target_address, max_new_tokens=4)
    with make_channel(svc.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.Serve(iter(()), timeout=30)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already open" in info.value.details()
    driver.client.close()
    again = Driver(svc.target_address, max_new_tokens=4)  # free again once closed
    again.client.close()


def test_step_report_timings_are_consistent(svc: LocalPair) -> None:
    driver = Driver(svc.target_address, max_new_tokens=6)
    driver.admit("t", _prompt(40), "draft", 3)
    driver.run()
    driver.client.close()
    for r in driver.reports:
        assert isinstance(r, StepReport)
        parts = r.draft_s + r.verify_s + r.sampler_s
        assert 0 < parts <= r.step_s, r


def test_the_hub_stops_stepping_a_request_at_its_max_length(
    svc: LocalPair, reference: ModelRunner
) -> None:
    """No step past the last token the orchestrator keeps: the last step drafts only what fits,
    and the request then waits for its release without costing a step."""
    prompt = _prompt(61)
    driver = Driver(svc.target_address, max_new_tokens=1000)  # never releases it
    try:
        driver.admit("capped", prompt, "draft", 4, max_length=len(prompt) + 6)
        driver.until(lambda: len(driver.records["capped"].generated) >= 6)
        steps = len(driver.reports)
        time.sleep(0.5)
        while driver.pending():
            driver.handle(1.0)
        assert len(driver.reports) == steps, "the hub stepped a request past its max_length"
        rec = driver.records["capped"]
        assert rec.generated == greedy_reference(reference, prompt, 6), "not one token past it"
        assert _held(svc, "capped"), "it waits for its release"
    finally:
        driver.client.close()


def test_a_seeded_output_does_not_depend_on_a_retry(
    svc: LocalPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed step, then the request admitted again from its record: the same tokens as a
    run without the failure (the re-admission is prefilled only, and its next step is verified
    at its own k)."""
    sampling, prompt, n = SamplingParams(1.0, seed=11), _prompt(71), 12
    clean = Driver(svc.target_address, max_new_tokens=n)
    clean.admit("seeded", prompt, "draft", 3, sampling=sampling)
    clean.run()
    clean.client.close()
    verify, calls = svc.target_engine.verify_timed, []

    def fail_third(block: object, launched: object = None) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return verify(block, launched)  # type: ignore[arg-type]

    monkeypatch.setattr(svc.target_engine, "verify_timed", fail_third)
    retried = Driver(svc.target_address, max_new_tokens=n)
    retried.admit("seeded", prompt, "draft", 3, sampling=sampling)
    retried.until(lambda: retried.records["seeded"].done)
    rec = retried.records["seeded"]
    assert rec.error is not None and rec.error.reason == ErrorReason.STEP_FAILED
    retried.readmit("seeded", 3, sampling)
    retried.run()
    retried.client.close()
    assert rec.generated[:n] == clean.records["seeded"].generated[:n]
    assert len(calls) > 3, "the request ran on after its retry"


def test_each_verdict_names_the_proposer_that_drafted_it(svc: LocalPair) -> None:
    """A request switched from the draft model to "off" mid-generation: its verdicts name
    "draft" up to the step the switch reached the hub and "off" from then on, and every verdict
    that verified drafts names the proposer that made them."""
    driver = Driver(svc.target_address, max_new_tokens=40)
    driver.admit("d", _prompt(0), "draft", 3)
    driver.admit("n", _prompt(1), "ngram", 3)
    sent: list[int] = []

    def on_step(n: int) -> None:
        # switched once two of d's steps drafted: on a loaded machine its draft admission can
        # take a few steps, which run at k = 0 (CI saw four)
        drafted = sum(e.num_draft_tokens > 0 for e in driver.records["d"].events[1:])
        if drafted >= 2 and not sent:
            driver.client.set_speculation("d", "off", 0)
            sent.append(n)

    driver.run(on_step)
    driver.client.close()
    assert sent, "d never drafted twice"
    d = [(e.proposer, e.num_draft_tokens) for e in driver.records["d"].events[1:]]
    switched = next((i for i, (p, _) in enumerate(d) if p == "off"), None)
    assert switched is not None, d
    assert all(p == "draft" for p, _ in d[:switched]), d
    assert switched - _waited_for_admission([k for _, k in d[:switched]], 3, "d") >= 2, d
    assert d[switched:] == [("off", 0)] * (len(d) - switched), d
    assert {e.proposer for e in driver.records["n"].events[1:]} == {"ngram"}
