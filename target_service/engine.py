"""The target's torch work: admission (prefill), and verify steps — align a block's entries
(its columns, `ProposalBlock`) to per-request state, score them all in one ragged forward, run the
rejection sampler once per q form on the block's own q tensors, commit, and roll back rejected
KV. The verdicts are written as columns (`Verdicts`). No gRPC here.

KV invariant: a request with committed sequence S (length n) holds S[:n-1] in its KV cache. A
verify step forwards [S[n-1], d_1 .. d_k] with k + 1 logits rows (row j scores the token at
absolute position n + j), then keeps S[:n-1] plus the accepted drafts.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftQ, ProposalBlock, SparseQ
from specdec.serving.messages import Admission, ErrorReason, ModelInfo, RequestError
from specdec.serving.verdicts import Verdicts
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
_INVALID = ErrorReason.INVALID_ARGUMENT, Code.INVALID_ARGUMENT
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


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + committed tokens
    sampling: SamplingParams
    next_step: int
    # next_step - 1's verdict (tokens, num_accepted, k, committed_length), for a repeat
    last: tuple[list[int], int, int, int] | None = None


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

    def verify(self, block: ProposalBlock) -> Verdicts:
        """One verdict per entry, in the block's order.

        Error messages name the entry by its index in the block, e.g. "entries[3].q: ...".
        """
        with self._lock:
            out = Verdicts.pending(block.request_ids, block.steps)
            rids = block.request_ids
            counts = Counter(rids) if len(set(rids)) < len(rids) else None
            in_vocab = _in_vocab(block.draft_token_ids, self.vocab_size)
            valid = [
                i
                for i, rid in enumerate(rids)
                if self._check(block, i, counts[rid] if counts else 1, in_vocab, out)
            ]
            if valid:
                self._score(block, valid, out)
            return out

    def _check(
        self, block: ProposalBlock, i: int, count: int, in_vocab: bool, out: Verdicts
    ) -> bool:
        """True if entry i fits its request's state; else its error verdict goes into `out`."""
        rid, step = block.request_ids[i], block.steps[i]
        req = self._requests.get(rid)
        error = None
        if i in block.errors:  # malformed: the parser's message
            error = RequestError(*_INVALID, block.errors[i])
        elif count > 1:
            error = RequestError(
                ErrorReason.DUPLICATE_ENTRY,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].request_id {rid!r} appears {count} times in the block.",
            )
        elif req is None:
            error = RequestError(
                ErrorReason.UNKNOWN_REQUEST,
                Code.NOT_FOUND,
                f"entries[{i}].request_id {rid!r} is not admitted.",
            )
        elif step != req.next_step:
            error = _step_error(i, rid, step, req)
            if req.last is not None and error.reason == ErrorReason.DUPLICATE_STEP:
                out.commit(i, *req.last)
        elif block.committed_lengths[i] != len(req.tokens):
            error = RequestError(
                ErrorReason.COMMITTED_LENGTH_MISMATCH,
                Code.FAILED_PRECONDITION,
                f"entries[{i}].committed_length is {block.committed_lengths[i]} but request "
                f"{rid!r} has {len(req.tokens)} committed tokens.",
            )
        else:
            error = self._check_values(block, i, req, in_vocab)
        if error is not None:
            out.fail(i, error)
        return error is None

    def _check_values(
        self, block: ProposalBlock, i: int, req: _Request, in_vocab: bool
    ) -> RequestError | None:
        k, limit = block.num_draft_tokens[i], self.config.max_num_draft_tokens
        if k > limit:
            return RequestError(
                ErrorReason.INVALID_ARGUMENT,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].draft_token_ids has {k} tokens; at most {limit} per step.",
            )
        bad = [] if in_vocab else [t for t in block.tokens(i) if not 0 <= t < self.vocab_size]
        if bad:
            return RequestError(
                ErrorReason.TOKEN_OUT_OF_VOCAB,
                Code.INVALID_ARGUMENT,
                f"entries[{i}].draft_token_ids holds {bad[0]}, outside the vocabulary "
                f"[0, {self.vocab_size}).",
            )
        if len(req.tokens) + k + 1 > self.config.runner.max_seq_len:
            return RequestError(
                ErrorReason.CAPACITY,
                Code.RESOURCE_EXHAUSTED,
                f"entries[{i}]: {len(req.tokens)} committed + {k} draft tokens + 1 would pass "
                f"max_seq_len={self.config.runner.max_seq_len}.",
            )
        return None

    def _score(self, block: ProposalBlock, entries: list[int], out: Verdicts) -> None:
        """Scores `entries` (valid, ascending) in one ragged forward, then samples each q form."""
        items = []
        for i in entries:
            rid = block.request_ids[i]
            req = self._requests[rid]
            assert self.runner.cached_length(rid) == len(req.tokens) - 1
            tokens = [req.tokens[-1], *block.tokens(i)]
            items.append(ForwardItem(rid, tokens, block.num_draft_tokens[i] + 1))
        logits = self.runner.forward(items)  # [sum(k_i + 1), V]
        groups: dict[int, list[int]] = {}  # q form → positions in `entries`
        for pos, i in enumerate(entries):
            groups.setdefault(block.q_forms[i], []).append(pos)
        if len(groups) == 1:  # the usual case: the forward's rows are the sampler's as they are
            self._sample(block, next(iter(groups)), entries, logits, out)
            return
        rows = logits.split([block.num_draft_tokens[i] + 1 for i in entries])
        for form, positions in groups.items():
            group = [entries[p] for p in positions]
            self._sample(block, form, group, torch.cat([rows[p] for p in positions]), out)

    def _sample(
        self,
        block: ProposalBlock,
        form: int,
        entries: list[int],
        logits: torch.Tensor,  # [sum(k_i + 1), V] of `entries`
        out: Verdicts,
    ) -> None:
        """Runs the rejection sampler on `entries` (ascending, of one q form), then commits."""
        reqs = [self._requests[block.request_ids[i]] for i in entries]
        ks = [block.num_draft_tokens[i] for i in entries]
        dev = self._device
        sampled = rejection_sample(
            torch.tensor(ks, dtype=torch.int32, device=dev),
            torch.tensor(block.draft_tokens(entries), dtype=torch.int32, device=dev),
            logits,
            _draft_probs(block.q_rows(form, entries), dev),
            RequestSampling.from_params(
                [r.sampling for r in reqs], [len(r.tokens) for r in reqs], dev
            ),
            vocab_size=self.vocab_size,
            impl=self.config.sampler_impl,
        )
        status, counts = sampled.status.tolist(), sampled.num_committed.tolist()
        tokens, accepted = sampled.token_ids.tolist(), sampled.accepted.tolist()
        for b, (i, req) in enumerate(zip(entries, reqs, strict=True)):
            committed, flags = tokens[b][: counts[b]], accepted[b][: ks[b]]
            self._commit(block, i, req, committed, flags, status[b], out)

    def _commit(
        self,
        block: ProposalBlock,
        i: int,
        req: _Request,
        tokens: list[int],
        accepted: list[bool],
        status: int,
        out: Verdicts,
    ) -> None:
        rid = block.request_ids[i]
        if status != SampleStatus.OK:
            self.runner.truncate(rid, len(req.tokens) - 1)
            reason, code, field = _SAMPLE_ERRORS[SampleStatus(status)]
            message = f"entries[{i}]{field}: {status_message(status)}"
            out.fail(i, RequestError(reason, code, message))
            return
        num_accepted = accepted.count(True)
        assert len(tokens) == num_accepted + 1, "the sampler stops at the first rejection"
        req.tokens.extend(tokens)
        self.runner.truncate(rid, len(req.tokens) - 1)
        req.next_step = block.steps[i] + 1
        req.last = (tokens, num_accepted, len(accepted), len(req.tokens))
        out.commit(i, *req.last)


def _step_error(i: int, rid: str, step: int, req: _Request) -> RequestError:
    if step == req.next_step - 1 and req.last is not None:
        return RequestError(
            ErrorReason.DUPLICATE_STEP,
            Code.ALREADY_EXISTS,
            f"entries[{i}].step {step} of request {rid!r} was already verified; "
            "its verdict repeats.",
        )
    reason = ErrorReason.STALE_STEP if step < req.next_step else ErrorReason.FUTURE_STEP
    return RequestError(
        reason,
        Code.FAILED_PRECONDITION,
        f"entries[{i}].step is {step} but request {rid!r} expects step {req.next_step}.",
    )


def _in_vocab(token_ids: list[int], vocab_size: int) -> bool:
    return not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size)


def _draft_probs(q: DraftQ, dev: torch.device) -> DenseProbs | SparseProbs | None:
    if isinstance(q, DenseQ):
        return DenseProbs(q.probs.to(dev))
    if isinstance(q, SparseQ):
        return SparseProbs(q.token_ids.to(dev), q.probs.to(dev))
    return None
