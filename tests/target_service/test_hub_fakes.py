"""The hub's step loop over fakes (`tests.target_service.hub_fakes`): each case is set up
exactly, in order, with no model, no network and no sleep. What the real services add (gRPC,
models, the sampler) is tested over loopback in test_hub.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from specdec.pb import target_pb2
from specdec.serving.blocks import DraftBlock
from specdec.serving.verdicts import VerifyResponse
from target_service.hub_draft import PUSH_EXPLORE_EVERY, PUSH_EXPLORE_STEPS, PushChoice
from target_service.speculation import KChooser
from tests.target_service.hub_fakes import FAILED, FakeLink, HubRun, greedy

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture
def runs() -> Iterator[list[HubRun]]:
    """Each test's hub runs, stopped at its end; no check inside a fake may have failed."""
    FAILED.clear()
    started: list[HubRun] = []
    yield started
    for run in started:
        run.stop()
    assert not FAILED


def _start(runs: list[HubRun], draft: FakeLink | None, **config: object) -> HubRun:
    runs.append(HubRun(draft, **config))
    return runs[-1]


def _sync(run: HubRun) -> None:
    """Returns once the hub has applied the controls sent before: a request finished at its
    admission is admitted after them (controls apply in order), and adds no step."""
    run.admit("sync", PROMPT, "off", max_length=len(PROMPT) + 1)


def test_every_proposer_commits_the_models_greedy_tokens(runs: list[HubRun]) -> None:
    link = FakeLink("draft:1", wrong_at={9, 12, 13, 20}, ahead_hits=1)
    run = _start(runs, link)
    n = 24
    for rid, proposer in (("a", "draft"), ("b", "ngram"), ("c", "off")):
        run.admit(rid, PROMPT, proposer, k=4, max_length=len(PROMPT) + n)
    for rid in "abc":
        run.until_length(rid, n)
        assert run.tokens[rid] == greedy(PROMPT, n), rid
    drafted = [VerifyResponse.from_pb(s.verdicts) for s in run.steps]
    accepted = sum(sum(v.num_accepted) for v in drafted)
    rejected = sum(
        k > a for v in drafted for k, a in zip(v.num_draft_tokens, v.num_accepted, strict=True)
    )
    assert accepted > 0 and rejected >= 3, (accepted, rejected)  # wrong at 4 positions
    drafted_steps = [s for s in run.steps if s.draft_s > 0]
    assert drafted_steps and all(s.draft_ahead_hits == 1 for s in drafted_steps)


class RecordingChooser(KChooser):
    """A KChooser that keeps what each step taught it."""

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.seen: list[tuple[list[int], float]] = []

    def observe(
        self, batch: int, ks: list[int], accepted: list[int], step_s: float, draft_s: float
    ) -> None:
        self.seen.append((ks, step_s))
        super().observe(batch, ks, accepted, step_s, draft_s)


def test_a_step_that_waited_for_a_stalled_draft_teaches_dynamic_speculation_nothing(
    runs: list[HubRun],
) -> None:
    link = FakeLink("draft:1", script={3: "stall"})
    run = _start(runs, link, dynamic_speculation=True)
    chooser = RecordingChooser(run.config.max_num_draft_tokens)
    run.hub._chooser = chooser  # before any request: no step has run
    # the stalled step and one more, then the loop holds still (at k = 0 it would otherwise
    # run on to the model's length while this thread is slow, on a loaded machine)
    link.on_stall = lambda: run.engine.allow(2)
    run.admit("a", PROMPT, "draft", k=4)
    link.admit_s = 0.05  # the resynchronisation's re-admission: a prefill the step waits for
    # the third Propose stalls: that step and the ones after it run at k = 0, until the probe
    # is answered and the draft is resynchronised
    first = run.next(lambda e: e.HasField("step") and e.step.draft_fallback != 0).step
    assert first.draft_fallback == target_pb2.DRAFT_FALLBACK_DEADLINE
    assert first.num_fallback_requests == 1
    stalled_step = len(run.steps) - 1
    run.next(lambda e: e.HasField("step"))  # one more at k = 0 while stalled
    assert run.steps[-1].draft_fallback == target_pb2.DRAFT_FALLBACK_DEADLINE
    link.probes[0].finish()
    run.engine.unpace()
    # the step that finds the probe answered admits the request again, waits for that, and drafts
    run.next(lambda e: e.HasField("step") and e.step.draft_s > 0)
    resynced_step = len(run.steps) - 1
    run.next(lambda e: e.HasField("step"))  # and one more after it
    link.released.clear()
    run.release("a")
    _sync(run)
    assert link.released == ["a"]
    assert len(chooser.seen) == len(run.steps) - 1, "every step taught it, but the stalled one"
    ks = [list(VerifyResponse.from_pb(s.verdicts).num_draft_tokens) for s in run.steps]
    assert [k for k, _ in chooser.seen] == ks[:stalled_step] + ks[stalled_step + 1 :]
    # the step that resynchronised waited 0.05 s for the re-admission: not its own time
    taught_s = chooser.seen[resynced_step - 1][1]
    assert taught_s < run.steps[resynced_step].step_s - 0.04, (taught_s, run.steps[resynced_step])


