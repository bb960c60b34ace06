"""`specdec serve`: the client API in front of Ray-placed service pairs.

Start-up order: the gRPC server binds first and answers health NOT_SERVING (and UNAVAILABLE to
requests) while Ray places the pairs and their services load and warm up; each pair's hub
stream opens, the scheduler starts, then health turns SERVING. Stop, one drain for both client
ports: gRPC health NOT_SERVING and HTTP /health 503 for `drain_s` while both ports still take
calls (a load balancer notices before any call is refused), then both refuse new calls and
those in flight, gRPC and HTTP, get `grace_s` (requests still running just before it ends
finish with FINISH_REASON_CANCELLED), then the hubs' streams close (releasing everything on the
services), the actors stop, and a Ray cluster this process started shuts down. A second stop
waits for the first to end.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
import ray

from orchestrator.config import ServeConfig
from orchestrator.core.detokenizer import TextTokenizer, check_shared_tokenizer, eos_token_ids
from orchestrator.core.frontend import Backend, Frontend
from orchestrator.core.metrics import Metrics, start_metrics_server
from orchestrator.core.pair import PairClient
from orchestrator.core.requests import Served, served_model_pb
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.servicer import SERVICE_NAME, GenerateServicer, add_to_server
from orchestrator.launch.placement import PairPlacement, Placement, connect
from orchestrator.launch.ports import bind, port_error, probe
from orchestrator.launch.ray_start import descendants, stop_processes
from orchestrator.launch.reaper import start_reaper, stop_reaper
from orchestrator.web.chat import ChatTemplate
from specdec.pb import common_pb2, draft_pb2_grpc
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.auth import ApiKeyInterceptor
from specdec.serving.client import make_channel
from specdec.serving.messages import ModelInfo
from specdec.serving.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Server,
    ServerConfig,
    stop_on_signal,
)

if TYPE_CHECKING:
    from orchestrator.web.server import HttpServer

log = logging.getLogger(__name__)
# grpc core holds calls that arrive faster than the Python server's poll thread takes them (one
# at a time) and drops them with a bare CANCELLED past grpc.server.max_pending_requests (1000,
# then at random up to 3000): 2,000 Generate calls opened at once on one channel lost ~10%.
# The poll thread takes ~7,500 calls/s and each one it takes runs or is refused with
# RESOURCE_EXHAUSTED (max_concurrent_calls), so this backlog only buffers a burst.
MAX_PENDING_CALLS = 1 << 16
MIN_WINDOW_BYTES = 64 * 1024  # HTTP/2's default stream window
# seconds Ray may take past the services' grace to stop them and the local cluster: 2 to 4 s on
# a CPU machine, more where actors hold GPUs
RAY_STOP_S = 20.0
SERVE_RETRY_S = 0.1  # between attempts to open a Serve stream the target still holds


class ApiServerConfig(ServerConfig):
    """The client API's server: grpc core's backlog of not yet taken calls raised, and
    max_message_bytes bounding what it receives only (a Complete response may be larger).
    A stream's receive window is one largest request and stays so (no BDP probing): a client
    sending 20 MB got 4 MiB into the server before its refusal, now max_message_bytes."""

    __slots__ = ()

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.http2.lookahead_bytes", max(self.max_message_bytes, MIN_WINDOW_BYTES)),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
            # grpc sets SO_REUSEPORT by default: a second server on the same port would bind
            # too and take half of the new connections
            ("grpc.so_reuseport", 0),
        ]


def served_limits(config: ServeConfig, target: ModelInfo, draft: ModelInfo | None) -> Served:
    """The limits every request is checked against: the tighter of the two services'."""
    max_k = min(config.services.max_num_draft_tokens, target.max_num_draft_tokens)
    max_seq_len = target.max_seq_len
    if draft is not None:
        max_k = min(max_k, draft.max_num_draft_tokens)
        max_seq_len = min(max_seq_len, draft.max_seq_len)
    return Served(
        name=config.model_name,
        vocab_size=target.tokenizer_vocab_size,
        max_seq_len=max_seq_len,
        max_num_draft_tokens=max_k,
        default_proposer=config.scheduler.proposer,
        default_num_draft_tokens=min(config.scheduler.num_draft_tokens, max_k),
        has_draft=draft is not None,
        eos_token_ids=eos_token_ids(config.services.target),
    )


