"""The orchestrator's PairClient: torch-free, checks its input, opens one Serve stream (or says
clearly why not), reports both services' ModelInfo, and counts running requests the way the
hub holds them, over real gRPC with tiny models."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from bench.local import LocalPair
from orchestrator.core.pair import PairAdmission, PairClient, StepReport
from specdec.sampling_params import SamplingParams
from tests.draft_service.models import build_checkpoints
from tests.target_service.hub_helpers import GREEDY, Driver, hub_services

PROMPT = [5, 17, 42, 9, 77, 5, 17]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPair]:
    with hub_services(*build_checkpoints(tmp_path_factory.mktemp("ckpt"))) as s:
        yield s


def test_imports_without_torch() -> None:
    probe = textwrap.dedent(
        """
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton"):
                    raise ImportError(f"{name} is refused")

        sys.meta_path.insert(0, Refuse())
        import orchestrator.core.pair
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(request_id=""), "request_id"),
        (dict(token_ids=()), "token_ids"),
        (dict(proposer="eagle"), "proposer"),
        (dict(num_draft_tokens=-1), "num_draft_tokens"),
        (dict(first_step=-2), "first_step"),
    ],
)
def test_admission_checks_its_fields(kwargs: dict[str, object], field: str) -> None:
    fields: dict[str, object] = dict(
        request_id="r", token_ids=(1, 2), sampling=SamplingParams(), proposer="draft",
        num_draft_tokens=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match=field):
        PairAdmission(**(fields | kwargs))  # type: ignore[arg-type]


def test_unreachable_target_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=r"did not answer within 0\.5 s"):
        PairClient(f"127.0.0.1:{port}", on_step=print, on_admitted=print, timeout_s=0.5)


def test_second_client_is_refused_with_the_reason(svc: LocalPair) -> None:
    first = PairClient(svc.target_address, on_step=print, on_admitted=print, timeout_s=30)
    try:
        with pytest.raises(ConnectionError, match="already open"):
            PairClient(svc.target_address, on_step=print, on_admitted=print, timeout_s=30)
    finally:
        first.close()


def test_model_info_names_both_services(svc: LocalPair) -> None:
    client = PairClient(svc.target_address, on_step=print, on_admitted=print, timeout_s=30)
    try:
        target, draft = client.model_info()
        assert target == svc.target_engine.info
        assert draft == svc.draft_engine.info
        assert client.draft_up
    finally:
        client.close()


def test_num_running_follows_admissions_releases_and_errors(svc: LocalPair) -> None:
    driver = Driver(svc.target_address, max_new_tokens=10_000)
    client = driver.client
    with pytest.raises(ValueError, match="proposer"):
        client.set_speculation("a", "medusa", 2)
    driver.admit("a", PROMPT, "draft", 2)
    driver.admit("b", PROMPT, "ngram", 2)
    # released before its admission is answered: never counted as running
    client.admit(PairAdmission("gone", tuple(PROMPT), GREEDY, "off", 0))
    client.release(["gone"])
    driver.admit("bad", [1, 10**6], "off", 0)
    driver.until(lambda: all(r.admitted is not None for r in driver.records.values()))
    driver.until(lambda: len(driver.reports) >= 2)
    assert client.num_running == 2
    client.set_speculation("a", "off", 0)
    seen = len(driver.reports)
    driver.until(lambda: len(driver.reports) >= seen + 3)
    last = {e.request_id: e for e in driver.reports[-1].events}
    assert set(last) == {"a", "b"}, "released or refused requests were stepped"
    assert last["a"].num_draft_tokens == 0, "set_speculation off did not take effect"
    client.release(["a"])
    assert client.num_running == 1
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.release(["b"])
    assert all(isinstance(r, StepReport) for r in driver.reports)


def test_close_ends_the_stream_and_frees_both_services(svc: LocalPair) -> None:
    closed: list[BaseException | None] = []
    stepped = threading.Event()
    client = PairClient(svc.target_address, on_step=lambda r: stepped.set(), on_admitted=print,
                        on_close=closed.append, timeout_s=30)  # fmt: skip
    client.admit(PairAdmission("c", tuple(PROMPT), GREEDY, "draft", 3))
    assert stepped.wait(30)
    client.close()
    assert closed == [None]
    with pytest.raises(KeyError):
        svc.target_engine.tokens("c")
    assert svc.draft_engine.release(["c"]) == 0, "the draft still held c"
    client.close()  # twice is fine
