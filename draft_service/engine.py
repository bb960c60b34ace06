"""The draft's torch work: admission, and proposals for a block of requests.

KV invariant (as on the target): after a verdict the committed sequence S (length n) is known;
the KV cache keeps its longest prefix that agrees with S, at most S[:n-1]. A proposal forwards
the missing tail of S (one ragged pass for the block), samples d_1 at absolute position n, then
one token per step for k - 1 steps (`graph_step`: a CUDA graph on GPU). The KV then holds
S + d_1 .. d_{k-1}; the next verdict rolls back whatever it rejected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, product

import torch

from draft_service import ahead
from draft_service.config import DraftConfig
from draft_service.sampling import sample_draft
from specdec.errors import CacheFullError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.runner.runner import on_device
from specdec.runner.timing import StepClock, StepTimes
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import (
    Q_DENSE,
    Q_NONE,
    Q_SPARSE,
    DenseQ,
    DraftBlock,
    DraftQ,
    SparseQ,
)
from specdec.serving.checks import (
    committed_length_mismatch,
    duplicate_entry,
    over_capacity,
    step_error,
    token_out_of_vocab,
    too_many_drafts,
    unknown_request,
)
from specdec.serving.messages import AdmitRequest, ModelInfo, ProposeEntry, RequestError
from specdec.serving.ngram import propose_ngram

log = logging.getLogger(__name__)

Head = Callable[..., tuple[torch.Tensor, ...]]
WARMUP_PREFIX = "\x1fwarm-up "  # start-up requests' ids: no client id holds U+001F
# the longest catch-up step captured at start-up: one token after a rejection, two after an
# admission or an all-accepted verdict; a longer tail (after k = 0 steps) is prefilled eagerly
GRAPHED_TAIL = 2


def make_head(
    vocab_size: int, support_size: int | None, top_scale: float = 1.0, top_count: int = 0
) -> Head:
    """Step head: logits [B, n, V] → (token_ids [B], probs [B, K'|V][, ids [B, K']]), sampling
    row b from its position last[b] (a catch-up's rows are padded to the longest). With
    `top_scale` < 1 (Saguaro sampling, `sampling.sample_draft`) the `top_count` most likely
    tokens are scaled down in the q sampled from and sent."""

    def head(
        logits: torch.Tensor,  # [B, n, V]
        last: torch.Tensor,  # [B] int64: the row's last real position
        temperature: torch.Tensor,  # [B] float32
        top_k: torch.Tensor,  # [B] int32
        top_p: torch.Tensor,  # [B] float32
        seed: torch.Tensor,  # [B] int64
        position: torch.Tensor,  # [B] int64
    ) -> tuple[torch.Tensor, ...]:
        index = last[:, None, None].expand(-1, 1, logits.shape[2])
        rows = logits.gather(1, index).squeeze(1)[:, :vocab_size]
        s = sample_draft(
            rows, temperature, top_k, top_p, seed, position, support_size, top_scale, top_count
        )
        if s.support_ids is None:
            return s.token_ids, s.probs
        return s.token_ids, s.probs, s.support_ids

    return head


def make_greedy_head(vocab_size: int) -> Head:
    """Step head of a block whose requests are all greedy: (token_ids [B],). Their q is never
    sent, and the full head's sort and softmax over the vocabulary cost more than the argmax."""

    def head(logits: torch.Tensor, last: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor]:
        index = last[:, None, None].expand(-1, 1, logits.shape[2])
        rows = logits.gather(1, index).squeeze(1)[:, :vocab_size]  # [B, V]
        return (rows.argmax(dim=-1).to(torch.int32),)

    return head


def with_guesses(head: Head, vocab_size: int, count: int) -> Head:
    """`head`'s outputs plus each row's `count` most likely ids [B, count] int32: draft-ahead's
    guesses of the token a verdict adds at that position, made inside the same graph."""

    def guessing(
        logits: torch.Tensor, last: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        index = last[:, None, None].expand(-1, 1, logits.shape[2])
        rows = logits.gather(1, index).squeeze(1)[:, :vocab_size]  # [B, V]
        top = rows.topk(count, dim=-1).indices.to(torch.int32)
        return (*head(logits, last, *rest), top)

    return guessing


@dataclass(frozen=True, slots=True)
class Proposal:
    """One block's answer: the drafts, an error per refused ask, the device time of its
    forwards, how many asks found a chain drafted ahead (hits) or did not (misses), and the
    seconds spent in passes ahead since the previous proposal."""

    block: DraftBlock
    errors: list[tuple[str, RequestError]]
    times: StepTimes
    ahead_hits: int = 0
    ahead_misses: int = 0
    ahead_s: float = 0.0
    ahead_backups: int = 0


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + committed tokens
    sampling: SamplingParams
    next_step: int
    kv: list[int] = field(default_factory=list)  # tokens in the runner's KV cache
    drafts: list[int] = field(default_factory=list)  # the last proposal's, for draft-ahead
    k: int = 0  # the k the last ask wanted (a backup proposal drafted none of them)
    guesses: list[list[int]] = field(default_factory=list)  # [k][F + 1] ids at each draft
    chains: dict[tuple[int, ...], ahead.Chain] = field(default_factory=dict)  # by verdict
    chains_step: int = -1  # the step the chains are drafts for


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class DraftEngine:
    """Per-request state plus the proposer; one lock serialises blocks."""

    def __init__(self, config: DraftConfig, runner: ModelRunner | None, info: ModelInfo):
        self.config, self.runner, self.info = config, runner, info
        self.vocab_size = info.tokenizer_vocab_size
        support = config.support_size if config.q_form == "sparse" else None
        # Saguaro sampling scales down exactly the tokens draft-ahead guesses (`with_guesses`)
        guesses = min(config.draft_ahead + 1, self.vocab_size)
        self._head = make_head(self.vocab_size, support, config.saguaro_scale, guesses)
        self._greedy_head = make_greedy_head(self.vocab_size)
        # made once: the runner captures a graph per (shape, head)
        self._guessing_heads = (
            with_guesses(self._head, self.vocab_size, guesses),
            with_guesses(self._greedy_head, self.vocab_size, guesses),
        )
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self.ahead_hits = self.ahead_misses = 0  # asks that found a chain drafted ahead, or not
        self.ahead_backups = 0  # asks that found none and got a backup proposal (no drafts)
        self._ahead_s = 0.0  # device time of the passes ahead since the last proposal
        self._accepted = ahead.AcceptedCounts()  # the verdicts' accepted counts seen so far
        self._backup = ahead.BackupChoice()  # whether a miss drafts now or takes a backup
        if runner is not None:  # the `last` head input of one-token steps: row 0
            self._zeros = torch.zeros(
                runner.config.max_slots, dtype=torch.long, device=runner.config.device
            )

    def admit(self, adm: AdmitRequest) -> tuple[int, int]:
        adm.check_limits(self.vocab_size, self.info.max_seq_len)
        with self._lock:
            if adm.request_id in self._requests:
                raise InvalidInputError(f"request_id {adm.request_id!r} is already admitted.")
            if ahead.BRANCH_MARK in adm.request_id:
                raise InvalidInputError("request_id must not contain the character U+001F.")
            if self.config.stand_in is not None and not adm.sampling.greedy:
                raise InvalidInputError(
                    "The draft stand-in (BENCHMARKING ONLY) drafts for greedy requests only."
                )
            tokens = list(adm.prompt_token_ids)
            req = _Request(tokens, adm.sampling, adm.first_step)
            capped = self.runner is None or self.config.draft_ahead  # else the cache says
            if capped and len(self._requests) >= self.info.max_requests:
                raise CacheFullError(f"{self.info.max_requests} requests are held already.")
            if self.runner is not None:
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
                self._drop_ahead(self._requests.pop(rid))
                if self.runner is not None:
                    self.runner.release(rid)
        return len(held)

    def propose(
        self, asks: Sequence[ProposeEntry]
    ) -> tuple[DraftBlock, list[tuple[str, RequestError]]]:
        """Drafts for every valid ask (in order, as one block), and an error for each of the
        others."""
        proposal = self.propose_timed(asks)
        return proposal.block, proposal.errors

    def propose_timed(self, asks: Sequence[ProposeEntry], target_step_s: float = 0.0) -> Proposal:
        """`propose`, the device time of the step's forwards and its draft-ahead hits. A step
        that raises leaves every request as it was before it (tokens, step, KV), so the same
        block may be sent again. `target_step_s` is the hub's step time less its wait for
        this service (0: unknown), for the backup choice (`ahead.BackupChoice`)."""
        with self._lock:
            counts: dict[str, int] = {}
            for a in asks:
                counts[a.request_id] = counts.get(a.request_id, 0) + 1
            ok: list[ProposeEntry] = []
            errors: list[tuple[str, RequestError]] = []
            for a in asks:
                err = self._check(a, counts[a.request_id])
                if err is None:
                    ok.append(a)
                else:
                    errors.append((a.request_id, err))
            before = (self.ahead_hits, self.ahead_misses)
            for a in ok:
                req = self._requests[a.request_id]
                if req.drafts and a.step == req.next_step:  # a verdict on drafts: tokens committed
                    self._backup.committed(len(a.new_token_ids))
            missed: set[str] = set()  # asks with chains drafted ahead, none for their verdict
            hits = {a.request_id: c for a in ok if (c := self._take_chain(a, missed)) is not None}
            ahead = (self.ahead_hits - before[0], self.ahead_misses - before[1], self._ahead_s)
            self._ahead_s = 0.0  # reported with this proposal (kept for the next if it fails)
            saved = [self._save(a.request_id) for a in ok]
            applied: set[str] = set()  # hits whose chain became the request's
            try:
                for a in ok:
                    req = self._requests[a.request_id]
                    req.tokens.extend(a.new_token_ids)
                    req.next_step = a.step + 1
                if self.runner is None:
                    return Proposal(self._draft_ngram(ok), errors, StepTimes(), *ahead)
                block, times, backups = self._draft_model(ok, hits, missed, applied,
                                                          target_step_s)  # fmt: skip
                self.ahead_backups += backups
                return Proposal(block, errors, times, *ahead, backups)
            except BaseException:
                self._ahead_s += ahead[2]
                for a, state in zip(ok, saved, strict=True):
                    self._restore(a.request_id, state)
                for rid, c in hits.items():
                    if rid not in applied:  # an applied chain's slot is the request's now
                        self._release_branch(c.branch_id)
                raise

    def _save(self, request_id: str) -> tuple[int, int, list[int]]:
        req = self._requests[request_id]
        return len(req.tokens), req.next_step, list(req.kv)

    def _restore(self, request_id: str, state: tuple[int, int, list[int]]) -> None:
        """Undoes a failed step. The step wrote K/V only past the longest prefix its KV shared
        with the committed tokens, so that prefix is intact and the KV keeps exactly it."""
        length, step, kv = state
        req = self._requests[request_id]
        del req.tokens[length:]
        req.next_step = step
        keep = min(_common_prefix(kv, req.tokens), len(req.tokens) - 1)
        req.kv = kv[:keep]
        if self.runner is not None and self.runner.cached_length(request_id) > keep:
            self.runner.truncate(request_id, keep)

    def _check(self, a: ProposeEntry, count: int) -> RequestError | None:
        rid, info = a.request_id, self.info
        error = duplicate_entry(rid, count) or unknown_request(rid, self._requests)
        if error is not None:
            return error
        req = self._requests[rid]
        n = len(req.tokens) + len(a.new_token_ids)
        k = a.num_draft_tokens
        return (
            step_error(req.next_step, a.step, rid, retry_ok=True)
            or committed_length_mismatch(n, a.committed_length, rid)
            or too_many_drafts(k, info.max_num_draft_tokens, "num_draft_tokens")
            or token_out_of_vocab(a.new_token_ids, self.vocab_size, "new_token_ids")
            or over_capacity(n, k, info.max_seq_len)
        )

    def _draft_ngram(self, asks: list[ProposeEntry]) -> DraftBlock:
        ids = [propose_ngram(self._requests[a.request_id].tokens, a.num_draft_tokens,
                             self.config.ngram) for a in asks]  # fmt: skip
        return self._block(asks, ids, [Q_NONE] * len(asks))

    def _draft_model(
        self,
        asks: list[ProposeEntry],
        hits: dict[str, ahead.Chain],
        missed: set[str],
        applied: set[str],
        target_step_s: float,
    ) -> tuple[DraftBlock, StepTimes, int]:
        """Drafts for the asks: a hit's chain (its slot becomes the request's, noted in
        `applied`), the others drafted now in one pass; or, where every other is a miss (it
        had chains, none for its verdict), backup proposals of no drafts for them if that
        commits more tokens per second (`ahead.BackupChoice`). Returns how many got one. An
        ask without chains (just admitted, or left out of the last pass by its budget) is
        drafted now, so a request the pass ahead has no room for is never stuck at k = 0."""
        assert self.runner is not None
        active = [a for a in asks if a.num_draft_tokens > 0 and a.request_id not in hits]
        drafts: dict[str, list[int]] = {}
        q_rows: dict[str, tuple[torch.Tensor, ...]] = {}
        times = StepTimes()
        backups = set()
        mode = self.config.draft_ahead_backup
        # a seeded request's k is fixed, and an ask without chains is drafted now: the step
        # waits for a draft pass anyway, and the misses ride along in it for nothing
        waits = any(a.fixed_num_draft_tokens or a.request_id not in missed for a in active)
        ahead_on = bool(self.config.draft_ahead and self.runner.can_fork)
        if active and not waits and mode != "never" and ahead_on:
            wanted = sum(a.num_draft_tokens > 0 for a in asks)
            if mode == "always" or self._backup.pays(wanted, len(active), target_step_s):
                backups = {a.request_id for a in active}
                active = []
        if active:
            started = time.perf_counter()
            with on_device(self.runner.device):  # gRPC threads start on cuda:0
                ids = [a.request_id for a in active]
                reqs = [self._requests[i] for i in ids]
                ks = [a.num_draft_tokens for a in active]
                guess = bool(self.config.draft_ahead and self.runner.can_fork)
                drafted, q, sampled, guesses, times = self._drafts(ids, reqs, ks, guess)
                for req, g in zip(reqs, guesses, strict=True):
                    req.guesses = g
            self._backup.drafted(time.perf_counter() - started)
            chosen = [i for i, s in zip(ids, sampled, strict=True) if s]
            k_of = dict(zip(ids, ks, strict=True))
            drafts = dict(zip(ids, drafted, strict=True))
            start, tensors = 0, _q_tensors(q) or ()
            for rid in chosen:
                q_rows[rid] = tuple(t[start : start + k_of[rid]] for t in tensors)
                start += k_of[rid]
        for a in asks:
            chain = hits.get(a.request_id)
            if chain is not None:
                self._apply_chain(a.request_id, chain, a.num_draft_tokens, applied)
                self._requests[a.request_id].guesses = chain.guesses[: a.num_draft_tokens]
                drafts[a.request_id] = chain.tokens[: a.num_draft_tokens]
                if chain.q is not None:
                    q_rows[a.request_id] = tuple(t[: a.num_draft_tokens] for t in chain.q)
        for a in asks:
            req = self._requests[a.request_id]
            req.drafts, req.k = drafts.get(a.request_id, []), a.num_draft_tokens
            if a.num_draft_tokens == 0 or a.request_id in backups:  # no forward ran: last
                req.guesses = []  # step's guesses are for other positions (`draft_ahead`
                # catches the KV up, and guesses for a backup's verdict)
        form = Q_SPARSE if self.config.q_form == "sparse" else Q_DENSE
        forms = [form if a.request_id in q_rows else Q_NONE for a in asks]
        rows = [q_rows[a.request_id] for a in asks if a.request_id in q_rows]
        block = self._block(asks, [drafts.get(a.request_id, []) for a in asks], forms,
                            _q_from_rows(rows))  # fmt: skip
        return block, times, len(backups)

    def _block(
        self, asks: list[ProposeEntry], ids: list[list[int]], forms: list[int], q: DraftQ = None
    ) -> DraftBlock:
        return DraftBlock.build(
            [a.request_id for a in asks], [a.step for a in asks],
            [len(self._requests[a.request_id].tokens) for a in asks], [len(t) for t in ids],
            forms, list(chain.from_iterable(ids)),
            q if isinstance(q, DenseQ) else None, q if isinstance(q, SparseQ) else None,
        )  # fmt: skip

    def _drafts(
        self, ids: list[str], reqs: list[_Request], ks: list[int], guess: bool, span: str = "draft"
    ) -> tuple[list[list[int]], DraftQ, list[bool], list[list[list[int]]], StepTimes]:
        """k_i tokens per request: one catch-up step over the tokens the KV lacks (padded to
        the longest, a CUDA graph where one fits), then k - 1 one-token steps, each fed the
        previous step's tokens on the device. Sampling and q rows are written inside the
        graphs; one host synchronisation reads the drafts and the q rows the block sends.
        Returns the tokens by request, the q rows of the sampled (not greedy) requests in
        order, which requests were sampled, with `guess` each draft position's guesses
        (draft-ahead's, `with_guesses`), and the device time (traced as `span`)."""
        runner = self.runner
        assert runner is not None
        eager, graphs = runner.eager_steps, runner.graph_steps
        clock = StepClock(runner.device)
        clock.mark()
        tails = self._catch_up_tails(ids, reqs)
        # temperature, top_k, top_p, seed, position, and each tail's last real position
        *inputs, last = self._sampling_inputs(reqs, [len(t) - 1 for t in tails])
        sampled = [not r.sampling.greedy for r in reqs]
        heads = self._guessing_heads if guess else (self._head, self._greedy_head)
        head = heads[0] if any(sampled) else heads[1]
        _, out = runner.ragged_step(ids, tails, head, (last, *inputs))
        steps = [_kept(list(range(len(ids))), out, guess)]
        for j in range(1, max(ks)):
            rows = [b for b in steps[-1].rows if ks[b] > j]
            prev = steps[-1].select(rows, runner.upload)
            sel = runner.upload(torch.tensor(rows)) if len(rows) < len(ids) else None
            step_in = [t if sel is None else t[sel] for t in inputs]
            step_in[4] = step_in[4] + j
            zero = self._zeros[: len(rows)]
            outs = runner.graph_step([ids[b] for b in rows], prev[:, None], head,
                                     (zero, *step_in))  # fmt: skip
            assert isinstance(outs, tuple)
            steps.append(_kept(rows, outs, guess))
        clock.mark()
        drafted, q, guesses = _read_drafts(steps, ks, sampled, runner)  # the step's one sync
        for b, req in enumerate(reqs):
            req.kv = req.tokens + drafted[b][: ks[b] - 1]
        graphed = runner.eager_steps == eager and runner.graph_steps > graphs
        times = StepTimes(clock.seconds(0, 1, span), 0.0, graphed)
        return drafted, q, sampled, guesses, times

    def _catch_up_tails(self, ids: list[str], reqs: list[_Request]) -> list[list[int]]:
        """Rolls each request's KV back to the prefix it shares with the committed tokens and
        returns the tokens it lacks. With graphs, a tail longer than the start-up captured
        (GRAPHED_TAIL: the request drafted nothing for a while, at k = 0) is prefilled eagerly
        up to its last token first, so that serving never captures a graph: under dynamic
        speculation a new tail length's capture outlasted the hub's deadline."""
        runner = self.runner
        assert runner is not None
        limit = runner.config.cuda_graph_max_tokens
        if runner.config.cuda_graph_batch_sizes:
            limit = min(limit, GRAPHED_TAIL)
        tails, long = [], []
        for rid, req in zip(ids, reqs, strict=True):
            keep = min(_common_prefix(req.kv, req.tokens), len(req.tokens) - 1)
            runner.truncate(rid, keep)
            req.kv = req.kv[:keep]
            tail = req.tokens[keep:]
            if len(tail) > limit:
                long.append(ForwardItem(rid, tail[:-1], 0))
                tail = tail[-1:]
            tails.append(tail)
        if long:
            runner.forward(long)
        return tails

    # Start-up

    def capture_graphs(self) -> int:
        """Runs, before serving, the draft steps serving replays as CUDA graphs, once per
        captured batch size: the catch-up step of one and of two tokens (GRAPHED_TAIL; a
        request's tail after a rejection, and after an admission or an all-accepted verdict;
        longer ones are prefilled eagerly, `_catch_up_tails`) and the one-token steps,
        for greedy and for sampled requests, with draft-ahead's guessing heads and its bonus
        forward where it is on. Left to the first Propose of a batch size, compiling and
        capturing can take longer than the hub's deadline for the draft, and the steps until
        it is resynchronised run without drafts. Leaves the engine as it was; returns the number
        of graphs captured (0 without graphs)."""
        runner = self.runner
        if runner is None:
            return 0
        sizes = runner.config.cuda_graph_batch_sizes
        longest = min(GRAPHED_TAIL, runner.config.cuda_graph_max_tokens)
        k = min(2, self.info.max_num_draft_tokens)
        prompt = list(range(longest + 1))
        if not sizes or len(prompt) + k > runner.config.max_seq_len:
            return 0
        guessing = (False, True) if self.config.draft_ahead and runner.can_fork else (False,)
        # greedy and sampled requests take different heads
        kinds = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
        before = runner.graphs_captured
        with self._lock, on_device(runner.device):
            for bs in sorted(size for size in sizes if size <= runner.free_slots):
                ids = [f"{WARMUP_PREFIX}{i}" for i in range(bs)]
                for rid in ids:
                    runner.add_request(rid)
                try:
                    runner.forward([ForwardItem(rid, prompt, 0) for rid in ids])
                    for sampling, guess, n in product(kinds, guessing, range(1, longest + 1)):
                        reqs = [_Request(list(prompt), sampling, 0, prompt[:-n]) for _ in ids]
                        self._drafts(ids, reqs, [k] * bs, guess, "warm-up")
                    if True in guessing:  # _bonus_guesses' forward of d_k
                        last = runner.upload(torch.zeros(bs, 1, dtype=torch.long))
                        runner.graph_step(ids, last, self._guessing_heads[1], (self._zeros[:bs],))
                    runner.synchronize()
                finally:
                    for rid in ids:
                        runner.release(rid)
        return runner.graphs_captured - before

    # Draft-ahead (draft_service.ahead)

    def draft_ahead(self, request_ids: Sequence[str]) -> int:
        """Called between a proposal and the next ask, while the target verifies: catches up
        the KV of the requests just proposed for that drafted nothing (k = 0, or a backup
        proposal), so that their next drafts need no long catch-up; then, with draft-ahead,
        drafts their likely next steps (each request's own k, config.draft_ahead guesses per
        accepted count). Returns how many chains it drafted."""
        runner = self.runner
        if runner is None:
            return 0
        with self._lock, on_device(runner.device):
            held = [(rid, self._requests[rid]) for rid in dict.fromkeys(request_ids)
                    if rid in self._requests]  # fmt: skip
            self._catch_up([(rid, r) for rid, r in held if not r.drafts and r.kv != r.tokens])
            if not self.config.draft_ahead or not runner.can_fork:
                return 0
            ready = [(rid, r) for rid, r in held if r.guesses and r.k > 0 and self._room_ahead(r)]
            if not ready:
                return 0
            added: list[str] = []
            try:
                return self._draft_chains(ready, added)
            except Exception:  # draft-ahead only saves time: a failure never breaks the stream
                log.exception("draft-ahead failed; these requests draft after their verdicts")
                kept = {c.branch_id for _, r in ready for c in r.chains.values()}
                for _, req in ready:
                    self._drop_ahead(req)
                for bid in added:
                    if bid not in kept:
                        self._release_branch(bid)
                return 0

    def _catch_up(self, lagging: list[tuple[str, _Request]]) -> None:
        """One forward of the tokens the lagging requests' KV lacks (a short tail: a graph),
        which leaves it holding every committed token; with draft-ahead it also gives the
        guesses for the token their next verdict adds (the hypotheses of a backup proposal).
        A failure only leaves the KV behind: the next proposal catches up as before."""
        if not lagging:
            return
        ids = [rid for rid, _ in lagging]
        reqs = [r for _, r in lagging]
        guess = bool(self.config.draft_ahead and self.runner is not None and self.runner.can_fork)
        try:
            *_, guesses, times = self._drafts(ids, reqs, [1] * len(ids), guess, "ahead")
        except Exception:  # the KV keeps the prefix it agrees on (`_catch_up_tails`)
            log.exception("catching up %d request(s) failed; their next proposal does", len(ids))
            return
        self._ahead_s += times.forward_s
        for req, g in zip(reqs, guesses, strict=True):
            req.guesses = g if req.k > 0 else []

    def _room_ahead(self, req: _Request) -> bool:
        assert self.runner is not None
        return len(req.tokens) + len(req.drafts) + req.k <= self.runner.config.max_seq_len

    def _ahead_budget(self) -> int:
        """How many hypotheses one pass drafts: the free slots beyond those kept for admissions,
        and no more than the largest captured graph (an eager pass would cost more than the
        verify it hides behind)."""
        runner = self.runner
        assert runner is not None
        budget = runner.free_slots - (self.info.max_requests - len(self._requests))
        sizes = runner.config.cuda_graph_batch_sizes
        if sizes and runner.uses_graphs:
            budget = min(budget, max(sizes))
        return max(budget, 0)

    def _draft_chains(self, ready: list[tuple[str, _Request]], added: list[str]) -> int:
        """Drafts the hypotheses; `added` collects the branch slots taken, for the caller's
        clean-up if this raises."""
        runner = self.runner
        assert runner is not None
        self._ahead_s += self._bonus_guesses(ready)
        ranked = []  # (rank, request) order: every request's first guess before any second
        for i, (_, req) in enumerate(ready):
            req.chains_step = req.next_step
            found = ahead.hypotheses(req.guesses, req.drafts, self.config.draft_ahead)
            if req.drafts:  # a backup's verdict accepts nothing, whatever the counts say
                found = self._accepted.likely(found)
            ranked += [(rank, i, h) for rank, h in enumerate(found)]
        ranked.sort(key=lambda x: (x[0], x[1]))
        chosen = ranked[: self._ahead_budget()]
        if not chosen:
            return 0
        ids, branches, forks = [], [], []
        for _, i, h in chosen:
            rid, req = ready[i]
            bid = ahead.branch_id(rid, h)
            runner.add_request(bid)
            added.append(bid)
            prefix = req.tokens + req.drafts[: h.accepted]
            ids.append(bid)
            branches.append(_Request([*prefix, h.token], req.sampling, req.next_step + 1, prefix))
            forks.append((rid, bid, len(prefix)))
        clock = StepClock(runner.device)  # the KV copies count as the pass's device time
        clock.mark()
        runner.fork(forks)
        clock.mark()
        ks = [ready[i][1].k for _, i, _ in chosen]
        drafted, q, sampled, guesses, times = self._drafts(ids, branches, ks, True, "ahead")
        self._ahead_s += clock.seconds(0, 1) + times.forward_s  # read after the drafts' sync
        tensors, start = _q_tensors(q) or (), 0
        for n, (_, i, h) in enumerate(chosen):
            req = ready[i][1]
            rows = None
            if sampled[n]:
                rows = tuple(t[start : start + ks[n]] for t in tensors)
                start += ks[n]
            chain = ahead.Chain(ids[n], drafted[n], rows, branches[n].kv, guesses[n])
            req.chains[h.verdict(req.drafts)] = chain
        return len(ids)

    def _bonus_guesses(self, ready: list[tuple[str, _Request]]) -> float:
        """Guesses for the all-accepted verdict's bonus token: one more draft forward, of d_k,
        for the requests whose k accepted drafts come true often enough; its device time."""
        runner = self.runner
        assert runner is not None
        k_of = {rid: len(r.drafts) for rid, r in ready}
        wanted = [(rid, r) for rid, r in ready
                  if len(r.guesses) == k_of[rid] and self._accepted.wants(k_of[rid])]  # fmt: skip
        if not wanted:
            return 0.0
        ids = [rid for rid, _ in wanted]
        clock = StepClock(runner.device)
        clock.mark()
        last = runner.upload(torch.tensor([[r.drafts[-1]] for _, r in wanted], dtype=torch.long))
        out = runner.graph_step(ids, last, self._guessing_heads[1], (self._zeros[: len(ids)],))
        assert isinstance(out, tuple)
        clock.mark()
        top = runner.to_host(out[-1])[0].tolist()  # the synchronisation
        for (_, req), row in zip(wanted, top, strict=True):
            req.kv = req.tokens + req.drafts
            req.guesses = [*req.guesses, row]
        return clock.seconds(0, 1, "ahead")

    def _take_chain(self, a: ProposeEntry, missed: set[str]) -> ahead.Chain | None:
        """The chain drafted ahead for this ask's verdict, if any (an ask that had chains and
        finds none for its verdict goes into `missed`); every other is dropped."""
        req = self._requests[a.request_id]
        if not req.chains:
            return None
        chain = None
        if req.chains_step == a.step and a.num_draft_tokens > 0:
            verdict = tuple(a.new_token_ids)
            if req.drafts:  # a backup proposal's verdict accepted nothing it drafted
                self._accepted.add(len(verdict) - 1)
            rate = self.config.synthetic_hit_rate
            if rate is not None:  # BENCHMARKING ONLY: a chain of the same accepted count
                verdict = ahead.synthetic_hit(req.chains, verdict, rate, a.request_id, a.step)
            chain = req.chains.pop(verdict, None)
            if chain is not None and len(chain.tokens) < a.num_draft_tokens:
                self._release_branch(chain.branch_id)
                chain = None
        self._drop_ahead(req)
        if chain is not None:
            self.ahead_hits += 1
        elif a.num_draft_tokens > 0:  # an ask for no drafts (k = 0) has nothing to miss
            self.ahead_misses += 1
            missed.add(a.request_id)
        return chain

    def _apply_chain(self, request_id: str, chain: ahead.Chain, k: int, applied: set[str]) -> None:
        """The chain's slot becomes the request's; the request's old slot goes. Asked for fewer
        drafts than the chain holds (the hub lowered k), the KV keeps those it sends: all but
        the last, as after drafting them, so the next forward appends where they end."""
        assert self.runner is not None and 0 < k <= len(chain.tokens)
        self.runner.swap(request_id, chain.branch_id)
        self._release_branch(chain.branch_id)
        applied.add(request_id)  # its slot is the request's now: a failure must not free it
        req = self._requests[request_id]
        keep = len(req.tokens) + k - 1
        if len(chain.kv) > keep:
            self.runner.truncate(request_id, keep)
        req.kv = chain.kv[:keep]
        if self.config.synthetic_hit_rate is not None:  # BENCHMARKING ONLY
            # a synthetic hit's chain assumed another verdict token than the committed one; its
            # KV is taken to hold the committed tokens, as a real hit's does, so the next
            # catch-up is as short as after a real hit (not up to k + 1 tokens, prefilled eagerly)
            req.kv = req.tokens + req.kv[len(req.tokens) :]

    def _drop_ahead(self, req: _Request) -> None:
        for c in req.chains.values():
            self._release_branch(c.branch_id)
        req.chains.clear()

    def _release_branch(self, branch_id: str) -> None:
        assert self.runner is not None
        self.runner.release(branch_id)

    def _sampling_inputs(self, reqs: list[_Request], last: list[int]) -> list[torch.Tensor]:
        """temperature, top_k, top_p, seed, the first draft's position and `last`, each [B],
        uploaded in two copies without a host sync."""
        runner = self.runner
        assert runner is not None
        params = [r.sampling for r in reqs]
        floats = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32
        )
        ints = torch.tensor(
            [
                [p.top_k for p in params],
                [p.seed for p in params],
                [len(r.tokens) for r in reqs],
                last,
            ],
            dtype=torch.int64,
        )
        f, i = runner.upload(floats), runner.upload(ints)
        return [f[0], i[0].to(torch.int32), f[1], i[1], i[2], i[3]]


@dataclass(slots=True)
class _Step:
    """One draft step's outputs, copied out of the graph's static buffers (the next replay of
    the same shape overwrites them)."""

    rows: list[int]  # the requests (positions in the block) this step drafted for
    tokens: torch.Tensor  # [R] int32
    probs: torch.Tensor | None  # [R, K' | V] float32; None from the greedy head
    support: torch.Tensor | None  # [R, K'] int32; None for dense q and the greedy head
    guesses: torch.Tensor | None = None  # [R, F + 1] int32: draft-ahead's (with_guesses)

    def select(
        self, rows: list[int], upload: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """This step's tokens of `rows` (a subset of self.rows, in order), on the device."""
        if rows == self.rows:
            return self.tokens
        where = {b: i for i, b in enumerate(self.rows)}
        return self.tokens[upload(torch.tensor([where[b] for b in rows]))]


def _kept(rows: list[int], out: tuple[torch.Tensor, ...], guess: bool = False) -> _Step:
    guesses = out[-1].clone() if guess else None
    out = out[:-1] if guess else out
    probs = out[1].clone() if len(out) > 1 else None
    support = out[2].clone() if len(out) > 2 else None
    return _Step(rows, out[0].clone(), probs, support, guesses)


def _read_drafts(
    steps: list[_Step], ks: list[int], sampled: list[bool], runner: ModelRunner
) -> tuple[list[list[int]], DraftQ, list[list[list[int]]]]:
    """Every request's drafted tokens, the q rows of the sampled requests, request-major
    (request b's k_b rows together, as a DraftBlock holds them), and each request's guesses
    per draft position where the steps made them (else []), read with one host sync.

    Example, ks [2, 1], both sampled: the steps hold rows [b0 j0, b1 j0] and [b0 j1], i.e.
    rows 0, 1, 2 concatenated; the block's rows are [b0 j0, b0 j1, b1 j0] = rows [0, 2, 1].
    """
    where = torch.full((len(ks), len(steps)), -1, dtype=torch.long)  # (request, step) → row
    start = 0
    for j, step in enumerate(steps):
        where[torch.tensor(step.rows), j] = torch.arange(start, start + len(step.rows))
        start += len(step.rows)
    drafted_mask = torch.arange(len(steps))[None, :] < torch.tensor(ks)[:, None]  # [B, steps]
    index = where[drafted_mask & torch.tensor(sampled)[:, None]].tolist()  # request-major
    tokens = torch.cat([s.tokens for s in steps])
    wanted: list[torch.Tensor] = [tokens]
    guessed = steps[0].guesses is not None
    if guessed:
        wanted.append(torch.cat([s.guesses for s in steps if s.guesses is not None]))
    if index:
        rows = runner.upload(torch.tensor(index, dtype=torch.long))
        wanted.append(torch.cat([s.probs for s in steps if s.probs is not None])
                      .index_select(0, rows))  # fmt: skip
        if steps[0].support is not None:
            support = torch.cat([s.support for s in steps if s.support is not None])
            wanted.append(support.index_select(0, rows))
    host = runner.to_host(*wanted)
    table = host[0][where.clamp(min=0)].tolist()  # [B, steps]: request b's token of step j
    drafted = [row[:k] for row, k in zip(table, ks, strict=True)]
    guesses: list[list[list[int]]] = [[] for _ in ks]
    if guessed:
        per_step = host.pop(1)[where.clamp(min=0)].tolist()  # [B, steps, F + 1]
        guesses = [row[:k] for row, k in zip(per_step, ks, strict=True)]
    if not index:
        return drafted, None, guesses
    if len(host) == 2:
        return drafted, DenseQ(host[1]), guesses
    return drafted, SparseQ(host[2], host[1]), guesses


def _q_tensors(q: DraftQ) -> tuple[torch.Tensor, ...] | None:
    """q's tensors row-aligned: (probs,) dense, (probs, token_ids) sparse."""
    if q is None:
        return None
    if isinstance(q, DenseQ):
        return (q.probs,)
    return (q.probs, q.token_ids)


def _q_from_rows(rows: list[tuple[torch.Tensor, ...]]) -> DraftQ:
    """The block's q from each sampled entry's rows (in block order)."""
    if not rows:
        return None
    parts = [torch.cat(list(column)) for column in zip(*rows, strict=True)]
    return DenseQ(parts[0]) if len(parts) == 1 else SparseQ(parts[1], parts[0])