def test_fallback_counts_the_requests_that_lost_their_drafts_only(runs: list[HubRun]) -> None:
    link = FakeLink("draft:1", script={2: "down"})
    run = _start(runs, link)
    link.hold.clear()
    run.admit("z", PROMPT, "draft", k=4)
    assert link.entered.wait(10.0)  # the first step's Propose is held: both admissions below
    # reach the hub together, so the next step holds all three requests
    run.send_admit("a", PROMPT, "draft", k=4)
    run.send_admit("last", PROMPT, "draft", k=4, max_length=len(PROMPT) + 2)  # one token to go
    link.hold.set()
    run.admitted("a")
    run.admitted("last")
    down = run.next(lambda e: e.HasField("step") and e.step.draft_fallback != 0).step
    assert set(VerifyResponse.from_pb(down.verdicts).request_ids) == {"z", "a", "last"}
    assert down.draft_fallback == target_pb2.DRAFT_FALLBACK_UNAVAILABLE
    # "last" would have drafted nothing (k = 0 to its max_length): not a fallback
    assert down.num_fallback_requests == 2


def test_a_request_released_while_its_draft_admission_is_in_flight_is_undone_there(
    runs: list[HubRun],
) -> None:
    link = FakeLink("draft:1", admitting=False)
    run = _start(runs, link)
    run.admit("a", PROMPT, "draft", k=4)
    run.until_length("a", 4)  # it decodes at k = 0 while its draft admission is in flight
    assert not link.proposes, "nothing was asked of the draft for it"
    assert "a" in link.held  # the draft service admitted it; the hub has not heard yet
    run.release("a")
    _sync(run)  # the hub does not wait for the draft's admission to end before going on
    assert "a" not in run.engine.held and "a" not in link.released
    link.admit_gate.finish()  # the draft ends it: the hub, idle, undoes it there
    deadline = time.monotonic() + 10
    while "a" not in link.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "a" in link.released and "a" not in link.held
    assert not link.proposes


def _ks(run: HubRun, rid: str) -> list[int]:
    """The k of each of the request's verdicts, in order."""
    out = []
    for s in run.steps:
        v = VerifyResponse.from_pb(s.verdicts)
        out += [k for r, k in zip(v.request_ids, v.num_draft_tokens, strict=True) if r == rid]
    return out


