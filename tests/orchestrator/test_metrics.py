"""Metrics scraped over real HTTP and parsed with prometheus_client's parser equal what was fed,
under vLLM's names with the specdec: prefix."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.core.metrics import Metrics, start_metrics_server
from orchestrator.core.pair import StepEvent
from orchestrator.core.pair import StepReport as Report
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.messages import ErrorReason, RequestError

PAIR = "target-8b/draft-1b"


@pytest.fixture
def served() -> Iterator[tuple[Metrics, int]]:
    metrics = Metrics(PAIR)
    server, port = start_metrics_server(0, "127.0.0.1", metrics.registry)
    yield metrics, port
    server.shutdown()
    server.server_close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_pair": PAIR, **labels}.items())))]


PROPOSERS = {"a": "draft", "b": "draft", "c": "ngram", "d": "off"}
ERROR = RequestError(ErrorReason.CAPACITY, grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
REPORTS = [
    Report(
        (
            StepEvent("a", 0, (1, 2, 3), 3, 2),
            StepEvent("b", 0, (4,), 2, 0),
            StepEvent("c", 0, (5, 6, 7, 8, 9), 4, 4),
            StepEvent("d", 0, (10,), 0, 0),
        ),
        0.002,
        0.0005,
        0.004,
        0.0002,
        0.007,
        True,
        True,  # graphed
    ),
    Report(
        (
            StepEvent("a", 1, (11, 12), 3, 1),
            StepEvent("b", 1, (), 0, 0, ERROR),
            StepEvent("gone", 1, (13, 14), 3, 1),  # released meanwhile: its verdict is dropped
        ),
        0.0,
        0.0,
        0.003,
        0.0001,
        0.004,
        False,
        False,  # a forward ran eagerly
    ),
]


def test_spec_decode_counters_equal_what_was_fed(served) -> None:
    metrics, port = served
    for report in REPORTS:
        metrics.on_step(report, PROPOSERS.get)
    s = _scrape(port)
    draft, ngram = {"proposer": "draft"}, {"proposer": "ngram"}
    assert _value(s, "specdec:spec_decode_num_drafts_total", **draft) == 3
    assert _value(s, "specdec:spec_decode_num_draft_tokens_total", **draft) == 8
    assert _value(s, "specdec:spec_decode_num_accepted_tokens_total", **draft) == 3
    assert _value(s, "specdec:spec_decode_num_drafts_total", **ngram) == 1
    assert _value(s, "specdec:spec_decode_num_draft_tokens_total", **ngram) == 4
    assert _value(s, "specdec:spec_decode_num_accepted_tokens_total", **ngram) == 4
    assert _value(s, "specdec:spec_decode_num_drafts_total", proposer="off") == 0
    per_pos = "specdec:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_value(s, per_pos, proposer="draft", position=str(i)) for i in range(2)] == [2, 1]
    assert [_value(s, per_pos, proposer="ngram", position=str(i)) for i in range(4)] == [1] * 4
    assert (per_pos, (("model_pair", PAIR), ("position", "2"), ("proposer", "draft"))) not in s
    assert not [key for key in s if ("proposer", "unknown") in key[1]]
    assert _value(s, "specdec:steps_total") == 2
    assert _value(s, "specdec:eager_steps_total") == 1
    assert _value(s, "specdec:draft_up") == 0


def test_step_histograms_count_and_sum(served) -> None:
    metrics, port = served
    for report in REPORTS:
        metrics.on_step(report, PROPOSERS.get)
    s = _scrape(port)
    # the draft and transport histograms hold only the step that used the draft service
    assert _value(s, "specdec:step_draft_seconds_count") == 1
    assert _value(s, "specdec:step_draft_seconds_sum") == pytest.approx(0.002)
    assert _value(s, "specdec:step_transport_seconds_sum") == pytest.approx(0.0005)
    assert _value(s, "specdec:step_verify_seconds_count") == 2
    assert _value(s, "specdec:step_verify_seconds_sum") == pytest.approx(0.007)
    assert _value(s, "specdec:step_sampler_seconds_sum") == pytest.approx(0.0003)
    assert _value(s, "specdec:step_seconds_sum") == pytest.approx(0.011)
    assert _value(s, "specdec:step_verify_seconds_bucket", le="0.003") == 1


def test_draft_ahead_counters(served) -> None:
    """A step answered from drafts made ahead (no forward: draft 0 s) still used the draft
    service: its transport counts, and so do its hits and misses."""
    metrics, port = served
    ahead = Report((StepEvent("a", 2, (1, 2), 3, 1),), 0.0, 0.0004, 0.003, 0.0001, 0.004,
                   True, True, draft_ahead_hits=3, draft_ahead_misses=1)  # fmt: skip
    for report in [*REPORTS, ahead]:
        metrics.on_step(report, PROPOSERS.get)
    s = _scrape(port)
    assert _value(s, "specdec:draft_ahead_hits_total") == 3
    assert _value(s, "specdec:draft_ahead_misses_total") == 1
    assert _value(s, "specdec:step_transport_seconds_count") == 2
    assert _value(s, "specdec:step_transport_seconds_sum") == pytest.approx(0.0009)


def test_draft_busy_time_is_its_forwards_and_its_passes_ahead(served) -> None:
    """The draft's busy seconds: each step's proposal forwards plus the passes ahead it ran
    since the last step it answered (a hit has no forward, but its pass ahead counts)."""
    metrics, port = served
    ahead = Report((StepEvent("a", 2, (1, 2), 3, 1),), 0.0, 0.0004, 0.003, 0.0001, 0.004,
                   True, True, draft_ahead_hits=1, draft_ahead_s=0.0025)  # fmt: skip
    for report in [*REPORTS, ahead]:
        metrics.on_step(report, PROPOSERS.get)
    drafted = sum(r.draft_s for r in REPORTS)
    assert drafted > 0
    busy = _value(_scrape(port), "specdec:draft_busy_seconds_total")
    assert busy == pytest.approx(drafted + 0.0025)
    metrics.set_pairs(3)
    assert _value(_scrape(port), "specdec:pairs") == 3


def test_the_step_k_of_draft_model_requests(served) -> None:
    """Each step serving draft-model requests adds its largest k: 3 in the first step (the
    ngram request's 4 is not the draft's), 3 in the second (the failed verdict and the
    released request's do not count); a step at k = 0 counts 0; an ngram-only step nothing."""
    metrics, port = served
    plain = Report((StepEvent("a", 2, (7,), 0, 0),), 0.0, 0.0, 0.003, 0.0001, 0.004, True, True)
    ngram = Report((StepEvent("c", 1, (7,), 2, 0),), 0.0, 0.0, 0.003, 0.0001, 0.004, True, True)
    for report in [*REPORTS, plain, ngram]:
        metrics.on_step(report, PROPOSERS.get)
    s = _scrape(port)
    assert _value(s, "specdec:step_num_draft_tokens_count") == 3
    assert _value(s, "specdec:step_num_draft_tokens_sum") == 6
    assert _value(s, "specdec:step_num_draft_tokens_bucket", le="0.0") == 1


def test_fault_counters(served) -> None:
    """Steps whose draft requests fell back to k = 0 count by reason, once per step and once
    per request; restarts count by role; every series exists at 0 before the first fault."""
    metrics, port = served
    s = _scrape(port)
    for reason in ("deadline", "unavailable"):
        assert _value(s, "specdec:draft_fallback_steps_total", reason=reason) == 0
    assert _value(s, "specdec:service_restarts_total", role="draft") == 0
    assert _value(s, "specdec:serve_reconnects_total") == 0
    k0 = (StepEvent("a", 3, (1,), 0, 0), StepEvent("b", 3, (2,), 0, 0))
    steps = [
        Report(k0, 0.0, 0.0, 0.003, 0.0001, 0.3, True, fallback="deadline",
               num_fallback_requests=2),
        Report(k0, 0.0, 0.0, 0.003, 0.0001, 0.004, True, fallback="deadline",
               num_fallback_requests=2),
        Report(k0[:1], 0.0, 0.0, 0.003, 0.0001, 0.004, False, fallback="unavailable",
               num_fallback_requests=1),
        REPORTS[0],
    ]  # fmt: skip
    for report in steps:
        metrics.on_step(report, PROPOSERS.get)
    metrics.on_restart("draft")
    metrics.on_reconnect()
    s = _scrape(port)
    assert _value(s, "specdec:draft_fallback_steps_total", reason="deadline") == 2
    assert _value(s, "specdec:draft_fallback_requests_total", reason="deadline") == 4
    assert _value(s, "specdec:draft_fallback_steps_total", reason="unavailable") == 1
    assert _value(s, "specdec:draft_fallback_requests_total", reason="unavailable") == 1
    assert _value(s, "specdec:service_restarts_total", role="draft") == 1
    assert _value(s, "specdec:service_restarts_total", role="target") == 0
    assert _value(s, "specdec:serve_reconnects_total") == 1


def _final(prompt: int, completion: int, ttft: float, e2e: float, reason: int):
    timing = generate_pb2.Timing(
        time_to_first_token_s=ttft, e2e_s=e2e, queue_s=ttft / 4, admission_s=ttft / 2,
        prefill_s=ttft / 8,
    )  # fmt: skip
    return generate_pb2.GenerateResponse(
        finish_reason=reason,  # type: ignore[arg-type]
        usage=generate_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion),
        timing=timing,
    )


