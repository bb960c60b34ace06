"""The draft's torch work: admission, and proposals for a block of requests.

KV invariant (as on the target): after a verdict the committed sequence S (length n) is known;
the KV cache keeps its longest prefix that agrees with S, at most S[:n-1]. A proposal forwards
the missing tail of S (one ragged pass for the block), samples d_1 at absolute position n, then
one token per step for k - 1 steps (`graph_step`: a CUDA graph on GPU). The KV then holds
S + d_1 .. d_{k-1}; the next verdict rolls back whatever it rejected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import grpc
import torch

from draft_service.config import DraftConfig
from draft_service.ngram import propose_ngram
from draft_service.sampling import sample_draft
from specdec.errors import CacheFullError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import (
    Q_DENSE,
    Q_NONE,
    Q_SPARSE,
    DenseQ,
    DraftQ,
    ProposalBlock,
    ProposeAsk,
    SparseQ,
)
from specdec.serving.messages import Admission, ErrorReason, ModelInfo, RequestError

Head = Callable[..., tuple[torch.Tensor, ...]]


def make_head(vocab_size: int, support_size: int | None) -> Head:
    """graph_step head: logits [B, n, V] → (token_ids [B], probs [B, K'|V][, ids [B, K']])."""

    def head(
        logits: torch.Tensor,  # [B, n, V]
        temperature: torch.Tensor,  # [B] float32
        top_k: torch.Tensor,  # [B] int32
        top_p: torch.Tensor,  # [B] float32
        seed: torch.Tensor,  # [B] int64
        position: torch.Tensor,  # [B] int64
    ) -> tuple[torch.Tensor, ...]:
        last = logits[:, -1, :vocab_size]
        s = sample_draft(last, temperature, top_k, top_p, seed, position, support_size)
        if s.support_ids is None:
            return s.token_ids, s.probs
        return s.token_ids, s.probs, s.support_ids

    return head


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + committed tokens
    sampling: SamplingParams
    next_step: int
    kv: list[int] = field(default_factory=list)  # tokens in the runner's KV cache


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _error(reason: ErrorReason, code: grpc.StatusCode, message: str) -> RequestError:
    return RequestError(reason, code, message)


class DraftEngine:
    """Per-request state plus the proposer; one lock serialises blocks."""

    def __init__(self, config: DraftConfig, runner: ModelRunner | None, info: ModelInfo):
        self.config, self.runner, self.info = config, runner, info
        self.vocab_size = info.tokenizer_vocab_size
        support = config.support_size if config.q_form == "sparse" else None
        self._head = make_head(self.vocab_size, support)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()

    def admit(self, adm: Admission) -> tuple[int, int]:
        adm.check_limits(self.vocab_size, self.info.max_seq_len)
        with self._lock:
            if adm.request_id in self._requests:
                raise InvalidInputError(f"request_id {adm.request_id!r} is already admitted.")
            tokens = list(adm.prompt_token_ids)
            req = _Request(tokens, adm.sampling, adm.first_step)
            if self.runner is None:
                if len(self._requests) >= self.info.max_requests:
                    raise CacheFullError(f"{self.info.max_requests} requests are held already.")
            else:
                self._prefill(adm.request_id, tokens[:-1])
                req.kv = tokens[:-1]
            self._requests[adm.request_id] = req
        return len(tokens), adm.first_step

    def _prefill(self, request_id: str, tokens: list[int]) -> None:
        assert self.runner is not None
        self.runner.add_request(request_id)
        try:
            if tokens:
                self.runner.forward([ForwardItem(request_id, tokens, 0)])
        except BaseException:
            self.runner.release(request_id)
            raise

    def release(self, request_ids: Sequence[str]) -> int:
        with self._lock:
            held = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
            for rid in held:
                del self._requests[rid]
                if self.runner is not None:
                    self.runner.release(rid)
        return len(held)

    def propose(
        self, asks: Sequence[ProposeAsk]
    ) -> tuple[ProposalBlock, list[tuple[str, RequestError]]]:
        """Drafts for every valid ask (in order, as one block), and an error for each of the
        others."""
        with self._lock:
            counts: dict[str, int] = {}
            for a in asks:
                counts[a.request_id] = counts.get(a.request_id, 0) + 1
            ok: list[ProposeAsk] = []
            errors: list[tuple[str, RequestError]] = []
            for a in asks:
                err = self._check(a, counts[a.request_id])
                if err is None:
                    ok.append(a)
                else:
                    errors.append((a.request_id, err))
            for a in ok:
                req = self._requests[a.request_id]
                req.tokens.extend(a.new_token_ids)
                req.next_step = a.step + 1
            drafts = self._draft_model(ok) if self.runner is not None else self._draft_ngram(ok)
            return drafts, errors

    def _check(self, a: ProposeAsk, count: int) -> RequestError | None:
        req = self._requests.get(a.request_id)
        if count > 1:
            return _error(
                ErrorReason.DUPLICATE_ENTRY,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request {a.request_id!r} appears {count} times in the block.",
            )
        if req is None:
            return _error(
                ErrorReason.UNKNOWN_REQUEST,
                grpc.StatusCode.NOT_FOUND,
                f"request {a.request_id!r} is not admitted.",
            )
        if not req.next_step - 1 <= a.step <= req.next_step:
            reason = ErrorReason.STALE_STEP if a.step < req.next_step else ErrorReason.FUTURE_STEP
            return _error(
                reason,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step is {a.step} but request {a.request_id!r} expects step "
                f"{req.next_step} (or {req.next_step - 1} again).",
            )
        n = len(req.tokens) + len(a.new_token_ids)
        if a.committed_length != n:
            mismatch = ErrorReason.COMMITTED_LENGTH_MISMATCH, grpc.StatusCode.FAILED_PRECONDITION
            return _error(
                *mismatch,
                f"committed_length is {a.committed_length} but request "
                f"{a.request_id!r} would have {n} committed tokens.",
            )
        return self._check_values(a, n)

    def _check_values(self, a: ProposeAsk, n: int) -> RequestError | None:
        invalid = ErrorReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT
        if a.num_draft_tokens > self.info.max_num_draft_tokens:
            return _error(
                *invalid,
                f"num_draft_tokens is {a.num_draft_tokens}; at most "
                f"{self.info.max_num_draft_tokens}.",
            )
        bad = [t for t in a.new_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return _error(
                ErrorReason.TOKEN_OUT_OF_VOCAB,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"new_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size}).",
            )
        if n + a.num_draft_tokens > self.info.max_seq_len:
            return _error(
                ErrorReason.CAPACITY,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{n} committed + {a.num_draft_tokens} draft tokens would pass "
                f"max_seq_len={self.info.max_seq_len}.",
            )
        return None

    def _draft_ngram(self, asks: list[ProposeAsk]) -> ProposalBlock:
        ids = [propose_ngram(self._requests[a.request_id].tokens, a.num_draft_tokens,
                             self.config.ngram) for a in asks]  # fmt: skip
        return self._block(asks, ids, [Q_NONE] * len(asks))

    def _draft_model(self, asks: list[ProposeAsk]) -> ProposalBlock:
        active = [a for a in asks if a.num_draft_tokens > 0]
        drafts: dict[str, list[int]] = {}
        q: DraftQ = None
        sampled: set[str] = set()
        if active:
            drafts, q, sampled = self._run_model(active)
        form = Q_SPARSE if self.config.q_form == "sparse" else Q_DENSE
        forms = [form if a.request_id in sampled else Q_NONE for a in asks]
        return self._block(asks, [drafts.get(a.request_id, []) for a in asks], forms, q)

    def _block(
        self, asks: list[ProposeAsk], ids: list[list[int]], forms: list[int], q: DraftQ = None
    ) -> ProposalBlock:
        return ProposalBlock.build(
            [a.request_id for a in asks], [a.step for a in asks],
            [len(self._requests[a.request_id].tokens) for a in asks], [len(t) for t in ids],
            forms, list(chain.from_iterable(ids)),
            q if isinstance(q, DenseQ) else None, q if isinstance(q, SparseQ) else None,
        )  # fmt: skip

    def _run_model(self, asks: list[ProposeAsk]) -> tuple[dict[str, list[int]], DraftQ, set[str]]:
        """k_i tokens per request: one ragged catch-up pass, then k - 1 graph steps. Returns
        the tokens by request, the q rows of the sampled (not greedy) requests in order, and
        their ids."""
        runner = self.runner
        assert runner is not None
        reqs = [self._requests[a.request_id] for a in asks]
        items = []
        for a, req in zip(asks, reqs, strict=True):
            keep = min(_common_prefix(req.kv, req.tokens), len(req.tokens) - 1)
            runner.truncate(a.request_id, keep)
            items.append(ForwardItem(a.request_id, req.tokens[keep:], 1))
            req.kv = list(req.tokens)
        inputs = self._head_inputs(reqs)  # temperature, top_k, top_p, seed, position
        drafted: list[list[int]] = [[] for _ in asks]
        first = self._head(runner.forward(items)[:, None], *inputs)
        outputs = [_store(drafted, list(range(len(asks))), first)]
        for j in range(1, max(a.num_draft_tokens for a in asks)):
            rows = [b for b in range(len(asks)) if asks[b].num_draft_tokens > j]
            idx = torch.tensor(rows, device=inputs[0].device)
            step_inputs = [t[idx] for t in inputs[:4]] + [inputs[4][idx] + j]
            last = [drafted[b][-1] for b in rows]
            tokens = torch.tensor(last, dtype=torch.int32, device=idx.device)[:, None]
            ids = [asks[b].request_id for b in rows]
            out = runner.graph_step(ids, tokens, self._head, step_inputs)
            assert isinstance(out, tuple)
            outputs.append(_store(drafted, rows, out))
            for b, token in zip(rows, last, strict=True):
                reqs[b].kv.append(token)
        sampled = [not r.sampling.greedy for r in reqs]
        q = _gather_q(outputs, [a.num_draft_tokens for a in asks], sampled)
        drafts = {a.request_id: d for a, d in zip(asks, drafted, strict=True)}
        return drafts, q, {a.request_id for a, s in zip(asks, sampled, strict=True) if s}

    def _head_inputs(self, reqs: list[_Request]) -> list[torch.Tensor]:
        dev = torch.device(self.runner.config.device if self.runner else "cpu")
        params = [r.sampling for r in reqs]

        def t(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        return [
            t([p.temperature for p in params], torch.float32),
            t([p.top_k for p in params], torch.int32),
            t([p.top_p for p in params], torch.float32),
            t([p.seed for p in params], torch.int64),
            t([len(r.tokens) for r in reqs], torch.int64),
        ]


_StepOutput = tuple[list[int], torch.Tensor, torch.Tensor | None]  # rows, probs, support ids


def _store(drafted: list[list[int]], rows: list[int], out: tuple[torch.Tensor, ...]) -> _StepOutput:
    """Appends one step's drafted token to each of `rows`, and copies its q rows (maybe graph
    buffers) to the CPU."""
    for b, token in zip(rows, out[0].tolist(), strict=True):
        drafted[b].append(token)
    probs = out[1].to("cpu", copy=True)  # [len(rows), K' or V] float32
    support = out[2].to("cpu", copy=True) if len(out) > 2 else None  # [len(rows), K'] int32
    return rows, probs, support


def _gather_q(outputs: list[_StepOutput], ks: list[int], sampled: list[bool]) -> DraftQ:
    """The q rows of the sampled requests, request-major (request b's k_b rows together, as a
    DraftBlock holds them), from the step-major head `outputs`: one gather per field, where a
    q per request cost two stacks (~2 us each) and the block its concatenation again.

    Example, ks [2, 1], both sampled: the steps hold rows [b0 j0, b1 j0] and [b0 j1], i.e.
    rows 0, 1, 2 concatenated; the block's rows are [b0 j0, b0 j1, b1 j0] = rows [0, 2, 1].
    """
    where, start = {}, 0  # (request, step) → row of the concatenated step outputs
    for j, (rows, _, _) in enumerate(outputs):
        for pos, b in enumerate(rows):
            where[b, j] = start + pos
        start += len(rows)
    index = [where[b, j] for b, k in enumerate(ks) if sampled[b] for j in range(k)]
    if not index:
        return None
    rows_index = torch.tensor(index, dtype=torch.long)
    probs = torch.cat([p for _, p, _ in outputs])[rows_index]
    supports = [s for _, _, s in outputs if s is not None]
    if not supports:
        return DenseQ(probs)
    return SparseQ(torch.cat(supports)[rows_index], probs)
