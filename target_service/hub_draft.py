"""The hub's draft side: which draft service it uses, and which of its requests are admitted
there with how many of their tokens told (`target_service.hub` runs the loop).

A request admitted to the draft service has `on_draft`; `told` of its tokens are known there,
so the next ask carries the rest as new_token_ids. When the draft service fails every request
loses `on_draft` (they run at k = 0) until `replace` admits them to a new one: from the
orchestrator's record where it fits, and the next ask tops up what was committed after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from specdec.pb import draft_pb2, target_pb2
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ModelInfo, check_compatible
from target_service.config import TargetConfig
from target_service.draft_link import DraftDown, DraftLink, PendingAdmits

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HubRequest:
    """The hub's state of one running request."""

    request_id: str
    sampling: SamplingParams
    proposer: str  # "draft", "ngram" or "off"
    num_draft_tokens: int
    tokens: list[int]  # prompt + committed tokens, as the target holds them
    next_step: int
    on_draft: bool = False  # admitted on the current draft service
    told: int = 0  # how many of `tokens` the draft service knows
    max_length: int = 0  # left out of steps once it holds this many tokens; 0: no limit
    fixed_k: bool = False  # keeps num_draft_tokens under dynamic speculation (seeded, sampled)

    @property
    def done(self) -> bool:
        """It holds every token the orchestrator will keep: a step for it would be wasted."""
        return 0 < self.max_length <= len(self.tokens)


Emit = Callable[..., None]  # ServeEvent fields, e.g. emit(draft_down=...)


class DraftSide:
    """The current draft service (or none) of a hub whose requests are `requests`."""

    def __init__(
        self,
        config: TargetConfig,
        target: ModelInfo,
        requests: Mapping[str, HubRequest],
        emit: Emit,
    ):
        self._config, self._target, self._requests, self._emit = config, target, requests, emit
        self.link: DraftLink | None = None

    @property
    def up(self) -> bool:
        return self.link is not None

    def connect(self, address: str) -> str | None:
        """Connects to the draft service at `address` and checks its tokenizer; else why not."""
        c = self._config
        try:
            # read at each connect: a draft that comes back after a certificate rotation works
            root = None if c.draft_tls_root_cert is None else c.draft_tls_root_cert.read_bytes()
            link = DraftLink(
                address, c.server.max_message_bytes, c.draft_wait_s, root, c.draft_tls_server_name
            )
        except OSError as e:
            return f"Reading the draft's TLS root certificate {c.draft_tls_root_cert}: {e}"
        except DraftDown as e:
            return str(e)
        try:
            check_compatible(self._target, link.info)
        except ValueError as e:
            link.close()
            return f"Refusing the draft service at {address}: {e}"
        self.link = link
        return None

    def replace(self, address: str, records: Mapping[str, target_pb2.DraftRecord]) -> None:
        """Leaves the current draft service for the one at `address` (none if empty) and admits
        every PROPOSER_DRAFT request there; answers draft_up or draft_down."""
        self.release([r for r in self._requests.values() if r.on_draft])
        self.close()
        if not address:
            return
        failure = self.connect(address)
        if failure is not None:
            self._emit(draft_down=target_pb2.DraftDown(message=failure))
            return
        self.admit([r for r in self._requests.values() if r.proposer == "draft"], records)
        if self.link is not None:
            self._emit(draft_up=target_pb2.DraftUp(draft=self.link.info.to_pb()))

    def down(self, message: str) -> None:
        """The draft service failed: every request runs at k = 0; draft_down goes out."""
        if self.link is None:
            return
        log.warning("draft service down, requests run at k = 0: %s", message)
        self.close(graceful=False)
        self._emit(draft_down=target_pb2.DraftDown(message=message))

    def close(self, graceful: bool = True) -> None:
        if self.link is not None:
            self.link.close(graceful)
            self.link = None
        for r in self._requests.values():
            r.on_draft = False

    def propose(
        self, asks: list[HubRequest], entries: list[draft_pb2.ProposeEntry]
    ) -> tuple[draft_pb2.ProposeResponse, float] | None:
        """The draft's answer to `entries` (the asks of `asks`) and its round trip; None if the
        draft service failed (it is down now)."""
        assert self.link is not None
        try:
            response, round_trip = self.link.propose(entries)
        except DraftDown as e:
            self.down(str(e))
            return None
        served = set(response.block.request_ids)
        for r, entry in zip(asks, entries, strict=True):
            if r.request_id in served:
                r.told = entry.committed_length
        for err in response.errors:
            log.warning("draft refused %r, it runs at k = 0: %s", err.request_id, err.error.message)
        self.release([self._requests[err.request_id] for err in response.errors
                      if err.request_id in self._requests])  # fmt: skip
        return response, round_trip

    def start_admit(self, admission: AdmitRequest) -> PendingAdmits | None:
        """Admits a new request while the target prefills it; `settle` finishes."""
        return None if self.link is None else self.link.start_admit([admission])

    def admit(self, reqs: list[HubRequest], records: Mapping[str, target_pb2.DraftRecord]) -> None:
        """Admits running requests from their records (or the target's tokens)."""
        if self.link is None or not reqs:
            return
        admissions = []
        for r in reqs:
            record = records.get(r.request_id)
            tokens = record.token_ids[:] if record is not None and _fits(r, record) else r.tokens
            admissions.append(AdmitRequest(r.request_id, tuple(tokens), r.sampling, r.next_step))
        self.settle(self.link.start_admit(admissions), reqs)

    def settle(self, pending: PendingAdmits, reqs: list[HubRequest]) -> None:
        """Waits for draft admissions: `reqs` admitted there go on the draft, the others run at
        k = 0; admissions of requests not in `reqs` (their target admission failed) are undone."""
        try:
            errors = pending.wait()
        except DraftDown as e:
            self.down(str(e))
            return
        told = {a.request_id: len(a.prompt_token_ids) for a in pending.admissions}
        wanted = {r.request_id for r in reqs}
        for r in reqs:
            error = errors.get(r.request_id)
            if error is None:
                r.on_draft, r.told = True, told[r.request_id]
            else:
                log.warning("draft admission of %r failed: %s", r.request_id, error)
        undo = [rid for rid, err in errors.items() if err is None and rid not in wanted]
        self._release_ids(undo)

    def release(self, reqs: list[HubRequest]) -> None:
        """Frees the requests' KV on the draft service; they run at k = 0 if they stay."""
        ids = [r.request_id for r in reqs if r.on_draft]
        for r in reqs:
            r.on_draft = False
        self._release_ids(ids)

    def _release_ids(self, request_ids: list[str]) -> None:
        if not request_ids or self.link is None:
            return
        try:
            self.link.release(request_ids)
        except DraftDown as e:
            self.down(str(e))
        except grpc.RpcError as e:
            log.warning("release on the draft service failed: %s", e)


def _fits(req: HubRequest, record: target_pb2.DraftRecord) -> bool:
    """Whether the record is a past state of the request (a prefix of its tokens)."""
    n = len(record.token_ids)
    ok = 0 < n <= len(req.tokens) and record.next_step <= req.next_step
    if ok and req.tokens[:n] == record.token_ids[:]:
        return True
    log.warning("record of %r does not fit its tokens; using the target's", req.request_id)
    return False
