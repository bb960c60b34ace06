"""The target's torch work: admission (prefill), and verify steps — align a block's proposals
to per-request state, score them all in one ragged forward, run the rejection sampler once per
q form, commit, and roll back rejected KV. No gRPC here.

KV invariant: a request with committed sequence S (length n) holds S[:n-1] in its KV cache. A
verify step forwards [S[n-1], d_1 .. d_k] with k + 1 logits rows (row j scores the token at
absolute position n + j), then keeps S[:n-1] plus the accepted drafts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftProposal, SparseQ, VerifyResult
from specdec.serving.messages import Admission, ErrorReason, ModelInfo, RequestError
from target_service.config import TargetConfig
from target_service.rejection_sampler import (
    DenseProbs,
    RequestSampling,
    SampleStatus,
    SparseProbs,
    rejection_sample,
    status_message,
)

Code = grpc.StatusCode
# SampleStatus → (reason, code, the entry's field the message names)
_SAMPLE_ERRORS = {
    SampleStatus.NONFINITE_LOGITS: (ErrorReason.NONFINITE_LOGITS, Code.INTERNAL, ""),
    SampleStatus.INVALID_DRAFT_PROBS: (
        ErrorReason.INVALID_DRAFT_PROBS,
        Code.INVALID_ARGUMENT,
        ".q",
    ),
    SampleStatus.DRAFT_PROBS_NOT_NORMALIZED: (
        ErrorReason.DRAFT_PROBS_NOT_NORMALIZED,
        Code.INVALID_ARGUMENT,
        ".q",
    ),
    SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT: (
        ErrorReason.DRAFT_TOKEN_OUT_OF_SUPPORT,
        Code.INVALID_ARGUMENT,
        ".q",
    ),
    SampleStatus.TOKEN_OUT_OF_VOCAB: (
        ErrorReason.TOKEN_OUT_OF_VOCAB,
        Code.INVALID_ARGUMENT,
        ".draft_token_ids",
    ),
}


def error_result(
    p: DraftProposal | tuple[str, int], reason: ErrorReason, code: grpc.StatusCode, msg: str
) -> VerifyResult:
    """A VerifyResult that carries only an error."""
    rid, step = (p.request_id, p.step) if isinstance(p, DraftProposal) else p
    return VerifyResult(rid, step, error=RequestError(reason, code, msg))


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + committed tokens
    sampling: SamplingParams
    next_step: int
    last: VerifyResult | None = None  # verdict of next_step - 1, repeated for a duplicate


class TargetEngine:
    """Per-request state plus the runner; one lock serialises steps (the runner is not
    thread-safe)."""

    def __init__(self, runner: ModelRunner, config: TargetConfig):
        self.runner, self.config = runner, config
        self.vocab_size = runner.info.tokenizer_vocab_size or runner.vocab_size
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._device = torch.device(config.runner.device)

    @property
    def info(self) -> ModelInfo:
        i = self.runner.info
        return ModelInfo(
            i.architecture,
            self.runner.vocab_size,
            self.vocab_size,
            i.tokenizer_hash,
            self.config.runner.max_seq_len,
            self.config.runner.max_slots,
            self.config.max_num_draft_tokens,
            self.config.server.max_message_bytes,
            i.dtype,
        )

    def admit(self, adm: Admission) -> tuple[int, int]:
        """Prefills all but the last prompt token; returns (committed_length, next_step)."""
        adm.check_limits(self.vocab_size, self.config.runner.max_seq_len)
        with self._lock:
            if adm.request_id in self._requests:
                raise InvalidInputError(f"request_id {adm.request_id!r} is already admitted.")
            self.runner.add_request(adm.request_id)
            try:
                if len(adm.prompt_token_ids) > 1:
                    item = ForwardItem(adm.request_id, adm.prompt_token_ids[:-1], 0)
                    self.runner.forward([item])
            except BaseException:
                self.runner.release(adm.request_id)
                raise
            tokens = list(adm.prompt_token_ids)
            self._requests[adm.request_id] = _Request(tokens, adm.sampling, adm.first_step)
        return len(tokens), adm.first_step

    def release(self, request_ids: Sequence[str]) -> int:
        with self._lock:
            held = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
            for rid in held:
                del self._requests[rid]
                self.runner.release(rid)
        return len(held)

    def tokens(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._requests[request_id].tokens)

    def verify(self, entries: Sequence[DraftProposal | VerifyResult]) -> list[VerifyResult]:
        """One verdict per entry, in order; entries that are already errors pass through.

        Error messages name the entry by its index in `entries` (the block's order), e.g.
        "entries[3].q: ...".
        """
        with self._lock:
            results: list[VerifyResult | None] = [
                e if isinstance(e, VerifyResult) else None for e in entries
            ]
            counts: dict[str, int] = {}
            for e in entries:
                counts[e.request_id] = counts.get(e.request_id, 0) + 1
            valid: list[tuple[int, DraftProposal]] = []
            for i, e in enumerate(entries):
                if isinstance(e, DraftProposal):
                    results[i] = self._check(i, e, counts[e.request_id])
                    if results[i] is None:
                        valid.append((i, e))
            if valid:
                for i, res in zip((i for i, _ in valid), self._score(valid), strict=True):
                    results[i] = res
            assert all(r is not None for r in results)
            return [r for r in results if r is not None]

    def _check(self, i: int, p: DraftProposal, count: int) -> VerifyResult | None:
        """An error result if entry i does not fit the request's state, else None."""
        req = self._requests.get(p.request_id)
        if count > 1:
            return error_result(
                p,
                ErrorReason.DUPLICATE_ENTRY,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].request_id {p.request_id!r} appears {count} times in the block.",
            )
        if req is None:
            return error_result(
                p,
                ErrorReason.UNKNOWN_REQUEST,
                Code.NOT_FOUND,
                f"entries[{i}].request_id {p.request_id!r} is not admitted.",
            )
        if p.step != req.next_step:
            return _step_error(i, p, req)
        if p.committed_length != len(req.tokens):
            return error_result(
                p,
                ErrorReason.COMMITTED_LENGTH_MISMATCH,
                Code.FAILED_PRECONDITION,
                f"entries[{i}].committed_length is {p.committed_length} but request "
                f"{p.request_id!r} has {len(req.tokens)} committed tokens.",
            )
        return self._check_values(i, p, req)

    def _check_values(self, i: int, p: DraftProposal, req: _Request) -> VerifyResult | None:
        k, limit = p.num_draft_tokens, self.config.max_num_draft_tokens
        if k > limit:
            return error_result(
                p,
                ErrorReason.INVALID_ARGUMENT,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].draft_token_ids has {k} tokens; at most {limit} per step.",
            )
        bad = [t for t in p.draft_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return error_result(
                p,
                ErrorReason.TOKEN_OUT_OF_VOCAB,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].draft_token_ids holds {bad[0]}, outside the vocabulary "
                f"[0, {self.vocab_size}).",
            )
        if len(req.tokens) + k + 1 > self.config.runner.max_seq_len:
            return error_result(
                p,
                ErrorReason.CAPACITY,
                Code.RESOURCE_EXHAUSTED,
                f"entries[{i}]: {len(req.tokens)} committed + {k} draft tokens + 1 would pass "
                f"max_seq_len={self.config.runner.max_seq_len}.",
            )
        return None

    def _score(self, entries: list[tuple[int, DraftProposal]]) -> list[VerifyResult]:
        """Verdicts of (index in the block, proposal) pairs, in order."""
        proposals = [p for _, p in entries]
        items = []
        for p in proposals:
            req = self._requests[p.request_id]
            assert self.runner.cached_length(p.request_id) == len(req.tokens) - 1
            items.append(
                ForwardItem(
                    p.request_id, [req.tokens[-1], *p.draft_token_ids], p.num_draft_tokens + 1
                )
            )
        logits = self.runner.forward(items)  # [sum(k_i + 1), V]
        rows = logits.split([p.num_draft_tokens + 1 for p in proposals])
        results: list[VerifyResult | None] = [None] * len(proposals)
        for group in _group_by_q(proposals).values():
            outs = self._sample([entries[i] for i in group], [rows[i] for i in group])
            for i, res in zip(group, outs, strict=True):
                results[i] = res
        return [r for r in results if r is not None]

    def _sample(
        self, entries: list[tuple[int, DraftProposal]], rows: list[torch.Tensor]
    ) -> list[VerifyResult]:
        """Runs the rejection sampler on proposals sharing one q form, then commits."""
        group = [p for _, p in entries]
        reqs = [self._requests[p.request_id] for p in group]
        dev = self._device
        out = rejection_sample(
            torch.tensor([p.num_draft_tokens for p in group], dtype=torch.int32, device=dev),
            torch.tensor(
                [t for p in group for t in p.draft_token_ids], dtype=torch.int32, device=dev
            ),
            torch.cat(rows),
            _draft_probs(group, dev),
            RequestSampling.from_params(
                [r.sampling for r in reqs], [len(r.tokens) for r in reqs], dev
            ),
            vocab_size=self.vocab_size,
            impl=self.config.sampler_impl,
        )
        status, accepted = out.status.tolist(), out.accepted.tolist()
        return [
            self._commit(i, p, req, out.committed(b), accepted[b][: p.num_draft_tokens], status[b])
            for b, ((i, p), req) in enumerate(zip(entries, reqs, strict=True))
        ]

    def _commit(
        self,
        i: int,
        p: DraftProposal,
        req: _Request,
        tokens: list[int],
        accepted: list[bool],
        status: int,
    ) -> VerifyResult:
        n = len(req.tokens)
        if status != SampleStatus.OK:
            self.runner.truncate(p.request_id, n - 1)
            reason, code, field = _SAMPLE_ERRORS[SampleStatus(status)]
            return error_result(p, reason, code, f"entries[{i}]{field}: {status_message(status)}")
        req.tokens.extend(tokens)
        self.runner.truncate(p.request_id, len(req.tokens) - 1)
        result = VerifyResult(p.request_id, p.step, tuple(tokens), tuple(accepted), len(req.tokens))
        req.next_step, req.last = p.step + 1, result
        return result


