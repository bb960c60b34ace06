"""The draft's per-request bookkeeping: admission, release, and proposals for a block of
requests, each checked, applied and undone as a whole if it fails.

KV invariant (as on the target): after a verdict the committed sequence S (length n) is known;
the KV cache keeps its longest prefix that agrees with S, at most S[:n-1]. A proposal takes the
chain drafted ahead for its verdict where there is one (`ahead_pass`), else drafts now
(`drafting`: the missing tail of S and k - 1 one-token steps). The KV then holds
S + d_1 .. d_{k-1}; the next verdict rolls back whatever it rejected.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, product

import torch

from draft_service import ahead
from draft_service.ahead_pass import AheadPass
from draft_service.config import DraftConfig
from draft_service.drafting import (
    GRAPHED_TAIL,
    Drafter,
    DraftRequest,
    QRows,
    common_prefix,
    q_from_rows,
)
from specdec.errors import CacheFullError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.runner.runner import on_device
from specdec.runner.timing import StepTimes
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import Q_DENSE, Q_NONE, Q_SPARSE, DenseQ, DraftBlock, DraftQ, SparseQ
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

WARMUP_PREFIX = "\x1fwarm-up "  # start-up requests' ids: no client id holds U+001F


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


@dataclass(frozen=True, slots=True)
class Push:
    """Chains drafted ahead, sent before the asks they answer: `block` has one entry per
    chain; `keys[i]` is the verdict (new_token_ids) entry i assumed; `any_verdict[i]`
    (BENCHMARKING ONLY, a synthetic hit rate) says it answers every verdict of that length."""

    block: DraftBlock
    keys: list[tuple[int, ...]]
    any_verdict: list[bool]


def _split_q(q: DraftQ) -> tuple[DenseQ | None, SparseQ | None]:
    return (q if isinstance(q, DenseQ) else None), (q if isinstance(q, SparseQ) else None)


class DraftEngine:
    """Per-request state plus the proposer; one lock serialises blocks and passes ahead."""

    def __init__(self, config: DraftConfig, runner: ModelRunner | None, info: ModelInfo):
        self.config, self.runner, self.info = config, runner, info
        self.vocab_size = info.tokenizer_vocab_size
        self._drafter = Drafter(config, runner, self.vocab_size)
        self._requests: dict[str, DraftRequest] = {}
        # admissions prefilled a chunk at a time (`prefill_chunk_tokens`), the lock let go
        # between chunks: their ids, and those released meanwhile
        self._prefilling: set[str] = set()
        self._dropped: set[str] = set()
        self._lock = threading.Lock()
        self._ahead = AheadPass(config, runner, info, self._drafter, self._requests)
        self.ahead_backups = 0  # asks that found no chain and got a backup proposal (no drafts)
        self._backup = ahead.BackupChoice()  # whether a miss drafts now or takes a backup
        self._step_s = 0.0  # the hub's last target_step_s, for backup_miss_share

    @property
    def ahead_hits(self) -> int:
        """Asks that found a chain drafted ahead."""
        return self._ahead.hits

    @property
    def ahead_short_hits(self) -> int:
        """Hits answered with fewer drafts than asked: chains spawned from a catch-up."""
        return self._ahead.short_hits

    @property
    def ahead_misses(self) -> int:
        """Asks that had chains drafted ahead, none for their verdict."""
        return self._ahead.misses

    def admit(self, adm: AdmitRequest) -> tuple[int, int]:
        """Holds a new request, its prompt but the last token prefilled. With
        `prefill_chunk_tokens`, a longer prompt is prefilled that many tokens at a time and the
        engine's lock is let go between chunks, so the running requests' proposals and passes
        ahead are not held up by it; the request is held (and proposed for) once its last
        chunk is in. A release meanwhile ends it there (InvalidInputError)."""
        adm.check_limits(self.vocab_size, self.info.max_seq_len)
        chunk = self.config.prefill_chunk_tokens
        if chunk and self.runner is not None and len(adm.prompt_token_ids) - 1 > chunk:
            return self._admit_chunked(adm, chunk)
        with self._lock:
            self._check_admission(adm)
            tokens = list(adm.prompt_token_ids)
            req = DraftRequest(tokens, adm.sampling, adm.first_step)
            if self.runner is not None:
                self._prefill(adm.request_id, tokens[:-1])
                req.kv = tokens[:-1]
            self._requests[adm.request_id] = req
        return len(tokens), adm.first_step

    def _check_admission(self, adm: AdmitRequest) -> None:
        rid = adm.request_id
        if rid in self._requests or rid in self._prefilling:
            raise InvalidInputError(f"request_id {rid!r} is already admitted.")
        if ahead.BRANCH_MARK in rid:
            raise InvalidInputError("request_id must not contain the character U+001F.")
        if self.config.stand_in is not None and not adm.sampling.greedy:
            raise InvalidInputError(
                "The draft stand-in (BENCHMARKING ONLY) drafts for greedy requests only."
            )
        capped = self.runner is None or self.config.draft_ahead  # else the cache says
        if capped and len(self._requests) + len(self._prefilling) >= self.info.max_requests:
            raise CacheFullError(f"{self.info.max_requests} requests are held already.")

    def _admit_chunked(self, adm: AdmitRequest, chunk: int) -> tuple[int, int]:
        rid, tokens = adm.request_id, list(adm.prompt_token_ids)
        assert self.runner is not None
        with self._lock:
            self._check_admission(adm)
            self.runner.add_request(rid)
            self._prefilling.add(rid)
        body = tokens[:-1]
        try:
            with self._lock, on_device(self.runner.device):  # a cached start, taken once
                done = self.runner.take_prefix(rid, tokens)
            while done < len(body):
                time.sleep(0)  # lets a thread waiting for the lock (a Propose) take it first
                with self._lock, on_device(self.runner.device):
                    if rid in self._dropped:
                        raise InvalidInputError(f"request {rid!r} was released while admitted.")
                    self.runner.forward([ForwardItem(rid, body[done : done + chunk], 0)])
                done += chunk
            with self._lock:
                if rid in self._dropped:
                    raise InvalidInputError(f"request {rid!r} was released while admitted.")
                req = DraftRequest(tokens, adm.sampling, adm.first_step)
                req.kv = body
                self._requests[rid] = req
                self._prefilling.discard(rid)
        except BaseException:
            with self._lock:
                self._prefilling.discard(rid)
                self._dropped.discard(rid)
                self.runner.release(rid)
            raise
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
            # an admission still in its chunks ends at its next one, and frees its slot then
            self._dropped.update(rid for rid in request_ids if rid in self._prefilling)
            held = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
            for rid in held:
                self._ahead.drop(self._requests.pop(rid))
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
            if target_step_s > 0:
                self._step_s = target_step_s
            for a in ok:
                req = self._requests[a.request_id]
                if req.drafts and a.step == req.next_step:  # a verdict on drafts: tokens committed
                    self._backup.committed(len(a.new_token_ids))
            missed: set[str] = set()  # asks with chains drafted ahead, none for their verdict
            hits = {
                a.request_id: c for a in ok if (c := self._ahead.take_chain(a, missed)) is not None
            }
            ahead = (
                self.ahead_hits - before[0],
                self.ahead_misses - before[1],
                self._ahead.seconds,
            )
            self._ahead.seconds = 0.0  # reported with this proposal (kept for the next if it fails)
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
                if any(a.backup for a in ok):  # the hub backed these up: counted once done
                    self._backup.backed_up()
                self.ahead_backups += backups
                return Proposal(block, errors, times, *ahead, backups)
            except BaseException:
                self._ahead.seconds += ahead[2]
                for a, state in zip(ok, saved, strict=True):
                    self._restore(a.request_id, state)
                for rid, c in hits.items():
                    if rid not in applied:  # an applied chain's slot is the request's now
                        self._ahead.release_branch(c.branch_id)
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
        keep = min(common_prefix(kv, req.tokens), len(req.tokens) - 1)
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
        # a later step is taken where its new tokens bring the request to the committed length
        # (checked next): a late admission's first ask, made after the target decoded steps at
        # k = 0 while the draft prefilled; they are caught up as any tail is
        return (
            step_error(req.next_step, a.step, rid, retry_ok=True, later_ok=True)
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
        backups = {a.request_id for a in active if a.backup}  # the hub backed these up already
        active = [a for a in active if not a.backup]
        mode = self.config.draft_ahead_backup
        # a seeded request's k is fixed, and an ask without chains is drafted now: the step
        # waits for a draft pass anyway, and the misses ride along in it for nothing
        waits = any(a.fixed_num_draft_tokens or a.request_id not in missed for a in active)
        ahead_on = bool(self.config.draft_ahead and self.runner.can_fork)
        if active and not waits and mode != "never" and ahead_on:
            wanted = sum(a.num_draft_tokens > 0 for a in asks)
            if mode == "always" or self._backup.pays(wanted, len(active), target_step_s):
                backups |= {a.request_id for a in active}
                active = []
        if active:
            started = time.perf_counter()
            with on_device(self.runner.device):  # gRPC threads start on cuda:0
                ids = [a.request_id for a in active]
                reqs = [self._requests[i] for i in ids]
                ks = [a.num_draft_tokens for a in active]
                guess = bool(self.config.draft_ahead and self.runner.can_fork)
                drafted, q, sampled, guesses, times = self._drafter.drafts(ids, reqs, ks, guess)
                for req, g in zip(reqs, guesses, strict=True):
                    req.guesses = g
            self._backup.drafted(time.perf_counter() - started)
            drafts = dict(zip(ids, drafted, strict=True))
            drafted_q = QRows(q)
            for rid, k, s in zip(ids, ks, sampled, strict=True):
                if s:
                    q_rows[rid] = drafted_q.take(k)
        for a in asks:
            chain = hits.get(a.request_id)
            if chain is not None:  # it may hold fewer drafts than asked (`AheadPass.take_chain`)
                k = min(a.num_draft_tokens, len(chain.tokens))
                self._ahead.apply_chain(a.request_id, chain, k, applied)
                self._requests[a.request_id].guesses = chain.guesses[: a.num_draft_tokens]
                drafts[a.request_id] = chain.tokens[: a.num_draft_tokens]
                if chain.q is not None:
                    q_rows[a.request_id] = tuple(t[: a.num_draft_tokens] for t in chain.q)
        for a in asks:
            req = self._requests[a.request_id]
            req.drafts, req.k = drafts.get(a.request_id, []), a.num_draft_tokens
            req.fixed_k = a.fixed_num_draft_tokens
            if a.num_draft_tokens == 0 or a.request_id in backups:  # no forward ran: last
                req.guesses = []  # step's guesses are for other positions (`draft_ahead`
                # catches the KV up, and guesses for a backup's verdict)
        form = Q_SPARSE if self.config.q_form == "sparse" else Q_DENSE
        forms = [form if a.request_id in q_rows else Q_NONE for a in asks]
        rows = [q_rows[a.request_id] for a in asks if a.request_id in q_rows]
        block = self._block(asks, [drafts.get(a.request_id, []) for a in asks], forms,
                            q_from_rows(rows))  # fmt: skip
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

    def backup_miss_share(self) -> float:
        """ProposeResponse.backup_miss_share of a push: below what share of a step's asks
        their misses of the pushed chains pay to back up (`ahead.BackupChoice.miss_share`)."""
        mode = self.config.draft_ahead_backup
        if mode == "never":
            return 0.0
        if mode == "always":
            return math.inf
        with self._lock:
            return self._backup.miss_share(self._step_s)

    def pushed(self, request_ids: Sequence[str]) -> Push | None:
        """Every chain drafted ahead for these requests, as one block for the step after the
        one just proposed, with the verdict each assumed (None if there is none): what the
        next ask with that verdict is answered with (`AheadPass.take_chain`), sent before it
        so that the target can verify it without asking (ProposeBlock.push_chains)."""
        with self._lock:
            rids: list[str] = []
            steps, committed, ids, forms, rows = [], [], [], [], []
            keys: list[tuple[int, ...]] = []
            anyone: list[bool] = []
            form = Q_SPARSE if self.config.q_form == "sparse" else Q_DENSE
            for rid in dict.fromkeys(request_ids):
                req = self._requests.get(rid)
                if req is None or not req.chains:
                    continue
                synthetic: set[tuple[int, ...]] = set()
                rate = self.config.hit_rate_for(rid)
                if rate is not None:  # BENCHMARKING ONLY
                    synthetic = ahead.synthetic_any_keys(req.chains, rid, req.chains_step, rate)
                for key, c in req.chains.items():
                    rids.append(rid)
                    steps.append(req.chains_step)
                    committed.append(len(req.tokens) + len(key))
                    ids.append(c.tokens)
                    forms.append(Q_NONE if c.q is None else form)
                    if c.q is not None:
                        rows.append(c.q)
                    keys.append(key)
                    anyone.append(key in synthetic)
            if not rids:
                return None
            block = DraftBlock.build(
                rids, steps, committed, [len(t) for t in ids], forms,
                list(chain.from_iterable(ids)), *_split_q(q_from_rows(rows)),
            )  # fmt: skip
            return Push(block, keys, anyone)

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
            return self._ahead.run(request_ids)

    def capture_graphs(self) -> int:
        """Runs, before serving, the draft steps serving replays as CUDA graphs, once per
        captured batch size: the catch-up step of one and of two tokens (GRAPHED_TAIL; a
        request's tail after a rejection, and after an admission or an all-accepted verdict;
        longer ones are prefilled eagerly, `Drafter._catch_up_tails`) and the one-token steps,
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
                        reqs = [DraftRequest(list(prompt), sampling, 0, prompt[:-n]) for _ in ids]
                        self._drafter.drafts(ids, reqs, [k] * bs, guess, "warm-up")
                    if True in guessing:  # the pass ahead's forward of d_k (`_bonus_guesses`)
                        last = runner.upload(torch.zeros(bs, 1, dtype=torch.long))
                        self._drafter.bonus_step(ids, last)
                    runner.synchronize()
                finally:
                    for rid in ids:
                        runner.release(rid)
        return runner.graphs_captured - before