def test_a_seeded_request_waits_out_a_stall_at_its_own_k(runs: list[HubRun]) -> None:
    """A stalled draft puts unseeded requests at k = 0 but not a seeded sampled one (fixed k):
    it sits the stall out, asks with the longer deadline, and every verdict it gets drafted its
    k, so its output does not depend on the draft's timing."""
    link = FakeLink("draft:1", script={3: "stall"})
    run = _start(runs, link)
    # the stalled step and three more, then the loop holds still: "free" must not run on past
    # the model's length (where its k is 0) while this thread is slow, on a loaded machine
    link.on_stall = lambda: run.engine.allow(4)
    run.admit("seeded", PROMPT, "draft", k=4, fixed=True)
    run.admit("free", PROMPT, "draft", k=4)
    first = run.next(lambda e: e.HasField("step") and e.step.draft_fallback != 0).step
    assert first.draft_fallback == target_pb2.DRAFT_FALLBACK_DEADLINE
    stalled = len(run.steps)
    for _ in range(3):  # steps while stalled: "free" at k = 0, "seeded" waits
        run.next(lambda e: e.HasField("step"))
    assert all(
        VerifyResponse.from_pb(s.verdicts).request_ids == ["free"] for s in run.steps[stalled:]
    )
    link.probes[0].finish()
    run.engine.unpace()
    run.next(lambda e: e.HasField("step") and "seeded" in e.step.verdicts.request_ids)
    run.next(lambda e: e.HasField("step"))
    ks = _ks(run, "seeded")
    assert ks and all(k == 4 for k in ks), ks
    assert 0 in _ks(run, "free")
    draft_side = run.hub._draft
    # every Propose that held the seeded request waited the longer deadline
    assert max(link.deadlines) == pytest.approx(draft_side.seeded_deadline_s)
    assert min(link.deadlines) < draft_side.seeded_deadline_s
    assert run.tokens["seeded"] == greedy(PROMPT, len(run.tokens["seeded"]))


def test_a_stall_longer_than_the_seeded_deadline_takes_the_draft_as_down(
    runs: list[HubRun],
) -> None:
    """A seeded request waits out a stall only up to seeded_deadline_s: then the draft is down,
    and it goes on at k = 0 (its responses' steps show it), never stuck."""
    link = FakeLink("draft:1", script={2: "stall"})
    run = _start(runs, link, draft_deadline_s=0.01)
    # the first step (drafted) and one at k = 0 after the draft is down, then the loop holds
    # still: at k = 0 for good it would otherwise run the request to the model's length
    # while this thread is slow (a loaded machine), and never draft at k = 4 again
    run.engine.allow(2)
    run.admit("seeded", PROMPT, "draft", k=4, fixed=True)
    down = run.next(lambda e: e.HasField("draft_down"))
    assert "seeded requests" in down.draft_down.message
    run.next(lambda e: e.HasField("step") and _ks(run, "seeded")[-1] == 0)
    assert _ks(run, "seeded") == [4, 0]
    # the draft was only slow: named again, it is told to release what it may still hold
    # (else its slots leak, and the re-admission finds the request already there)
    link.released.clear()
    set_draft = target_pb2.SetDraft(address=link.address)
    run.hub.control(target_pb2.ServeControl(set_draft=set_draft))
    run.engine.unpace()  # the held step ends (at k = 0), then the control is applied
    run.next(lambda e: e.HasField("draft_up"))
    assert link.released == ["seeded"]
    run.next(lambda e: e.HasField("step"))
    assert _ks(run, "seeded") == [4, 0, 0, 4]


def test_a_step_of_seeded_requests_only_that_meets_a_stall_verifies_nothing(
    runs: list[HubRun],
) -> None:
    link = FakeLink("draft:1", script={2: "stall"})
    run = _start(runs, link)
    run.admit("seeded", PROMPT, "draft", k=4, fixed=True)
    deadline = time.monotonic() + 10.0
    while not link.probes and time.monotonic() < deadline:  # the second Propose stalls
        time.sleep(0.001)
    assert link.probes, "the draft never stalled"
    time.sleep(0.05)  # the hub loops meanwhile: its only request waits, so no step
    link.probes[0].finish()
    for _ in range(3):
        run.next(lambda e: e.HasField("step"))
    assert all(s.verdicts.request_ids == ["seeded"] for s in run.steps), "no empty step"
    assert _ks(run, "seeded") == [4] * len(run.steps)