def _step_error(i: int, p: DraftProposal, req: _Request) -> VerifyResult:
    if p.step == req.next_step - 1 and req.last is not None:
        msg = (
            f"entries[{i}].step {p.step} of request {p.request_id!r} was already verified; "
            "its verdict repeats."
        )
        err = RequestError(ErrorReason.DUPLICATE_STEP, Code.ALREADY_EXISTS, msg)
        last = req.last
        return VerifyResult(
            p.request_id, p.step, last.token_ids, last.accepted, last.committed_length, err
        )
    reason = ErrorReason.STALE_STEP if p.step < req.next_step else ErrorReason.FUTURE_STEP
    return error_result(
        p,
        reason,
        Code.FAILED_PRECONDITION,
        f"entries[{i}].step is {p.step} but request {p.request_id!r} expects step {req.next_step}.",
    )


def _group_by_q(proposals: list[DraftProposal]) -> dict[object, list[int]]:
    """Indices by q form; dense groups also by width, since one call takes one [T, Vq]."""
    groups: dict[object, list[int]] = {}
    for i, p in enumerate(proposals):
        key: object = "none"
        if isinstance(p.q, DenseQ):
            key = ("dense", p.q.probs.shape[1])
        elif isinstance(p.q, SparseQ):
            key = "sparse"
        groups.setdefault(key, []).append(i)
    return groups


def _draft_probs(group: list[DraftProposal], dev: torch.device) -> DenseProbs | SparseProbs | None:
    qs = [p.q for p in group]
    if all(isinstance(q, DenseQ) for q in qs):
        return DenseProbs(torch.cat([q.probs for q in qs if isinstance(q, DenseQ)]).to(dev))
    sparse = [q for q in qs if isinstance(q, SparseQ)]
    if not sparse:
        return None
    width = max(q.probs.shape[1] for q in sparse)
    pad = [width - q.probs.shape[1] for q in sparse]
    ids = [
        torch.nn.functional.pad(q.token_ids, (0, w), value=-1)
        for q, w in zip(sparse, pad, strict=True)
    ]
    probs = [torch.nn.functional.pad(q.probs, (0, w)) for q, w in zip(sparse, pad, strict=True)]
    return SparseProbs(torch.cat(ids).to(dev), torch.cat(probs).to(dev))
