"""How long the hub's steps wait for a draft admission (`DraftSide.poll`): the first step after
it waits at most the deadline or one target step, whichever is shorter, later steps do not wait
for it again, and a seeded sampled request is still waited for up to the admission's timeout;
a released request's admission is not waited for at its release."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest
from target_service.config import TargetConfig
from target_service.hub_draft import DraftSide, HubRequest
from tests.draft_service.models import runner_config
from tests.target_service.hub_fakes import INFO


class _Pending:
    """Admissions in flight that never end here; records each wait asked of them."""

    def __init__(self, rids: Sequence[str]):
        self.admissions = [AdmitRequest(rid, (1, 2, 3), SamplingParams(0.0)) for rid in rids]
        self.request_ids = set(rids)
        self.waits: list[float] = []

    def done(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return False


def _side(tmp_path: pytest.TempPathFactory, requests: dict[str, HubRequest]) -> DraftSide:
    config = TargetConfig(runner_config(tmp_path), draft_deadline_s=0.3)  # type: ignore[arg-type]
    return DraftSide(config, INFO, requests, lambda **event: None)


def _req(rid: str, fixed_k: bool = False) -> HubRequest:
    sampling = SamplingParams(1.0, seed=1) if fixed_k else SamplingParams(0.0)
    return HubRequest(rid, sampling, "draft", 4, [1, 2, 3], 1, fixed_k=fixed_k)


def test_the_first_step_waits_one_target_step_at_most_and_later_steps_not_at_all(
    tmp_path: pytest.TempPathFactory,
) -> None:
    req = _req("a")
    side = _side(tmp_path, {"a": req})
    pending = _Pending(["a"])
    side.defer(pending, [req])  # type: ignore[arg-type]
    side.poll(step_s=0.007)
    side.poll(step_s=0.007)
    side.poll(step_s=0.007)
    assert 0.006 < pending.waits[0] <= 0.007, pending.waits
    assert pending.waits[1:] == [0.0, 0.0], "a later step waited for it again"
    other = _Pending(["a"])
    side.defer(other, [req])  # type: ignore[arg-type]
    side.poll()  # no step time known yet: the deadline
    assert 0.29 < other.waits[0] <= 0.3, other.waits
    assert side.admitting


def test_a_seeded_sampled_request_is_still_waited_for(tmp_path: pytest.TempPathFactory) -> None:
    req = _req("s", fixed_k=True)
    side = _side(tmp_path, {"s": req})
    side.link = SimpleNamespace(timeout_s=5.0)  # type: ignore[assignment]
    pending = _Pending(["s"])
    side.defer(pending, [req])  # type: ignore[arg-type]
    side.poll(step_s=0.007)
    side.poll(step_s=0.007)
    # the admission's timeout (10 deadlines) at each step, as before
    assert all(2.9 < w <= 3.0 for w in pending.waits), pending.waits


def test_a_release_does_not_wait_for_the_admission(tmp_path: pytest.TempPathFactory) -> None:
    req = _req("r")
    requests = {"r": req}
    side = _side(tmp_path, requests)
    pending = _Pending(["r"])
    side.defer(pending, [req])  # type: ignore[arg-type]
    del requests["r"]
    side.release([req])
    assert pending.waits == [0.0], "the release waited for the draft's admission"
    assert side.admitting, "its undo is left for when the draft ends it"


class _Answered(_Pending):
    """Admissions that have ended: `wait` gives each its answer, or raises `error`."""

    def __init__(self, rids: Sequence[str], error: BaseException | None = None):
        super().__init__(rids)
        self.error = error

    def done(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return True

    def wait(self) -> dict[str, str | None]:
        if self.error is not None:
            raise self.error
        return {rid: None for rid in self.request_ids}

    def cancel(self) -> None:
        pass


class _Link:
    def __init__(self) -> None:
        self.address, self.timeout_s, self.released = "draft:1", 5.0, []  # type: list[str]
        self.closed = False

    def release(self, request_ids: Sequence[str], timeout_s: float) -> None:
        self.released += list(request_ids)

    def close(self, graceful: bool = True) -> None:
        self.closed = True


def test_two_released_admissions_failing_with_the_draft_down_end_nothing_else(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """The first settle takes the draft as down, which clears the admissions in flight: the
    second is then skipped, not settled twice (it raised in the hub's idle loop)."""
    from target_service.draft_link import DraftDown

    side = _side(tmp_path, {})
    side.link = _Link()  # type: ignore[assignment]
    for rid in ("x", "y"):
        side.defer(_Answered([rid], DraftDown("gone")), [_req(rid)])  # type: ignore[arg-type]
    side.settle_done()
    assert not side.admitting and side.link is None


def test_the_streams_end_undoes_what_admissions_in_flight_admitted(
    tmp_path: pytest.TempPathFactory,
) -> None:
    side = _side(tmp_path, {})
    link = _Link()
    side.link = link  # type: ignore[assignment]
    side.defer(_Answered(["gone"]), [_req("gone")])  # type: ignore[arg-type]
    side.close()  # the stream's end: its requests were released first
    assert link.released == ["gone"] and link.closed and not side.admitting