def test_a_request_moved_off_the_draft_while_admitted_there_stays_off(
    runs: list[HubRun],
) -> None:
    """Switched to prompt lookup while its draft admission is in flight: once the draft ends
    that admission, the hub undoes it there, and never asks the draft for the request."""
    from specdec.serving.proposers import TO_PB

    link = FakeLink("draft:1", admitting=False)
    run = _start(runs, link)
    run.admit("a", PROMPT, "draft", k=4)
    run.until_length("a", 2)
    pb = target_pb2.SetSpeculation(request_id="a", proposer=TO_PB["ngram"], num_draft_tokens=3)
    run.hub.control(target_pb2.ServeControl(set_speculation=pb))
    _sync(run)
    link.admit_gate.finish()
    deadline = time.monotonic() + 10
    while "a" not in link.released and time.monotonic() < deadline:
        run.next(lambda e: e.HasField("step"))  # the next step's poll settles it
    assert "a" in link.released and "a" not in link.held
    asked = {e.request_id for entries in link.proposes for e in entries}
    assert "a" not in asked, "the draft was asked for it"


def test_pushed_chains_are_verified_without_asking_and_keep_the_greedy_output(
    runs: list[HubRun],
) -> None:
    """A draft that pushes the chain for each coming verdict: the hub verifies it at once and
    sends the block without waiting (`DraftSide.from_push`), reads the answer at the next step,
    and the output is the target's greedy output, wrong drafts included."""
    link = FakeLink("draft:1", wrong_at={9, 12, 13, 20}, push=True)
    run = _start(runs, link)
    n = 30
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.admit("b", PROMPT[:3], "draft", k=3, max_length=3 + n)
    run.until_length("a", n)
    run.until_length("b", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert run.tokens["b"] == greedy(PROMPT[:3], n)
    pushed = [s for s in run.steps if s.draft_ahead_pushed]
    assert len(pushed) >= 4 and len(link.sent) == len(pushed), (len(pushed), len(link.sent))
    assert all(s.draft_ahead_pushed == s.draft_ahead_hits > 0 for s in pushed)
    # every block verified from a push is the chain pushed for that step's verdict
    verified = {(b.request_ids[i], b.steps[i]): b.tokens(i) for b in run.engine.blocks
                for i in range(len(b))}  # fmt: skip
    chains = {}
    for p in link.pushes:
        block = DraftBlock.from_pb(p.block)
        for i in range(len(block)):
            chains[(block.request_ids[i], block.steps[i])] = block.tokens(i)
    sent = {(e.request_id, e.step): e.num_draft_tokens for entries in link.sent for e in entries}
    assert sent and all(verified[key] == chains[key][:k] for key, k in sent.items())
    assert any(k < 4 for k in sent.values()), "near max_length a push was cut to a lower k"
    assert run.hub._draft.push_mismatches == 0


def test_a_push_for_another_verdict_is_not_taken(runs: list[HubRun]) -> None:
    """Chains keyed by verdicts that do not come (their last token another): the hub asks and
    waits as without pushes; the output is the same."""
    link = FakeLink("draft:1", wrong_at={9, 12}, push=True,
                    push_keys=lambda key: (*key[:-1], (key[-1] + 1) % 97))  # fmt: skip
    run = _start(runs, link)
    n = 16
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert link.pushes and not link.sent and not any(s.draft_ahead_pushed for s in run.steps)


def _partial(run: HubRun, link: FakeLink, n: int) -> tuple[list[target_pb2.ServeStep], list]:
    """Runs a (every step's chain pushed) to 3n tokens and b (its chain keyed by another
    verdict at even steps) to n, so that a runs through all of b's steps however late b's
    admission lands: their greedy output, the steps that backed b up, and b's backup asks."""
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + 3 * n)
    run.admit("b", PROMPT[:3], "draft", k=3, max_length=3 + n)
    run.until_length("a", 3 * n)
    run.until_length("b", n)
    assert run.tokens["a"] == greedy(PROMPT, 3 * n)
    assert run.tokens["b"] == greedy(PROMPT[:3], n)
    backed = [s for s in run.steps if s.draft_ahead_push_backups]
    flagged = [e for entries in link.sent for e in entries if e.backup]
    return backed, flagged