@dataclass(frozen=True, slots=True)
class ServiceTls:
    """How the orchestrator's channels reach the services: all None is plaintext."""

    root_cert: bytes | None = None  # the CA (PEM) they trust
    server_name: str | None = None  # the name checked in the services' certificate
    identity: tuple[bytes, bytes] | None = None  # (cert chain, key) presented: mutual TLS


def pair_capacity(pair: PairPlacement) -> int:
    if pair.draft_info is None:
        return pair.target_info.max_requests
    return min(pair.target_info.max_requests, pair.draft_info.max_requests)


def release_on(address: str, request_ids: list[str], tls: ServiceTls) -> None:
    """Releases requests on a draft service directly (best effort: it may be down too)."""
    try:
        with make_channel(address, tls_root_cert=tls.root_cert, tls_server_name=tls.server_name,
                          tls_identity=tls.identity) as channel:  # fmt: skip
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            stub.Release(common_pb2.ReleaseRequest(request_ids=request_ids), timeout=10.0)
    except grpc.RpcError as e:
        log.warning("releasing %d request(s) on the draft at %s: %s", len(request_ids),
                    address, e.code())  # fmt: skip


def _draft_down(sched: Scheduler, index: int, linked: threading.Event) -> None:
    linked.set()  # start-up waits for the first answer to SetDraft, up or down
    sched.post_draft_down(index)


