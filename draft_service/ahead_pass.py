"""The pass ahead: between a proposal and the next ask, while the target verifies, the draft
catches up the KV of the requests that drafted nothing and drafts chains for the verdicts it
thinks likely (what a hypothesis is, and why a hit is exact: `draft_service.ahead`). The next
ask takes the chain drafted for its verdict, if any, and every other chain's slot goes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from draft_service import ahead
from draft_service.config import DraftConfig
from draft_service.drafting import Drafter, DraftRequest, QRows, Spawn
from specdec.runner import ModelRunner
from specdec.runner.timing import StepClock
from specdec.runner.trace import host_span, trace_of
from specdec.serving.messages import ModelInfo, ProposeEntry, chain_serves

log = logging.getLogger(__name__)


class AheadPass:
    """Draft-ahead's chains and counts over the engine's requests (the same dict); the engine
    calls every method under its one lock."""

    def __init__(
        self,
        config: DraftConfig,
        runner: ModelRunner | None,
        info: ModelInfo,
        drafter: Drafter,
        requests: dict[str, DraftRequest],
    ):
        self.config, self.runner, self.info = config, runner, info
        self._drafter = drafter
        self._requests = requests
        self.hits = self.misses = 0  # asks that found a chain drafted ahead, or not
        self.short_hits = 0  # hits answered with fewer drafts than asked (a spawned chain)
        self.seconds = 0.0  # device time of the passes ahead since the last proposal
        self._accepted = ahead.AcceptedCounts()  # the verdicts' accepted counts seen so far
        self._ranks = ahead.GuessRanks()  # the ranks of the tokens they added (the spread's)
        self._trace = trace_of(runner)  # the pass's parts as host spans, where tracing is on

    def run(self, request_ids: Sequence[str]) -> int:
        """`DraftEngine.draft_ahead`'s pass, on the runner's device: the catch-up, then the
        chains. Returns how many chains it drafted."""
        runner = self.runner
        assert runner is not None
        held = [(rid, self._requests[rid]) for rid in dict.fromkeys(request_ids)
                if rid in self._requests]  # fmt: skip
        lagging = [(rid, r) for rid, r in held if not r.drafts and r.kv != r.tokens]
        ahead_on = bool(self.config.draft_ahead and runner.can_fork)
        # a chain spawned from a catch-up holds k - 1 drafts: a seeded request's chains hold its
        # whole k, and at k = 1 it would hold none, so theirs are drafted after a catch-up pass
        # of their own, as hypotheses like a hit's
        own = [(rid, r) for rid, r in lagging if not ahead_on or r.fixed_k or r.k == 1]
        self._catch_up(own)
        caught = {rid for rid, _ in own}
        lagging = [(rid, r) for rid, r in lagging if rid not in caught]
        if not ahead_on:
            return 0
        behind = {rid for rid, _ in lagging}
        ready = [
            (rid, r)
            for rid, r in held
            if r.guesses and r.k > 0 and self._room_ahead(r) and rid not in behind
        ]
        if not ready and not lagging:
            return 0
        added: list[str] = []
        try:
            return self._draft_chains(ready, lagging, added)
        except Exception:  # draft-ahead only saves time: a failure never breaks the stream
            log.exception("draft-ahead failed; these requests draft after their verdicts")
            kept = {c.branch_id for _, r in ready + lagging for c in r.chains.values()}
            for _, req in ready + lagging:
                self.drop(req)
            for bid in added:
                if bid not in kept:
                    self.release_branch(bid)
            return 0

    def _catch_up(self, lagging: list[tuple[str, DraftRequest]]) -> None:
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
            *_, guesses, times = self._drafter.drafts(ids, reqs, [1] * len(ids), guess, "ahead")
        except Exception:  # the KV keeps the prefix it agrees on (`Drafter._catch_up_tails`)
            log.exception("catching up %d request(s) failed; their next proposal does", len(ids))
            return
        self.seconds += times.forward_s
        for req, g in zip(reqs, guesses, strict=True):
            req.guesses = g if req.k > 0 else []

    def _room_ahead(self, req: DraftRequest) -> bool:
        assert self.runner is not None
        return len(req.tokens) + len(req.drafts) + req.k <= self.runner.config.max_seq_len

    def _budget(self) -> int:
        """How many hypotheses one pass drafts: the free slots beyond those kept for admissions,
        and no more than the largest captured graph (an eager pass would cost more than the
        verify it hides behind)."""
        runner = self.runner
        assert runner is not None
        budget = runner.free_slots - (self.info.max_requests - len(self._requests))
        return max(min(budget, self._widest()), 0)

    def _draft_chains(
        self,
        ready: list[tuple[str, DraftRequest]],
        lagging: list[tuple[str, DraftRequest]],
        added: list[str],
    ) -> int:
        """Drafts the hypotheses of the `ready` requests and, in the same pass, catches the
        `lagging` ones up (they drafted nothing last step: a backup, or k = 0) with chains
        spawned from their catch-up (`drafting.Spawn`): one k - 1 shorter than their k, so
        that the pass takes no forward more than the others' chains; an ask takes such a chain
        for the drafts it holds. `added` collects the branch slots taken, for the caller's
        clean-up if this raises."""
        runner = self.runner
        assert runner is not None
        start = time.perf_counter()
        self.seconds += self._bonus_guesses(ready)
        host_span(self._trace, "ahead: bonus", start)
        start = time.perf_counter()
        ranked = []  # (rank, request) order: every request's first guess before any second
        chances = []  # with the spread: each request's hypotheses and their chances
        for i, (_, req) in enumerate(ready):
            req.chains_step = req.next_step
            found = ahead.hypotheses(req.guesses, req.drafts, self.config.draft_ahead)
            if req.drafts:  # a backup's verdict accepts nothing, whatever the counts say
                found = self._accepted.likely(found)
            ranked += [(rank, i, h) for rank, h in enumerate(found)]
            if self.config.draft_ahead_spread:
                chances.append(ahead.spread(req.guesses, req.drafts, self._accepted, self._ranks))
        ranked.sort(key=lambda x: (x[0], x[1]))
        order = [(i, h) for _, i, h in ranked]
        if self.config.draft_ahead_spread:  # as many as without, the likeliest of all ranks
            order = ahead.spread_order(chances)[: len(order)]
        budget = self._budget()
        # the catch-up rows ride in the first step: within the largest graph with the chains
        chosen = order[: max(0, min(budget, self._widest() - len(lagging)))]
        spawning = self._spawning(lagging, budget - len(chosen))
        if not chosen and not lagging:
            return 0
        ids, branches, forks = [], [], []
        for i, h in chosen:
            rid, req = ready[i]
            bid = ahead.branch_id(rid, h)
            runner.add_request(bid)
            added.append(bid)
            prefix = req.tokens + req.drafts[: h.accepted]
            ids.append(bid)
            branches.append(
                DraftRequest([*prefix, h.token], req.sampling, req.next_step + 1, prefix)
            )
            forks.append((rid, bid, len(prefix)))
        spawns = []
        for n, (rid, req) in enumerate(lagging):
            req.chains_step = req.next_step
            ranks = spawning.get(rid, 0)
            if ranks:
                bids = tuple(ahead.spawn_id(rid, r) for r in range(ranks))
                for bid in bids:
                    runner.add_request(bid)
                    added.append(bid)
                spawns.append(Spawn(len(chosen) + n, bids, req.k - 1))
        host_span(self._trace, "ahead: prepare", start)
        start = time.perf_counter()
        clock = StepClock(runner.device)  # the KV copies count as the pass's device time
        clock.mark()
        runner.fork(forks)
        clock.mark()
        host_span(self._trace, "ahead: fork", start)
        ks = [ready[i][1].k for i, _ in chosen] + [1] * len(lagging)
        rows = branches + [r for _, r in lagging]
        ids += [rid for rid, _ in lagging]
        drafted, q, sampled, guesses, times = self._drafter.drafts(
            ids, rows, ks, True, "ahead", spawns
        )
        self.seconds += clock.seconds(0, 1) + times.forward_s  # read after the drafts' sync
        kept_at = time.perf_counter()
        at = QRows(q)
        for n, (i, h) in enumerate(chosen):
            req = ready[i][1]
            rows_q = at.take(ks[n]) if sampled[n] else None
            chain = ahead.Chain(ids[n], drafted[n], rows_q, branches[n].kv, guesses[n])
            req.chains[h.verdict(req.drafts)] = chain
        for n, (_, req) in enumerate(lagging):
            row = len(chosen) + n
            if sampled[row]:  # the catch-up's own draft: not sent
                at.take(1)
            req.guesses = guesses[row] if req.k > 0 else []
        row = len(ids)
        for spawn in spawns:
            req = rows[spawn.row]
            for rank, bid in enumerate(spawn.branch_ids):
                token = guesses[spawn.row][0][rank]
                rows_q = at.take(spawn.k) if sampled[row] else None
                kv = [*req.tokens, token, *drafted[row][: spawn.k - 1]]
                chain = ahead.Chain(bid, drafted[row], rows_q, kv, guesses[row])
                req.chains[(token,)] = chain
                row += 1
        host_span(self._trace, "ahead: keep", kept_at)
        return len(chosen) + sum(len(s.branch_ids) for s in spawns)

    def _widest(self) -> int:
        """The most rows one graphed step takes (any number without graphs)."""
        assert self.runner is not None
        sizes = self.runner.config.cuda_graph_batch_sizes
        return max(sizes) if sizes and self.runner.uses_graphs else 1 << 30

    def _spawning(self, lagging: list[tuple[str, DraftRequest]], budget: int) -> dict[str, int]:
        """How many chains each lagging request spawns (its F guesses ranked first, rank by
        rank across requests, within `budget`): none for one that asks no drafts (k = 0) or
        has no room."""
        able = [rid for rid, r in lagging if r.k > 1 and self._room_ahead(r)]
        out: dict[str, int] = {}
        for _ in range(self.config.draft_ahead):
            for rid in able:
                if budget > 0:
                    out[rid] = out.get(rid, 0) + 1
                    budget -= 1
        return out

    def _bonus_guesses(self, ready: list[tuple[str, DraftRequest]]) -> float:
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
        out = self._drafter.bonus_step(ids, last)
        clock.mark()
        top = runner.to_host(out[-1])[0].tolist()  # the synchronisation
        for (_, req), row in zip(wanted, top, strict=True):
            req.kv = req.tokens + req.drafts
            req.guesses = [*req.guesses, row]
        return clock.seconds(0, 1, "ahead")

    def take_chain(self, a: ProposeEntry, missed: set[str]) -> ahead.Chain | None:
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
            self._rank(req, verdict)
            rate = self.config.hit_rate_for(a.request_id)
            if rate is not None:  # BENCHMARKING ONLY: a chain of the same accepted count
                verdict = ahead.synthetic_hit(req.chains, verdict, rate, a.request_id, a.step)
            chain = req.chains.pop(verdict, None)
            # a backup (`ProposeEntry.backup`): the hub found no chain in the push and
            # verifies no drafts, so none is used here either
            fixed = a.fixed_num_draft_tokens
            if chain is not None and (
                a.backup or not chain_serves(len(chain.tokens), a.num_draft_tokens, fixed)
            ):
                self.release_branch(chain.branch_id)
                chain = None
        self.drop(req)
        if chain is not None:
            self.hits += 1
            self.short_hits += len(chain.tokens) < a.num_draft_tokens
        elif a.num_draft_tokens > 0:  # an ask for no drafts (k = 0) has nothing to miss
            self.misses += 1
            missed.add(a.request_id)
        return chain

    def _rank(self, req: DraftRequest, verdict: tuple[int, ...]) -> None:
        """Counts the rank of the verdict's added token among its position's guesses, for the
        spread (a bonus position whose guesses were not made is not counted)."""
        j = len(verdict) - 1
        if not self.config.draft_ahead_spread or j >= len(req.guesses) or j > len(req.drafts):
            return
        guesses = ahead.guesses_at(req.guesses[j], req.drafts, j)
        token = verdict[-1]
        self._ranks.add(j, j == len(req.drafts), guesses.index(token) if token in guesses else None)

    def apply_chain(self, request_id: str, chain: ahead.Chain, k: int, applied: set[str]) -> None:
        """The chain's slot becomes the request's; the request's old slot goes. Asked for fewer
        drafts than the chain holds (the hub lowered k), the KV keeps those it sends: all but
        the last, as after drafting them, so the next forward appends where they end."""
        assert self.runner is not None and 0 < k <= len(chain.tokens)
        self.runner.swap(request_id, chain.branch_id)
        self.release_branch(chain.branch_id)
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

    def drop(self, req: DraftRequest) -> None:
        for c in req.chains.values():
            self.release_branch(c.branch_id)
        req.chains.clear()

    def release_branch(self, branch_id: str) -> None:
        assert self.runner is not None
        self.runner.release(branch_id)