def test_a_miss_of_the_pushed_chains_is_backed_up_and_the_hits_keep_theirs(
    runs: list[HubRun],
) -> None:
    """b misses the push at even steps, a hits: with a backup_miss_share above 1 / 2 the hub
    verifies a's chain and b with no drafts (ProposeEntry.backup), without asking; the output
    stays the greedy one, and each backup is counted among the misses and the backups."""
    link = FakeLink("draft:1", push=True, push_share=0.75,
                    push_miss=lambda rid, step: rid == "b" and step % 2 == 0)  # fmt: skip
    run = _start(runs, link, draft_push_always=True)  # no asks to measure that way
    backed, flagged = _partial(run, link, 60)
    assert len(backed) >= 3 and len(flagged) == sum(s.draft_ahead_push_backups for s in backed)
    assert all(e.request_id == "b" and e.num_draft_tokens > 0 for e in flagged)
    for s in backed:
        v = VerifyResponse.from_pb(s.verdicts)
        ks = dict(zip(v.request_ids, v.num_draft_tokens, strict=True))
        assert ks["b"] == 0 and ks["a"] > 0, ks
        assert s.draft_ahead_pushed == s.draft_ahead_hits == 1
        assert s.draft_ahead_misses == s.draft_ahead_backups == s.draft_ahead_push_backups == 1
    # the first two steps ask (nothing pushed yet; b admitted); a alone after b hits: no more
    assert len(link.proposes) <= 2, link.proposes
    assert run.hub._draft.push_mismatches == 0, "the answers were what the target verified"


