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

import grpc
import torch

from draft_service.config import DraftConfig
from draft_service.ngram import propose_ngram
from draft_service.sampling import sample_draft
from specdec.errors import CacheFullError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftProposal, DraftQ, ProposeAsk, SparseQ
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
    ) -> tuple[list[DraftProposal], list[tuple[str, RequestError]]]:
        """Drafts for every valid ask (in order), and an error for each of the others."""
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

    def _draft_ngram(self, asks: list[ProposeAsk]) -> list[DraftProposal]:
        out = []
        for a in asks:
            req = self._requests[a.request_id]
            ids = propose_ngram(req.tokens, a.num_draft_tokens, self.config.ngram)
            out.append(DraftProposal(a.request_id, a.step, len(req.tokens), tuple(ids)))
        return out

    def _draft_model(self, asks: list[ProposeAsk]) -> list[DraftProposal]:
        active = [a for a in asks if a.num_draft_tokens > 0]
        drafts: dict[str, tuple[list[int], DraftQ]] = {}
        if active:
            drafts = self._run_model(active)
        out = []
        for a in asks:
            ids, q = drafts.get(a.request_id, ([], None))
            n = len(self._requests[a.request_id].tokens)
            out.append(DraftProposal(a.request_id, a.step, n, tuple(ids), q))
        return out

    def _run_model(self, asks: list[ProposeAsk]) -> dict[str, tuple[list[int], DraftQ]]:
        """k_i tokens per request: one ragged catch-up pass, then k - 1 graph steps."""
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
        drafted: list[list[_Row]] = [[] for _ in asks]
        _store(drafted, list(range(len(asks))), self._head(runner.forward(items)[:, None], *inputs))
        for j in range(1, max(a.num_draft_tokens for a in asks)):
            rows = [b for b in range(len(asks)) if asks[b].num_draft_tokens > j]
            idx = torch.tensor(rows, device=inputs[0].device)
            step_inputs = [t[idx] for t in inputs[:4]] + [inputs[4][idx] + j]
            last = [drafted[b][-1].token_id for b in rows]
            tokens = torch.tensor(last, dtype=torch.int32, device=idx.device)[:, None]
            ids = [asks[b].request_id for b in rows]
            out = runner.graph_step(ids, tokens, self._head, step_inputs)
            assert isinstance(out, tuple)
            _store(drafted, rows, out)
            for b, token in zip(rows, last, strict=True):
                reqs[b].kv.append(token)
        return {
            a.request_id: ([r.token_id for r in rows], _q(rows, req.sampling.greedy))
            for a, req, rows in zip(asks, reqs, drafted, strict=True)
        }

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


@dataclass(frozen=True, slots=True)
class _Row:
    """One drafted token and the q row it was sampled from."""

    token_id: int
    probs: torch.Tensor  # [K'] or [V] float32, on the CPU
    support_ids: torch.Tensor | None  # [K'] int32 (sparse q)


def _store(drafted: list[list[_Row]], rows: list[int], out: tuple[torch.Tensor, ...]) -> None:
    """Copies one step's head outputs (maybe graph buffers) to the CPU, one _Row per request."""
    token_ids = out[0].tolist()
    probs = out[1].to("cpu", copy=True)
    support = out[2].to("cpu", copy=True) if len(out) > 2 else None
    for i, b in enumerate(rows):
        drafted[b].append(_Row(token_ids[i], probs[i], None if support is None else support[i]))


def _q(rows: list[_Row], greedy: bool) -> DraftQ:
    if greedy or not rows:
        return None
    probs = torch.stack([r.probs for r in rows])
    if rows[0].support_ids is None:
        return DenseQ(probs)
    return SparseQ(torch.stack([r.support_ids for r in rows if r.support_ids is not None]), probs)