class Orchestrator:
    """Owns the client-facing server, the placement, the pair clients and the scheduler."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = Metrics(config.model_name)
        self.metrics.set_pairs(config.placement.pairs)
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self.http_port: int | None = None
        self._http: HttpServer | None = None  # with --http-port
        self.frontend = Frontend(config.max_concurrent_calls)
        self.servicer = GenerateServicer(self.frontend)
        self.server = Server(
            ApiServerConfig(
                host=config.host,
                port=config.port,
                grace_s=config.grace_s,  # drain_s 0: `stop` drains both ports itself
                max_workers=config.max_workers,
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
                tls_client_ca=config.tls_client_ca,
                max_message_bytes=config.request_bytes,
            ),
            [SERVICE_NAME],
            lambda s: add_to_server(self.servicer, s),
            [] if config.api_key is None else [ApiKeyInterceptor(config.api_key)],
        )
        self.placement = Placement(config.placement, config.services)
        self.clients: list[PairClient] = []
        self.scheduler: Scheduler | None = None
        self._owns_ray = False
        self._reaper: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()
        self._done = threading.Event()  # the stop has ended
        self._stop_lock = threading.Lock()
        self._stopper = 0  # the thread that runs the stop
        self.ray_stuck = False  # Ray did not answer the stop (see _stop_ray)

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> int:
        """Binds every port, places and connects every pair, then SERVING; returns the gRPC
        port. A draft whose tokenizer differs from the target's is refused (ValueError) before
        anything starts; a port that cannot be bound raises PortError before Ray is touched;
        any failure stops what had started."""
        services = self.config.services
        if services.draft is not None:
            check_shared_tokenizer(services.target, services.draft)
        try:
            port = self._bind()
            before = descendants()
            self._owns_ray = connect(self.config.placement, self.placement.services_per_pair)
            if self._owns_ray:  # the cluster ends with this process, however it ends
                self._reaper = start_reaper(descendants() - before)
            pairs = self.placement.start()
            self._connect(pairs)
        except BaseException:
            self.stop(0.0, drain_s=0.0)
            raise
        self._set_serving(True)
        log.info("serving %d pair(s) of %s", len(pairs), self.config.model_name)
        return port

    def _bind(self) -> int:
        """The client API's, the metrics' and the HTTP API's ports, listening."""
        host = self.config.host
        try:
            port = self.server.start()
        except (RuntimeError, OSError):
            raise probe(host, self.config.port, "--port") from None
        log.info("GenerateService on port %d (NOT_SERVING until the services are warm)", port)
        if self.config.metrics_port is not None:
            try:
                self._metrics_server, self.metrics_port = start_metrics_server(
                    self.config.metrics_port, host, self.metrics.registry
                )
            except OSError as e:
                raise port_error(host, self.config.metrics_port, "--metrics-port", e) from None
            log.info("metrics on http://%s:%d/metrics", host, self.metrics_port)
        if self.config.http_port is not None:
            self._http = self._http_server()
            self.http_port = self._http.port
            self._http.start()
            log.info("OpenAI-compatible HTTP API on %s", self.http_url)
        return port

    def _http_server(self) -> HttpServer:
        """The HTTP API on its bound port, with the gRPC port's TLS (not yet started)."""
        from orchestrator.web.api import HttpApi  # Starlette and uvicorn only with --http-port
        from orchestrator.web.limits import CONNECTIONS_PER_CALL
        from orchestrator.web.server import HttpServer, TlsFiles

        c = self.config
        sock = bind(c.host, c.http_port or 0, "--http-port")
        tls = None if c.tls_cert is None or c.tls_key is None else (
            TlsFiles(c.tls_cert, c.tls_key, c.tls_client_ca))  # fmt: skip
        template = ChatTemplate.from_dir(c.services.target)
        api = HttpApi(self.frontend, template, c.api_key, max_request_bytes=c.request_bytes)
        connections = CONNECTIONS_PER_CALL * c.max_concurrent_calls
        return HttpServer(api.app, sock, c.grace_s, tls, max_connections=connections)

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL (https with --tls-cert); None without --http-port."""
        if self._http is None:
            return None
        return f"{self._http.scheme}://{self.config.host}:{self._http.port}/v1"

    def _connect(self, pairs: list[PairPlacement]) -> None:
        served = served_limits(self.config, pairs[0].target_info, pairs[0].draft_info)
        tokenizer = TextTokenizer.from_dir(self.config.services.target)
        sched = Scheduler(
            [pair_capacity(p) for p in pairs],
            self.config.scheduler.max_queue,
            has_draft=served.has_draft,
            recover=self._recover,
            reconnect=self._reconnect,
            observer=self.metrics,
            on_serving=self._set_serving,
        )
        self.scheduler = sched
        for p in pairs:
            self.clients.append(self._client(sched, p))
            sched.attach(p.index, self.clients[-1])
        sched.start()
        self.frontend.backend = Backend(
            sched, served, tokenizer, lambda: self.model_info(served), self.metrics
        )

    def _client(self, sched: Scheduler, p: PairPlacement) -> PairClient:
        """A hub stream to pair p's target, linked to its draft (waits for draft_up)."""
        i, linked = p.index, threading.Event()
        tls = self._service_tls()
        open_stream = partial(
            PairClient,
            p.target_address,
            on_step=partial(sched.post_step, i),
            on_admitted=partial(sched.post_admitted, i),
            on_draft_down=partial(_draft_down, sched, i, linked),
            on_draft_up=linked.set,
            on_close=partial(sched.post_closed, i),
            tls_root_cert=tls.root_cert,
            tls_server_name=tls.server_name,
            tls_identity=tls.identity,
        )
        # After a broken stream the target's old hub ends after its current step (it
        # releases its requests on both services first); until then it refuses a new one.
        deadline = time.monotonic() + self.config.placement.restart_timeout_s
        while True:
            try:
                client = open_stream()
                break
            except ConnectionError as e:
                if "FAILED_PRECONDITION" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(SERVE_RETRY_S)
        if p.draft_address is not None:
            client.set_draft(p.draft_address, {})
            if not linked.wait(self.config.placement.start_timeout_s) or not client.draft_up:
                client.close()
                raise RuntimeError(
                    f"The target of pair {i} could not reach its draft at {p.draft_address}."
                )
        return client

    def _service_tls(self) -> ServiceTls:
        """The TLS of channels to the services, read at each connect, so that services
        restarted after a rotation are trusted."""
        s = self.config.services
        if s.tls_root_cert is None:
            return ServiceTls()
        identity = None
        if s.tls_client_cert is not None and s.tls_client_key is not None:
            identity = (s.tls_client_cert.read_bytes(), s.tls_client_key.read_bytes())
        return ServiceTls(s.tls_root_cert.read_bytes(), s.tls_server_name, identity)

    def _set_serving(self, serving: bool) -> None:
        if not self._stopped.is_set():  # shutdown owns health from then on
            self.server.set_serving(serving)
            self.frontend.serving = serving

    def _recover(self, index: int) -> str:
        pair = self.placement.pairs[index]
        old = pair.draft_address
        address, _ = self.placement.wait_draft(pair)
        if address != old:
            self.metrics.on_restart("draft")
        return address

    def _reconnect(self, index: int, request_ids: list[str]) -> PairClient:
        """A client to pair `index`'s restarted target. The dead hub could not release its
        requests on the draft, so that is done here before the new hub admits them again."""
        pair = self.placement.pairs[index]
        old_address = pair.target_address
        self.placement.wait_target(pair)
        if pair.target_address != old_address:
            self.metrics.on_restart("target")
        if pair.draft_address is not None and request_ids:
            release_on(pair.draft_address, request_ids, self._service_tls())
        assert self.scheduler is not None
        client = self._client(self.scheduler, pair)
        self.clients[index], old = client, self.clients[index]
        old.close()
        self.metrics.on_reconnect()
        return client

    def model_info(self, served: Served) -> generate_pb2.ServedModelInfo:
        target, draft = self.clients[0].model_info()
        draft_up = served.has_draft and all(c.draft_up for c in self.clients)
        pb = served_model_pb(
            served, self.config.services.target, self.config.services.draft, target, draft, draft_up
        )
        return generate_pb2.ServedModelInfo(models=[pb])

    def stop(self, grace_s: float | None = None, drain_s: float | None = None) -> None:
        """Graceful stop (see the module docstring). `grace_s` and `drain_s` default to the
        config's. A call while a stop is under way (a SIGTERM's, on its own thread) returns
        when that one has ended, with its drain and grace, not at once."""
        with self._stop_lock:
            first = not self._stopped.is_set()
            if first:
                self._stopped.set()
                self._stopper = threading.get_ident()
        if not first:
            if threading.get_ident() != self._stopper:  # the stop's own thread cannot wait
                self._done.wait()
            return
        try:
            self._stop(grace_s, drain_s)
        finally:
            self._done.set()

    def _stop(self, grace_s: float | None, drain_s: float | None) -> None:
        self.placement.stopping.set()  # a pair that dies now is not restarted
        self.server.set_serving(False)  # gRPC health; HTTP /health follows `frontend.serving`
        self.frontend.serving = False
        drain = self.config.drain_s if drain_s is None else drain_s
        if drain > 0:
            log.info("draining: NOT_SERVING for %.1f s, calls still taken", drain)
            time.sleep(drain)
        grace = self.config.grace_s if grace_s is None else grace_s
        self._end_calls(grace)
        for client in self.clients:
            client.close()
        self._stop_ray(min(grace, 5.0))
        if self._reaper is not None:
            stop_reaper(self._reaper)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def _end_calls(self, grace_s: float) -> None:
        """Both ports refuse new calls; the calls in flight, gRPC and HTTP, get `grace_s` to
        finish, and the scheduler ends what still runs just before it ends."""
        deadline = time.monotonic() + grace_s
        if self._http is not None:
            self._http.begin_stop()
        sched = self.scheduler
        timer = None
        if sched is not None:
            timer = threading.Timer(max(0.0, grace_s - 0.5), sched.stop)
            timer.start()
        self.server.stop(grace_s)  # returns once its calls ended, or at the deadline
        if self._http is not None:  # the HTTP calls run on meanwhile, on their own thread
            self._http.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if timer is not None:
            timer.cancel()
        if sched is not None:
            sched.stop()

    def _stop_ray(self, grace_s: float) -> None:
        """Stops the services and a Ray cluster this process started, within RAY_STOP_S more.
        Where Ray's processes were stopped from outside (a SIGTERM to every process of a
        systemd unit with KillMode=control-group, or of the session), Ray's calls wait 60 s for
        its GCS and then end the process: past the deadline this process's Ray processes are
        stopped instead, and `ray_stuck` tells the command to exit at once."""
        done = threading.Event()

        def stop() -> None:
            try:
                self.placement.stop(grace_s)
                if self._owns_ray and ray.is_initialized():
                    ray.shutdown()
            except Exception:  # logged; the processes are swept below only if Ray hangs
                log.exception("stopping the services and the Ray cluster failed")
            finally:
                done.set()

        threading.Thread(target=stop, name="stop-ray", daemon=True).start()
        if done.wait(grace_s + RAY_STOP_S):
            return
        self.ray_stuck = True
        log.warning("Ray did not answer within %.0f s of the stop (were its processes stopped "
                    "from outside?); stopping them", grace_s + RAY_STOP_S)  # fmt: skip
        if self._owns_ray:
            stop_processes(descendants())

    def wait(self) -> None:
        self.server.wait()

    def serve_until_signal(self, announce: Callable[[], object] = lambda: None) -> None:
        """Blocks until SIGTERM or SIGINT, then stops gracefully. `announce` (saying it serves)
        runs once the handler is ours: until then it is Ray's (set by ray.init), which exits at
        once (a crash inside Ray, exit code 139, for a SIGTERM sent as soon as the announcement
        was read)."""
        stop_on_signal(self.stop, self.config.grace_s)
        announce()
        self.server.wait()
        self._done.wait()