@pytest.mark.parametrize(
    ("share", "fixed"), [(0.5, False), (0.0, False), (float("nan"), False), (10.0, True)],
    ids=["share-too-low", "share-zero", "share-nan", "seeded"],
)  # fmt: skip
def test_a_miss_that_does_not_pay_or_has_a_fixed_k_asks(
    runs: list[HubRun], share: float, fixed: bool
) -> None:
    """One miss of two asks backs up only where 1 < share x 2, and never a request with a
    fixed k (its output must not depend on hits): else the step asks and waits."""
    link = FakeLink("draft:1", push=True, push_share=share,
                    push_miss=lambda rid, step: rid == "b" and step % 2 == 0)  # fmt: skip
    run = _start(runs, link, draft_push_always=True)  # no asks to measure that way
    n = 20
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.admit("b", PROMPT[:3], "draft", k=3, max_length=3 + n, fixed=fixed)
    run.until_length("a", n)
    run.until_length("b", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert run.tokens["b"] == greedy(PROMPT[:3], n)
    assert not any(s.draft_ahead_push_backups for s in run.steps)
    assert not any(e.backup for entries in link.sent for e in entries)
    # b's chains are keyed wrong for its even steps: those steps asked, a's hit or not
    missed = [p for p in link.proposes[2:] if any(e.request_id == "b" and e.step % 2 == 0
                                                  for e in p)]  # fmt: skip
    assert len(missed) >= 2, link.proposes


def test_an_ask_without_any_chain_in_the_push_is_asked_for() -> None:
    """A request the push holds no chain of (just admitted, or left out of the pass ahead by
    its budget) is drafted now by the draft: `_from_push` gives up rather than back it up,
    so it is never held at k = 0 step after step."""
    from specdec.pb import draft_pb2
    from target_service.hub_draft import _from_push

    push = draft_pb2.ProposeResponse(pushed=True, backup_miss_share=10.0)
    entry = draft_pb2.ProposeEntry(request_id="a", step=3, new_token_ids=[5],
                                   committed_length=9, num_draft_tokens=2)  # fmt: skip
    assert _from_push(push, [entry], 8) is None
    entry.num_draft_tokens = 0  # an ask for no drafts needs no chain
    found = _from_push(push, [entry], 8)
    assert found is not None and found[1] == [] and found[0][0].draft_token_ids == ()


def test_an_answer_other_than_the_push_is_counted_and_the_output_kept(runs: list[HubRun]) -> None:
    """The draft answers a block sent without waiting with other drafts than those it pushed
    and the target verified (a chain dropped in between): counted and logged; its KV then
    holds its own drafts, and the next ask's verdict says what was committed."""
    link = FakeLink("draft:1", push=True, answer_other=True)
    run = _start(runs, link)
    n = 16
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert run.hub._draft.push_mismatches > 0


def test_a_draft_that_stalls_after_a_block_sent_without_waiting_costs_only_k(
    runs: list[HubRun],
) -> None:
    """The answer to a pushed step's block does not come: the draft is taken as stalled, the
    requests run at k = 0 until it answers its probe, then speculate (and push) again."""
    link = FakeLink("draft:1", push=True, collect_script={2: "stall"})
    run = _start(runs, link)
    n = 60
    run.engine.allow(4)  # the steps up to the stall's first: the loop holds there
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.next(lambda e: e.HasField("step") and e.step.draft_fallback != 0)
    pushed_before = sum(s.draft_ahead_pushed for s in run.steps)
    link.probes[0].finish()
    run.engine.unpace()
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    fell_back = [s for s in run.steps if s.draft_fallback == target_pb2.DRAFT_FALLBACK_DEADLINE]
    assert fell_back, "the steps during the stall ran at k = 0"
    assert sum(s.draft_ahead_pushed for s in run.steps) > pushed_before > 0


@pytest.mark.parametrize("failure", ["down", "stall"])
def test_a_draft_that_fails_while_its_push_is_awaited_costs_only_k(
    runs: list[HubRun], failure: str
) -> None:
    """The draft dies (or stalls) during its pass ahead, while the hub waits for its push: no
    step fails; the requests decode at k = 0 (until a stalled draft answers again)."""
    link = FakeLink("draft:1", push=True, take_push_script={3: failure})
    run = _start(runs, link)
    n = 30
    run.engine.allow(5)
    run.admit("a", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.next(lambda e: e.HasField("step") and e.step.draft_fallback != 0)
    if failure == "stall":
        link.probes[0].finish()
    run.engine.unpace()
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    errors = [VerifyResponse.from_pb(s.verdicts).errors for s in run.steps]
    assert not any(errors), errors


def test_a_malformed_push_is_refused_as_such() -> None:
    """A push whose verdicts do not fit its block (a buffer of 3 bytes, lengths that do not add
    up) raises ValueError, which the hub logs and ignores (it asks instead)."""
    from specdec.pb import draft_pb2
    from target_service.hub_draft import _from_push

    block = DraftBlock.build(["a"], [1], [6], [1], [0], [5])
    entry = draft_pb2.ProposeEntry(request_id="a", step=1, new_token_ids=[9], committed_length=6,
                                   num_draft_tokens=1)  # fmt: skip
    good = draft_pb2.ProposeResponse(block=block.to_pb(), pushed=True, verdict_lengths=[1],
                                     verdict_token_ids=(9).to_bytes(4, "little"))  # fmt: skip
    found = _from_push(good, [entry], 64)
    assert found is not None and found[0][0].draft_token_ids == (5,) and found[1] == []
    for bad in (
        draft_pb2.ProposeResponse(block=block.to_pb(), pushed=True, verdict_lengths=[1],
                                  verdict_token_ids=b"\x09\x00\x00"),
        draft_pb2.ProposeResponse(block=block.to_pb(), pushed=True, verdict_lengths=[2],
                                  verdict_token_ids=(9).to_bytes(4, "little")),
    ):  # fmt: skip
        with pytest.raises(ValueError):
            _from_push(bad, [entry], 64)


def test_push_choice_measures_each_way_then_takes_the_shorter_wait() -> None:
    """PUSH_EXPLORE_STEPS steps with pushes, as many with asks, then the way whose average
    wait was shorter, the other again for PUSH_EXPLORE_STEPS in every PUSH_EXPLORE_EVERY."""
    choice = PushChoice()
    ways = []
    for _ in range(2 * PUSH_EXPLORE_EVERY):
        way = choice.next()
        ways.append(way)
        choice.waited(way, 0.004 if way else 0.001)  # asks wait less
    n = PUSH_EXPLORE_STEPS
    assert ways[:n] == [True] * n and ways[n : 2 * n] == [False] * n, ways[: 2 * n]
    pushed = [i for i, way in enumerate(ways) if way and i >= 2 * n]
    # steps count from 1: the runs of the other way are the steps i + 1 = 256 .. 263, ...
    explore = [i for i in range(len(ways)) if (i + 1) % PUSH_EXPLORE_EVERY < n and i >= 2 * n]
    assert pushed == explore, pushed
    always = PushChoice(always=True)
    assert all(always.next() for _ in range(3 * n))


@pytest.mark.parametrize("slower", ["push", "ask"])
def test_the_hub_takes_the_way_it_waits_less_for_drafts(runs: list[HubRun], slower: str) -> None:
    """A draft whose pushes come late (its pass ahead longer than the verify) and one whose
    answers do: after measuring both ways the hub asks for pushes only where they make it wait
    less; the output is the target's greedy output either way."""
    waits = {"push_wait_s": 0.03} if slower == "push" else {"ask_wait_s": 0.03}
    link = FakeLink("draft:1", wrong_at={9, 30}, push=True, **waits)
    run = _start(runs, link)
    n = 90
    run.admit("a", PROMPT, "draft", k=1, max_length=len(PROMPT) + n)
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    measured = 2 * PUSH_EXPLORE_STEPS
    tail = link.push_flags[measured + 1 :]
    assert len(tail) >= 10, link.push_flags
    assert all(f == (slower == "ask") for f in tail), link.push_flags
    choice = run.hub._draft.push_choice
    assert choice.counts[True] >= PUSH_EXPLORE_STEPS <= choice.counts[False], choice


def test_a_pushed_chain_shorter_than_k_serves_only_an_ask_whose_k_is_not_fixed() -> None:
    """A chain spawned from a catch-up holds one draft fewer than k (`drafting.Spawn`): the
    push's chain serves an ask of that verdict with the drafts it holds, as the draft's own
    answer does (`messages.chain_serves`); for a fixed k (a seeded request) it is a miss."""
    from specdec.pb import draft_pb2
    from target_service.hub_draft import _from_push

    block = DraftBlock.build(["a"], [1], [6], [2], [0], [5, 7])
    push = draft_pb2.ProposeResponse(block=block.to_pb(), pushed=True, verdict_lengths=[1],
                                     verdict_token_ids=(9).to_bytes(4, "little"),
                                     backup_miss_share=10.0)  # fmt: skip
    entry = draft_pb2.ProposeEntry(request_id="a", step=1, new_token_ids=[9], committed_length=6,
                                   num_draft_tokens=3)  # fmt: skip
    found = _from_push(push, [entry], 64)
    assert found is not None and found[1] == [] and found[0][0].draft_token_ids == (5, 7)
    entry.fixed_num_draft_tokens = True
    found = _from_push(push, [entry], 64)  # a miss, which `from_push` then asks for
    assert found is not None and found[1] == [0] and found[0][0].draft_token_ids == ()


def test_a_step_whose_asks_want_no_drafts_does_not_wait_for_the_draft(
    runs: list[HubRun],
) -> None:
    """A step in which no ask wants drafts (k = 0: dynamic speculation's choice, a request's
    last token) sends its block without waiting and reads the draft's answer after the
    verify: the draft is told every committed token, no Propose waits, and a step that also
    holds a request with drafts asks as before."""
    link = FakeLink("draft:1", ask_wait_s=0.001)
    run = _start(runs, link)
    # each block leaves once its own step's verify is launched: the engine holds that step
    verifying: list[list[int]] = []  # at each send, the steps the engine's last block verifies
    send = link.send
    link.send = lambda *a, **kw: (verifying.append(list(run.engine.blocks[-1].steps)),  # type: ignore[method-assign]
                                  send(*a, **kw))[1]  # fmt: skip
    n = 12
    run.engine.allow(n - 1)
    run.admit("a", PROMPT, "draft", k=0)
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert not link.proposes, "a step without drafts waited for the draft's answer"
    # the n - 1 steps after the prefill's first token (the next one, held before its verify,
    # has sent nothing yet)
    assert len(link.sent) == n - 1 and link._collects == n - 1, "each answer read after its verify"
    assert verifying == [[e.step for e in block] for block in link.sent], (
        "a block left before its verify was launched"
    )
    assert all(e.num_draft_tokens == 0 for block in link.sent for e in block)
    assert not any(link.push_flags), "a block without drafts asks for no push"
    # the draft drafts nothing from it: no wait for gRPC to have sent it before the verify
    assert not any(link.handoffs), "a block without drafts waited for its hand-off"
    # every token but the last, which the held step's block will tell
    assert link.held["a"] == [*PROMPT, *run.tokens["a"][:-1]], "the draft was not told"
    run.engine.unpace()
    run.admit("b", PROMPT, "draft", k=4, max_length=len(PROMPT) + n)
    run.until_length("b", n)
    assert run.tokens["b"] == greedy(PROMPT, n)
    # b's steps ask and wait, a's k = 0 beside it; b's last (k = 0 to its max_length) does not
    assert link.proposes and all(
        {(e.request_id, e.num_draft_tokens > 0) for e in p} == {("a", False), ("b", True)}
        for p in link.proposes
    ), link.proposes
    assert any({e.request_id for e in block} == {"a", "b"} for block in link.sent)
    assert all(e.num_draft_tokens == 0 for block in link.sent for e in block)


def test_a_failed_step_sends_its_told_block_before_the_release(runs: list[HubRun]) -> None:
    """A step at k = 0 whose verify fails before its device work was queued (so its block
    was never sent): the block still reaches the draft, and its answer is read, before the
    failed request's release does; the draft never gets a block for a request it released."""
    link = FakeLink("draft:1")
    order: list[tuple[str, set[str]]] = []
    send, release = link.send, link.release
    link.send = lambda entries, *a, **kw: (  # type: ignore[method-assign]
        order.append(("send", {e.request_id for e in entries})),
        send(entries, *a, **kw),
    )[1]
    link.release = lambda ids, *a, **kw: (  # type: ignore[method-assign]
        order.append(("release", set(ids))),
        release(ids, *a, **kw),
    )[1]
    run = _start(runs, link)
    verify, calls = run.engine.verify_timed, []

    def fail_third(block: DraftBlock, launched: Callable[[], None] | None = None) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected before the launch")
        return verify(block, launched)

    run.engine.verify_timed = fail_third  # type: ignore[method-assign]
    run.admit("a", PROMPT, "draft", k=0)
    run.next(lambda e: e.HasField("step") and bool(VerifyResponse.from_pb(e.step.verdicts).errors))
    released = [i for i, (what, ids) in enumerate(order) if what == "release" and "a" in ids]
    assert released, order
    before, after = order[: released[0]], order[released[0] :]
    assert sum(what == "send" for what, _ in before) == 3, "the failed step's block was not sent"
    assert not any(what == "send" and "a" in ids for what, ids in after), order
    assert link._collects == 3, "each block's answer read"


def test_a_block_without_drafts_whose_answer_stalls_costs_nothing_and_teaches_nothing(
    runs: list[HubRun],
) -> None:
    """The answer to a block sent without waiting does not come: the draft is stalled (the
    step's tokens stand: they never depended on it), dynamic speculation does not learn from
    that step's time, and once the probe is answered the request is told again."""
    link = FakeLink("draft:1", collect_script={3: "stall"})
    run = _start(runs, link, dynamic_speculation=True)
    chooser = RecordingChooser(run.config.max_num_draft_tokens)
    run.hub._chooser = chooser  # before any request: no step has run
    n = 24
    link.on_stall = lambda: None
    run.engine.allow(4)  # three steps sent without waiting, then one while stalled
    run.admit("a", PROMPT, "draft", k=0, max_length=len(PROMPT) + n)
    run.until_length("a", 5)
    assert len(link.probes) == 1, "the missing answer stalled the draft"
    assert len(chooser.seen) == len(run.steps) - 1, "every step taught it, but the stalled one"
    sent_before = len(link.sent)
    link.probes[0].finish()
    run.engine.unpace()
    run.until_length("a", n)
    assert run.tokens["a"] == greedy(PROMPT, n)
    assert len(link.sent) > sent_before, "told again after the resynchronisation"
    errors = [VerifyResponse.from_pb(s.verdicts).errors for s in run.steps]
    assert not any(errors), errors