def test_request_metrics(served) -> None:
    metrics, port = served
    metrics.on_first_token(0.05)
    metrics.on_finish(_final(10, 5, 0.05, 0.45, generate_pb2.FINISH_REASON_LENGTH))
    metrics.on_first_token(0.2)
    metrics.on_finish(_final(7, 1, 0.2, 0.2, generate_pb2.FINISH_REASON_STOP_TOKEN))
    metrics.on_error(grpc.StatusCode.INVALID_ARGUMENT)
    metrics.on_error("DEADLINE_EXCEEDED")
    metrics.on_error(grpc.StatusCode.INVALID_ARGUMENT)
    metrics.set_queue(running=3, waiting=9)
    s = _scrape(port)
    assert _value(s, "specdec:prompt_tokens_total") == 17
    assert _value(s, "specdec:generation_tokens_total") == 6
    assert _value(s, "specdec:request_success_total", finish_reason="length") == 1
    assert _value(s, "specdec:request_success_total", finish_reason="stop_token") == 1
    assert _value(s, "specdec:request_errors_total", code="INVALID_ARGUMENT") == 2
    assert _value(s, "specdec:request_errors_total", code="DEADLINE_EXCEEDED") == 1
    assert _value(s, "specdec:time_to_first_token_seconds_count") == 2
    assert _value(s, "specdec:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert _value(s, "specdec:e2e_request_latency_seconds_sum") == pytest.approx(0.65)
    assert _value(s, "specdec:request_queue_time_seconds_sum") == pytest.approx(0.25 / 4)
    assert _value(s, "specdec:request_prefill_time_seconds_count") == 2
    assert _value(s, "specdec:request_prefill_time_seconds_sum") == pytest.approx(0.25 / 8)
    # one request with more than one token: (0.45 - 0.05) / 4 tokens after the first
    assert _value(s, "specdec:time_per_output_token_seconds_count") == 1
    assert _value(s, "specdec:time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert _value(s, "specdec:num_requests_running") == 3
    assert _value(s, "specdec:num_requests_waiting") == 9


def test_two_instances_have_separate_registries() -> None:
    first, second = Metrics(PAIR), Metrics(PAIR)
    first.on_error("INTERNAL")
    labels = {"model_pair": PAIR, "code": "INTERNAL"}
    assert first.registry.get_sample_value("specdec:request_errors_total", labels) == 1
    assert second.registry.get_sample_value("specdec:request_errors_total", labels) is None


def test_served_in_the_classic_text_format_whatever_the_scraper_asks(served) -> None:
    """Prometheus 2.x asks for OpenMetrics, in which prometheus_client escapes `specdec:` to
    `specdec_`; the server answers the text format, where the names keep their colon."""
    metrics, port = served
    metrics.on_error("INTERNAL")
    accept = (
        "application/openmetrics-text;version=1.0.0;q=0.5,"
        "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
    )
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    assert 'specdec:request_errors_total{code="INTERNAL"' in text
    assert "specdec_" not in text


def test_no_created_series(served) -> None:
    """No `_created` series (each counter and histogram child's creation time): the scrape
    holds the counters, histograms and gauges alone."""
    metrics, port = served
    for report in REPORTS:
        metrics.on_step(report, PROPOSERS.get)
    metrics.on_error("INTERNAL")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "_created" not in text
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"specdec:request_errors_total", "specdec:step_seconds_count", "specdec:pairs"} <= names
    assert metrics.registry.get_sample_value(  # the registry itself keeps them
        "specdec:request_errors_created", {"model_pair": PAIR, "code": "INTERNAL"}
    )
