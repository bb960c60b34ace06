"""The target's torch work: admission (prefill), and verify steps — align a block's entries
(its columns, `DraftBlock`) to per-request state, score them all in one ragged forward, run the
rejection sampler once per q form on the block's own q tensors, commit, and roll back rejected
KV. The verdicts are written as columns (`VerifyResponse`). No gRPC here.

KV invariant: a request with committed sequence S (length n) holds S[:n-1] in its KV cache. A
verify step forwards [S[n-1], d_1 .. d_k] with k + 1 logits rows (row j scores the token at
absolute position n + j), then keeps S[:n-1] plus the accepted drafts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import CacheFullError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.runner.blocks import CacheStats
from specdec.runner.runner import on_device
from specdec.runner.timing import StepClock, StepTimes
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftBlock, DraftQ, SparseQ
from specdec.serving.checks import (
    committed_length_mismatch,
    duplicate_entry,
    over_capacity,
    step_error,
    token_out_of_vocab,
    too_many_drafts,
    unknown_request,
)
from specdec.serving.messages import AdmitRequest, ErrorReason, ModelInfo, QForm, RequestError
from specdec.serving.verdicts import VerifyResponse
from target_service.batch_layout import upload
from target_service.config import TargetConfig
from target_service.rejection_sampler import (
    HostShape,
    RequestSampling,
    SampleStatus,
    rejection_sample,
    status_message,
)

log = logging.getLogger(__name__)
# SampleStatus → (reason, the entry's field the message names)
_SAMPLE_ERRORS = {
    SampleStatus.NONFINITE_LOGITS: (ErrorReason.NONFINITE_LOGITS, ""),
    SampleStatus.INVALID_DRAFT_PROBS: (ErrorReason.INVALID_DRAFT_PROBS, ".q"),
    SampleStatus.DRAFT_PROBS_NOT_NORMALIZED: (ErrorReason.DRAFT_PROBS_NOT_NORMALIZED, ".q"),
    SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT: (ErrorReason.DRAFT_TOKEN_OUT_OF_SUPPORT, ".q"),
    SampleStatus.TOKEN_OUT_OF_VOCAB: (ErrorReason.TOKEN_OUT_OF_VOCAB, ".draft_token_ids"),
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
        # prompts prefilled a chunk at a time (`begin_prefill`): each with the tokens its KV holds
        self._prefilling: dict[str, tuple[_Request, int]] = {}
        self._lock = threading.Lock()
        self._device = runner.device

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

    def admit(self, adm: AdmitRequest) -> tuple[int, int]:
        """Prefills all but the last prompt token; returns (committed_length, next_step)."""
        adm.check_limits(self.vocab_size, self.config.runner.max_seq_len)
        with self._lock:
            self._check_new(adm.request_id)
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

    def admit_decoding(self, adm: AdmitRequest) -> tuple[VerifyResponse, StepTimes]:
        """Admits the request and decodes its first token in the prefill's own forward.

        The prompt's last position is sampled exactly as a verify step of k = 0 at `first_step`
        samples it (the same sampler, sampling parameters and random stream), without that
        step's second pass over the weights. Returns the verdict of step `first_step`; when it
        is an error (the sampler refused the logits) or anything raises, nothing stays admitted.
        """
        adm.check_limits(self.vocab_size, self.config.runner.max_seq_len)
        rid = adm.request_id
        with self._lock, on_device(self.runner.device):  # the sampler's kernels too
            self._check_new(rid)
            self.runner.add_request(rid)
            req = _Request(list(adm.prompt_token_ids), adm.sampling, adm.first_step)
            return self._decode_first(rid, req, 0)

    def _decode_first(self, rid: str, req: _Request, held: int) -> tuple[VerifyResponse, StepTimes]:
        """Admits `req` (its KV slot taken, `held` tokens in it) with its first token decoded
        (`_prefill_step`); if that raises, or its verdict is an error, nothing stays admitted."""
        self._requests[rid] = req
        try:
            out, times = self._prefill_step(rid, req, held)
        except BaseException:
            del self._requests[rid]
            self.runner.release(rid)
            raise
        if out.errors:
            del self._requests[rid]
            self.runner.release(rid)
        return out, times

    def _check_new(self, rid: str) -> None:
        if rid in self._requests or rid in self._prefilling:
            raise InvalidInputError(f"request_id {rid!r} is already admitted.")

    def begin_prefill(self, adm: AdmitRequest) -> None:
        """Admits a new request whose prompt is then prefilled over several calls of
        `prefill_chunk` (chunked prefill: other requests' steps run between them). With prefix
        caching, its cached start is taken now, and only the rest is computed."""
        adm.check_limits(self.vocab_size, self.config.runner.max_seq_len)
        rid = adm.request_id
        with self._lock, on_device(self.runner.device):
            self._check_new(rid)
            self.runner.add_request(rid)
            try:
                held = self.runner.take_prefix(rid, adm.prompt_token_ids)
                self._check_room_for_rest(rid, len(adm.prompt_token_ids) - held)
            except BaseException:
                self.runner.release(rid)
                raise
            req = _Request(list(adm.prompt_token_ids), adm.sampling, adm.first_step)
            self._prefilling[rid] = (req, held)

    def _check_room_for_rest(self, rid: str, rest: int) -> None:
        """CacheFullError unless a paged cache's free blocks hold the prompt's `rest` tokens
        and a block more for each running request: a chunked prompt takes its blocks chunk by
        chunk, and would otherwise take those the running requests' next steps need (they would
        fail with CAPACITY before it did). It yields to them instead, as a whole prefill that
        does not fit is refused before it takes anything."""
        free = self.runner.free_kv_blocks
        if free is None:
            return
        need = self.runner.kv_blocks_needed(rid, rest) + len(self._requests)
        if need > free:
            raise CacheFullError(
                f"No free KV blocks for request {rid!r}'s prompt: its {rest} tokens still to "
                f"prefill and the {len(self._requests)} running requests' next steps need "
                f"{need} blocks, {free} are free."
            )

    def prefill_chunk(self, rid: str, budget: int) -> tuple[VerifyResponse, StepTimes] | None:
        """The next at most `budget` prompt tokens of a request from `begin_prefill`: None
        while more remain; with the last, its first token, decoded as `admit_decoding` decodes
        it (the same verdict of step `first_step`), and the request is admitted. If anything
        raises, or the verdict is an error, nothing stays admitted."""
        with self._lock, on_device(self.runner.device):
            req, held = self._prefilling[rid]
            try:
                self._check_room_for_rest(rid, len(req.tokens) - held)
                if len(req.tokens) - held > budget:
                    self.runner.forward([ForwardItem(rid, req.tokens[held : held + budget], 0)])
                    self._prefilling[rid] = (req, held + budget)
                    return None
            except BaseException:
                del self._prefilling[rid]
                self.runner.release(rid)
                raise
            del self._prefilling[rid]
            return self._decode_first(rid, req, held)

    def _prefill_step(
        self, rid: str, req: _Request, held: int = 0
    ) -> tuple[VerifyResponse, StepTimes]:
        """The forward of the prompt past the `held` tokens the KV has, and its last
        position's sample: the verdict of step `req.next_step`."""
        clock = StepClock(self._device)
        clock.mark()
        logits = self.runner.forward([ForwardItem(rid, req.tokens[held:], 1)])  # [1, V]
        clock.mark()
        n = len(req.tokens)
        block = DraftBlock.build([rid], [req.next_step], [n], [0], [int(QForm.NONE)], [])
        packed = self._sample(block, int(QForm.NONE), [0], [0], [req], logits[:, None, :])
        clock.mark()
        out = VerifyResponse.pending(block.request_ids, block.steps)
        [result] = self.runner.to_host(packed)
        self._commit_group(block, [0], [0], [req], result.tolist(), out)
        return out, StepTimes(
            clock.seconds(0, 1, "prefill"), clock.seconds(1, 2, "sampler"), graphed=False
        )

    def release(self, request_ids: Sequence[str]) -> int:
        with self._lock:
            held = [rid for rid in dict.fromkeys(request_ids)
                    if rid in self._requests or rid in self._prefilling]  # fmt: skip
            for rid in held:
                self._requests.pop(rid, None)
                self._prefilling.pop(rid, None)
                self.runner.release(rid)
        return len(held)

    def tokens(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._requests[request_id].tokens)

    @property
    def prefix_cache_stats(self) -> CacheStats | None:
        """The runner's prefix cache counts since it started (None with fixed KV slots)."""
        return self.runner.prefix_cache_stats

    def verify(self, block: DraftBlock) -> VerifyResponse:
        """One verdict per entry, in the block's order.

        Error messages name the entry by its index in the block, e.g. "entries[3].q: ...".
        """
        return self.verify_timed(block)[0]

    def verify_timed(
        self, block: DraftBlock, launched: Callable[[], None] | None = None
    ) -> tuple[VerifyResponse, StepTimes]:
        """`verify`, and where the step's time went on the device. `launched` is called once
        the step's device work is queued, just before the host waits for it: the hub sends
        the draft a block there, so that gRPC's threads take the GIL while this one waits on
        the device, not while it launches (not called where no entry is scored, or the step
        failed before)."""
        with self._lock, on_device(self.runner.device):  # the sampler's kernels too
            out = VerifyResponse.pending(block.request_ids, block.steps)
            rids = block.request_ids
            counts = Counter(rids) if len(set(rids)) < len(rids) else None
            in_vocab = _in_vocab(block.draft_token_ids, self.vocab_size)
            valid = [
                i
                for i, rid in enumerate(rids)
                if self._check(block, i, counts[rid] if counts else 1, in_vocab, out)
            ]
            valid = self._within_kv_blocks(block, valid, out)
            times = self._score_safely(block, valid, out, launched) if valid else StepTimes()
            return out, times

    def _within_kv_blocks(
        self, block: DraftBlock, entries: list[int], out: VerifyResponse
    ) -> list[int]:
        """The entries whose steps a paged KV cache can hold at once, in block order; each
        one past that gets a CAPACITY verdict (its request unchanged), so that the others'
        step is served. A row takes blocks for its own k + 1 positions (a graphed step's
        padding goes past them, into positions no block of it holds)."""
        free = self.runner.free_kv_blocks
        if free is None or not entries:
            return entries
        needs = [
            self.runner.kv_blocks_needed(block.request_ids[i], block.num_draft_tokens[i] + 1)
            for i in entries
        ]
        kept = len(entries)
        while kept and sum(needs[:kept]) > free:
            kept -= 1
            i = entries[kept]
            out.fail(i, RequestError.of(ErrorReason.CAPACITY, (
                f"entries[{i}]: the KV cache has no free blocks for request "
                f"{block.request_ids[i]!r}'s step ({needs[kept]} needed; the step's requests "
                f"before it take the {free} free); release requests or give the cache more "
                f"blocks (--kv-blocks)."
            )))  # fmt: skip
        return entries[:kept]

    def _check(
        self, block: DraftBlock, i: int, count: int, in_vocab: bool, out: VerifyResponse
    ) -> bool:
        """True if entry i fits its request's state; else its error verdict goes into `out`."""
        error = self._entry_error(block, i, count, in_vocab, out)
        if error is not None:
            out.fail(i, error)
        return error is None

    def _entry_error(
        self, block: DraftBlock, i: int, count: int, in_vocab: bool, out: VerifyResponse
    ) -> RequestError | None:
        """Entry i's error, or None. A repeat of the last verified step has its verdict
        replayed into `out` before its DUPLICATE_STEP error."""
        if i in block.errors:  # malformed: the parser's message
            return RequestError.of(ErrorReason.INVALID_ARGUMENT, block.errors[i])
        rid, step, entry = block.request_ids[i], block.steps[i], f"entries[{i}]"
        error = duplicate_entry(rid, count, entry) or unknown_request(rid, self._requests, entry)
        if error is not None:
            return error
        req = self._requests[rid]
        if step == req.next_step - 1 and req.last is not None:
            out.commit(i, *req.last)
            return RequestError.of(
                ErrorReason.DUPLICATE_STEP,
                f"{entry}.step {step} of request {rid!r} was already verified; "
                "its verdict repeats.",
            )
        k, n = block.num_draft_tokens[i], len(req.tokens)
        drafts = () if in_vocab else block.tokens(i)
        return (
            step_error(req.next_step, step, rid, entry)
            or committed_length_mismatch(n, block.committed_lengths[i], rid, entry)
            or too_many_drafts(k, self.config.max_num_draft_tokens, "draft_token_ids", entry)
            or token_out_of_vocab(drafts, self.vocab_size, "draft_token_ids", entry)
            or over_capacity(n, k, self.config.runner.max_seq_len, entry, bonus=True)
        )

    def _score_safely(
        self,
        block: DraftBlock,
        entries: list[int],
        out: VerifyResponse,
        launched: Callable[[], None] | None = None,
    ) -> StepTimes:
        """`_score`, but a step that raises leaves every request as it was before the step: the
        KV lengths it extended are rolled back (nothing below them was written) and its
        entries get a STEP_FAILED verdict; an identical retry is then served normally."""
        rids = [block.request_ids[i] for i in entries]
        before = [self.runner.cached_length(rid) for rid in rids]
        try:
            return self._score(block, entries, out, launched)
        except Exception as e:  # any failure of the step fails its entries only
            log.exception("verify step of %d requests failed; rolled back", len(entries))
            for rid, length in zip(rids, before, strict=True):
                if self.runner.cached_length(rid) > length:
                    self.runner.truncate(rid, length)
            for i in entries:
                message = (
                    f"entries[{i}]: the verify step failed ({type(e).__name__}: {e}); the "
                    "request is unchanged and the step may be sent again."
                )
                out.fail(i, RequestError.of(ErrorReason.STEP_FAILED, message))
            return StepTimes()

    def _score(
        self,
        block: DraftBlock,
        entries: list[int],
        out: VerifyResponse,
        launched: Callable[[], None] | None = None,
    ) -> StepTimes:
        """Scores `entries` (valid, ascending) in one padded forward (a CUDA graph where one
        fits), samples each q form, reads every result with one host synchronisation, then
        commits. Nothing of a request's state changes before that synchronisation."""
        runner, clock = self.runner, StepClock(self._device)
        reqs = [self._requests[block.request_ids[i]] for i in entries]
        eager, graphs = runner.eager_steps, runner.graph_steps
        clock.mark()
        tokens = [[r.tokens[-1], *block.tokens(i)] for r, i in zip(reqs, entries, strict=True)]
        logits, _ = runner.ragged_step([block.request_ids[i] for i in entries], tokens)
        clock.mark()
        groups: dict[int, list[int]] = {}  # q form → positions in `entries`
        for pos, i in enumerate(entries):
            groups.setdefault(block.q_forms[i], []).append(pos)
        sampled = [
            (positions, self._sample(block, form, entries, positions, reqs, logits))
            for form, positions in groups.items()
        ]
        clock.mark()
        if launched is not None:
            launched()
        host = runner.to_host(*(packed for _, packed in sampled))  # the step's one sync
        for (positions, _), result in zip(sampled, host, strict=True):
            self._commit_group(block, entries, positions, reqs, result.tolist(), out)
        graphed = runner.eager_steps == eager and runner.graph_steps > graphs
        return StepTimes(clock.seconds(0, 1, "verify"), clock.seconds(1, 2, "sampler"), graphed)

    def _sample(
        self,
        block: DraftBlock,
        form: int,
        entries: list[int],
        positions: list[int],  # into `entries`: the group's requests, ascending
        reqs: list[_Request],
        logits: torch.Tensor,  # [B, n, V] padded, row b of entries[b]
    ) -> torch.Tensor:
        """Runs the rejection sampler on one q form's group; returns its results packed into
        one int32 tensor [G, 2 + 2 * max_k + 1]: status, num_committed, tokens, accepted."""
        runner = self.runner
        group = [entries[p] for p in positions]
        ks = [block.num_draft_tokens[i] for i in group]
        n = logits.shape[1]
        arrays: list[np.ndarray] = [
            np.asarray(ks, np.int32),
            np.asarray(block.draft_tokens(group), np.int32),
        ]
        gather = len(positions) < logits.shape[0] or any(k + 1 != n for k in ks)
        if gather:  # the k + 1 scored rows of each request, request-major
            j = np.arange(n)
            real = j[None, :] <= arrays[0][:, None]  # [G, n]
            arrays.append((np.asarray(positions, np.int64)[:, None] * n + j[None, :])[real])
        uploaded = upload(arrays, self._device)  # one copy for the step's small inputs
        rows = logits.view(-1, logits.shape[2])
        if gather:
            rows = rows.index_select(0, uploaded[2])
        params = [reqs[p].sampling for p in positions]
        lengths = [len(reqs[p].tokens) for p in positions]
        sampled = rejection_sample(
            uploaded[0],
            uploaded[1],
            rows,
            _draft_probs(block.q_rows(form, group), runner.upload),
            RequestSampling.from_params(params, lengths, self._device),
            synthetic=self.config.synthetic,
            synthetic_keys=[block.request_ids[i] for i in group],
            vocab_size=self.vocab_size,
            impl=self.config.sampler_impl,
            host=HostShape(tuple(ks), max(lengths)),
        )
        return torch.cat(
            [
                sampled.status[:, None],
                sampled.num_committed[:, None].to(torch.int32),
                sampled.token_ids.to(torch.int32),
                sampled.accepted.to(torch.int32),
            ],
            dim=1,
        )

    def _commit_group(
        self,
        block: DraftBlock,
        entries: list[int],
        positions: list[int],
        reqs: list[_Request],
        rows: list[list[int]],  # the group's packed results, on the host
        out: VerifyResponse,
    ) -> None:
        for p, row in zip(positions, rows, strict=True):
            i, req = entries[p], reqs[p]
            k = block.num_draft_tokens[i]
            width = (len(row) - 3) // 2 + 1  # max_k + 1 token columns
            tokens, accepted = row[2 : 2 + row[1]], row[2 + width : 2 + width + k]
            self._commit(block, i, req, tokens, [a != 0 for a in accepted], row[0], out)

    def _commit(
        self,
        block: DraftBlock,
        i: int,
        req: _Request,
        tokens: list[int],
        accepted: list[bool],
        status: int,
        out: VerifyResponse,
    ) -> None:
        rid = block.request_ids[i]
        if status != SampleStatus.OK:
            self.runner.truncate(rid, len(req.tokens) - 1)
            reason, field = _SAMPLE_ERRORS[SampleStatus(status)]
            message = f"entries[{i}]{field}: {status_message(status)}"
            out.fail(i, RequestError.of(reason, message))
            return
        num_accepted = accepted.count(True)
        assert len(tokens) == num_accepted + 1, "the sampler stops at the first rejection"
        req.tokens.extend(tokens)
        self.runner.truncate(rid, len(req.tokens) - 1)
        req.next_step = block.steps[i] + 1
        req.last = (tokens, num_accepted, len(accepted), len(req.tokens))
        out.commit(i, *req.last)


def _in_vocab(token_ids: list[int], vocab_size: int) -> bool:
    return not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size)


def _draft_probs(q: DraftQ, upload: Callable[[torch.Tensor], torch.Tensor]) -> DraftQ:
    """q's tensors on the sampler's device."""
    if isinstance(q, DenseQ):
        return DenseQ(upload(q.probs))
    if isinstance(q, SparseQ):
        return SparseQ(upload(q.token_ids), upload(q.probs))
    return None
