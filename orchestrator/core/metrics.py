"""Prometheus metrics of the orchestrator, named as vLLM names its own with a `specdec:` prefix.

Speculative decoding (counters labelled `model_pair` and `proposer`, fed from every step's
verdicts, each under the proposer that drafted it; a step with no draft tokens is not a
draft):

    specdec:spec_decode_num_drafts_total                 steps that verified >= 1 draft token
    specdec:spec_decode_num_draft_tokens_total           draft tokens verified
    specdec:spec_decode_num_accepted_tokens_total        draft tokens accepted
    specdec:spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at position i

Acceptance rate and mean acceptance length, one PromQL expression each:

    sum by (model_pair, proposer) (rate(specdec:spec_decode_num_accepted_tokens_total[5m]))
      / (sum by (model_pair, proposer) (rate(specdec:spec_decode_num_draft_tokens_total[5m])) > 0)

    1 + sum by (model_pair, proposer) (rate(specdec:spec_decode_num_accepted_tokens_total[5m]))
      / (sum by (model_pair, proposer) (rate(specdec:spec_decode_num_drafts_total[5m])) > 0)

(`/ (x > 0)`: a proposer idle in the window has no value instead of NaN.)

Requests: histograms specdec:time_to_first_token_seconds, specdec:time_per_output_token_seconds,
specdec:e2e_request_latency_seconds, specdec:request_queue_time_seconds (arrival until sent to a
pair), specdec:request_prefill_time_seconds (the services' own admission time: the target's
prefill, the draft's admission overlapped); counters specdec:prompt_tokens_total,
specdec:generation_tokens_total (counted when a request finishes, from its usage, so they equal
what the responses reported; tokens/s is their rate), specdec:request_success_total
{finish_reason}, specdec:request_errors_total{code} (gRPC status code name); gauges
specdec:num_requests_running, specdec:num_requests_waiting.

Steps of the hub: histograms specdec:step_draft_seconds (the draft's forward time; steps that
used the draft service only), specdec:step_transport_seconds (the Propose round trip minus the
draft's service time; same steps), specdec:step_verify_seconds (target forward),
specdec:step_sampler_seconds (rejection sampler), specdec:step_seconds (the whole step);
counter specdec:steps_total, specdec:eager_steps_total (steps with a forward that ran eagerly:
no captured CUDA graph fitted; every step on a CPU); gauge specdec:draft_up. Draft-ahead:
counters specdec:draft_ahead_hits_total (draft asks answered from drafts made ahead for their
verdict, no forward) and specdec:draft_ahead_misses_total (asks that had drafts made ahead but
none for their verdict); hit rate = hits / (hits + misses); specdec:draft_ahead_backups_total
(misses answered with no drafts, so that their step did not wait for a draft pass);
specdec:draft_ahead_pushed_total (hits taken from chains the draft pushed before the verdict:
the step did not wait for the draft's answer); specdec:draft_ahead_push_backups_total (misses of
the pushed chains verified with no drafts while the step's hits took theirs: among the misses
and the backups). Counter
specdec:draft_busy_seconds_total: the draft services' busy device time, their proposal
forwards plus their passes ahead (admissions not counted), and gauge specdec:pairs, the pairs
the orchestrator runs: `rate()` of the first over the second is the busy fraction of a pair's
draft device, and 1 minus that its idle fraction. Histogram
specdec:step_num_draft_tokens: the k of each step that serves draft-model requests (its largest;
0 where it drafted none), which `--dynamic-speculation` chooses per step.

Faults: counters specdec:draft_fallback_steps_total{reason} (steps in which PROPOSER_DRAFT
requests ran at k = 0 because of the draft: reason "deadline", it did not answer in time and
has not since; "unavailable", it is down) and specdec:draft_fallback_requests_total{reason}
(those requests, once per step), specdec:service_restarts_total{role} (a draft or target
service came back at a new address after Ray restarted it), specdec:serve_reconnects_total (a
pair's Serve stream to its target broke and was opened again).

Every metric lives in the Metrics object's own CollectorRegistry, never the global one.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from orchestrator.core.pair import StepReport
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.proposers import PROPOSERS

PREFIX = "specdec:"
FALLBACK_REASONS = ("deadline", "unavailable")
SERVICE_ROLES = ("draft", "target")
# Seconds; vLLM's request-latency buckets, and step buckets from 0.5 ms (a small verify step).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)  # fmt: skip
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015,
                0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)  # fmt: skip


K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class Metrics:
    """The orchestrator's metrics for one model pair, in their own registry."""

    def __init__(self, model_pair: str, registry: CollectorRegistry | None = None) -> None:
        self.model_pair = model_pair
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        spec = ("model_pair", "proposer")
        self._drafts = self._counter("spec_decode_num_drafts", "Draft steps.", spec)
        self._draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified.", spec
        )
        self._accepted = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec
        )
        self._accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the draft.",
            (*spec, "position"),
        )
        for proposer in PROPOSERS:  # the series exist (at 0) before the first draft
            for counter in (self._drafts, self._draft_tokens, self._accepted):
                counter.labels(model_pair, proposer)
        self._define_request_metrics()
        self._define_step_metrics()

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ("model_pair",)) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Any:
        return Histogram(
            PREFIX + name, doc, ("model_pair",), registry=self.registry, buckets=buckets
        ).labels(self.model_pair)

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(PREFIX + name, doc, ("model_pair",), registry=self.registry).labels(
            self.model_pair
        )

    def _define_request_metrics(self) -> None:
        pair = self.model_pair
        self._ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self._tpot = self._histogram(
            "time_per_output_token_seconds", "Mean time per token after the first.", TPOT_BUCKETS
        )
        self._e2e = self._histogram("e2e_request_latency_seconds", "Arrival to end.", E2E_BUCKETS)
        self._queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival until sent to a pair.", TTFT_BUCKETS
        )
        self._prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "The services' admission time (the target's prefill).",
            TTFT_BUCKETS,
        )
        self._prompt_tokens = self._counter("prompt_tokens", "Prompt tokens.").labels(pair)
        self._generation_tokens = self._counter(
            "generation_tokens", "Generated tokens returned."
        ).labels(pair)
        self._success = self._counter(
            "request_success", "Finished requests.", ("model_pair", "finish_reason")
        )
        self._errors = self._counter(
            "request_errors", "Requests ended by an error status.", ("model_pair", "code")
        )
        self._running = self._gauge("num_requests_running", "Requests admitted to a pair.")
        self._waiting = self._gauge("num_requests_waiting", "Requests queued for admission.")

    def _define_step_metrics(self) -> None:
        self._step_draft = self._histogram(
            "step_draft_seconds", "Draft forward time of a step.", STEP_BUCKETS
        )
        self._step_transport = self._histogram(
            "step_transport_seconds", "Propose round trip minus the draft's time.", STEP_BUCKETS
        )
        self._step_verify = self._histogram(
            "step_verify_seconds", "Target verify forward of a step.", STEP_BUCKETS
        )
        self._step_sampler = self._histogram(
            "step_sampler_seconds", "Rejection sampler time of a step.", STEP_BUCKETS
        )
        self._step = self._histogram("step_seconds", "Hub wall time of a step.", STEP_BUCKETS)
        self._steps = self._counter("steps", "Hub steps.").labels(self.model_pair)
        self._eager_steps = self._counter(
            "eager_steps",
            "Hub steps with a forward that ran eagerly (no captured CUDA graph fitted); every "
            "step on a CPU.",
        ).labels(self.model_pair)
        self._draft_up = self._gauge("draft_up", "1 while the draft service is up.")
        self._step_k = self._histogram(
            "step_num_draft_tokens",
            "Draft tokens per request in a step that serves draft-model requests (the largest "
            "k of the step; 0 where it drafted none): the k dynamic speculation chooses.",
            K_BUCKETS,
        )
        self._ahead_hits = self._counter(
            "draft_ahead_hits", "Draft asks answered from drafts made ahead for their verdict."
        ).labels(self.model_pair)
        self._ahead_misses = self._counter(
            "draft_ahead_misses", "Draft asks with drafts made ahead, none for their verdict."
        ).labels(self.model_pair)
        self._ahead_backups = self._counter(
            "draft_ahead_backups",
            "Draft asks that missed and got a backup proposal of no drafts (the step did not "
            "wait for their drafts).",
        ).labels(self.model_pair)
        self._ahead_pushed = self._counter(
            "draft_ahead_pushed",
            "Draft asks answered from chains the draft pushed before the verdict (the step did "
            "not wait for the draft's answer); among the hits.",
        ).labels(self.model_pair)
        self._ahead_push_backups = self._counter(
            "draft_ahead_push_backups",
            "Draft asks that missed the chains the draft pushed and were verified with no "
            "drafts while the step's hits took theirs (the step did not wait for the draft); "
            "among the misses and the backups.",
        ).labels(self.model_pair)
        self._draft_busy = self._counter(
            "draft_busy_seconds",
            "Seconds the draft services were busy: their proposal forwards plus their passes "
            "ahead (draft-ahead), device time; admissions not counted. rate() / specdec:pairs "
            "is the busy fraction of a pair's draft device.",
        ).labels(self.model_pair)
        self._prefix_queries = self._counter(
            "prefix_cache_queries",
            "Prompt tokens the targets' prefix caches looked up at admission (vLLM's "
            "prefix_cache_queries; 0 with fixed KV slots).",
        ).labels(self.model_pair)
        self._prefix_hits = self._counter(
            "prefix_cache_hits",
            "Prompt tokens found in the targets' prefix caches, not prefilled again (vLLM's "
            "prefix_cache_hits): rate() over prefix_cache_queries' is the hit rate.",
        ).labels(self.model_pair)
        self._pairs = self._gauge("pairs", "Draft/target pairs this orchestrator runs.")
        self._define_fault_metrics()

    def _define_fault_metrics(self) -> None:
        pair = self.model_pair
        self._fallback_steps = self._counter(
            "draft_fallback_steps",
            "Steps in which draft requests ran at k = 0 because of the draft service.",
            ("model_pair", "reason"),
        )
        self._fallback_requests = self._counter(
            "draft_fallback_requests",
            "Draft requests run at k = 0 because of the draft service, once per step.",
            ("model_pair", "reason"),
        )
        for reason in FALLBACK_REASONS:  # the series exist (at 0) before the first fault
            self._fallback_steps.labels(pair, reason)
            self._fallback_requests.labels(pair, reason)
        self._restarts = self._counter(
            "service_restarts", "Services back at a new address after a restart.",
            ("model_pair", "role"),
        )  # fmt: skip
        for role in SERVICE_ROLES:
            self._restarts.labels(pair, role)
        self._reconnects = self._counter(
            "serve_reconnects", "Serve streams to a target opened again after breaking."
        ).labels(pair)

    def on_step(self, report: StepReport, proposer_of: Callable[[str], str | None]) -> None:
        """Counts one hub step's drafts and timings. Each verdict is counted under the proposer
        that drafted it, which the hub names (the request's proposer may have changed since:
        a SetSpeculation sent while the step ran); `proposer_of` maps a request to its proposer
        now, used only where the hub named none, and None for a request the orchestrator no
        longer holds (its verdict is dropped, no response carries it, so it is not counted)."""
        step_k: int | None = None  # the step's k for the draft model's requests
        for event in report.events:
            current = proposer_of(event.request_id)
            if event.error is not None or current is None:
                continue
            if (event.proposer or current) == "draft":
                step_k = max(step_k or 0, event.num_draft_tokens)
            if event.num_draft_tokens == 0:
                continue
            labels = (self.model_pair, event.proposer or current)
            self._drafts.labels(*labels).inc()
            self._draft_tokens.labels(*labels).inc(event.num_draft_tokens)
            self._accepted.labels(*labels).inc(event.num_accepted)
            for pos in range(event.num_accepted):
                self._accepted_per_pos.labels(*labels, str(pos)).inc()
        self._steps.inc()
        if step_k is not None:
            self._step_k.observe(step_k)
        if report.draft_s > 0 or report.draft_ahead_hits:  # the draft service served the step
            self._step_draft.observe(report.draft_s)
            self._step_transport.observe(report.transport_s)
        self._draft_busy.inc(report.draft_s + report.draft_ahead_s)
        self._ahead_hits.inc(report.draft_ahead_hits)
        self._ahead_misses.inc(report.draft_ahead_misses)
        self._ahead_backups.inc(report.draft_ahead_backups)
        self._ahead_pushed.inc(report.draft_ahead_pushed)
        self._ahead_push_backups.inc(report.draft_ahead_push_backups)
        self._prefix_queries.inc(report.prefix_cache_queried_tokens)
        self._prefix_hits.inc(report.prefix_cache_hit_tokens)
        self._step_verify.observe(report.verify_s)
        self._step_sampler.observe(report.sampler_s)
        self._step.observe(report.step_s)
        self._draft_up.set(1 if report.draft_up else 0)
        if not report.graphed:
            self._eager_steps.inc()
        if report.fallback and report.num_fallback_requests:
            self._fallback_steps.labels(self.model_pair, report.fallback).inc()
            self._fallback_requests.labels(self.model_pair, report.fallback).inc(
                report.num_fallback_requests
            )

    def set_pairs(self, pairs: int) -> None:
        self._pairs.set(pairs)

    def on_restart(self, role: str) -> None:
        """A "draft" or "target" service is back at a new address."""
        self._restarts.labels(self.model_pair, role).inc()

    def on_reconnect(self) -> None:
        """A pair's Serve stream was opened again."""
        self._reconnects.inc()

    def on_first_token(self, time_to_first_token_s: float) -> None:
        self._ttft.observe(time_to_first_token_s)

    def on_finish(self, final: generate_pb2.GenerateResponse) -> None:
        """Counts a finished request from its final response (usage, timing, finish reason)."""
        usage, timing = final.usage, final.timing
        self._prompt_tokens.inc(usage.prompt_tokens)
        self._generation_tokens.inc(usage.completion_tokens)
        self._e2e.observe(timing.e2e_s)
        self._queue_time.observe(timing.queue_s)
        if timing.admission_s > 0:  # admitted: else it never reached the services
            self._prefill_time.observe(timing.prefill_s)
        if usage.completion_tokens > 1:
            decode_s = timing.e2e_s - timing.time_to_first_token_s
            self._tpot.observe(decode_s / (usage.completion_tokens - 1))
        reason = generate_pb2.FinishReason.Name(final.finish_reason)
        self._success.labels(self.model_pair, reason.removeprefix("FINISH_REASON_").lower()).inc()

    def on_error(self, code: grpc.StatusCode | str) -> None:
        name = code if isinstance(code, str) else code.name
        self._errors.labels(self.model_pair, name).inc()

    def set_queue(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)


class WithoutCreated:
    """A registry's metrics without their `_created` series: each counter's and histogram's
    creation time, one series per labelled child (92 of 415 lines after the two steps of
    tests/orchestrator/test_metrics.py), which no rule or dashboard of deploy/ reads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():  # fresh Metric objects each time
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def start_metrics_server(
    port: int, host: str = "0.0.0.0", registry: CollectorRegistry | None = None
) -> tuple[Any, int]:
    """Serves `registry` at http://host:port/metrics on a daemon thread; port 0 picks one.

    Always in the classic text format (0.0.4), whatever the scraper's Accept header asks:
    prometheus_client answers a request for OpenMetrics with `specdec:` escaped to `specdec_`,
    and Prometheus 2.x asks for OpenMetrics, so its PromQL would not find the names this module
    documents. Returns the server (stop it with `shutdown()` then `server_close()`) and its port.
    """
    reg = WithoutCreated(registry if registry is not None else CollectorRegistry())

    class Handler(BaseHTTPRequestHandler):
        timeout = 30  # seconds a connection may sit idle before its thread lets it go

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "metrics are at /metrics")
                return
            body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape is noise

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server, int(server.server_port)
