"""The draft model's forwards for one block: the step heads that sample inside the captured
graphs, and k_i drafts per request read back with one host synchronisation.

A block's requests are caught up first: each one's KV keeps its longest prefix that agrees with
the committed tokens S (length n), at most S[:n-1], and one ragged step forwards the missing
tails and samples d_1 at absolute position n; then k - 1 one-token steps (`graph_step`: a CUDA
graph on GPU) each sample one more. The KV then holds S + d_1 .. d_{k-1}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draft_service import ahead
from draft_service.config import DraftConfig
from draft_service.sampling import sample_draft
from specdec.runner import ForwardItem, ModelRunner
from specdec.runner.timing import StepClock, StepTimes
from specdec.runner.trace import host_span, trace_of
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftQ, SparseQ

Head = Callable[..., tuple[torch.Tensor, ...]]

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


@dataclass(slots=True)
class DraftRequest:
    """A request as the draft holds it: its committed tokens, its KV, its last drafts and the
    chains drafted ahead for its next step."""

    tokens: list[int]  # prompt + committed tokens
    sampling: SamplingParams
    next_step: int
    kv: list[int] = field(default_factory=list)  # tokens in the runner's KV cache
    drafts: list[int] = field(default_factory=list)  # the last proposal's, for draft-ahead
    k: int = 0  # the k the last ask wanted (a backup proposal drafted none of them)
    guesses: list[list[int]] = field(default_factory=list)  # [k][guess_count] ids a draft
    chains: dict[tuple[int, ...], ahead.Chain] = field(default_factory=dict)  # by verdict
    chains_step: int = -1  # the step the chains are drafts for
    fixed_k: bool = False  # the last ask's k is fixed (a seeded request): its chains hold k


@dataclass(frozen=True, slots=True)
class Spawn:
    """Branches of a catch-up row (a request that drafted nothing last step, so that its KV
    lacks the committed tokens and no chain could be forked before its catch-up): after the
    block's first step each of `branch_ids` (added to the runner) takes the row's KV, then
    drafts `k` tokens in steps 1 .. k, the i-th one's first input the row's guess of rank i
    for the position after the row's last token. Its tokens, q rows and positions are those
    of a request [*committed, guess] drafting k, as in a pass of its own after the catch-up:
    the same seeded draws, without the second pass's forward and host synchronisation."""

    row: int  # the catch-up row in the block
    branch_ids: tuple[str, ...]
    k: int


@dataclass(frozen=True, slots=True)
class _Rows:
    """A block's rows, its requests' then the spawned branches': ids, the step each drafts
    first and the step after its last, and the request row whose sampling inputs it uses."""

    ids: list[str]
    first: list[int]
    end: list[int]
    parent: list[int]
    rank: list[int]  # a branch's guess rank; -1 for a request

    @classmethod
    def of(cls, ids: list[str], ks: list[int], spawns: Sequence[Spawn]) -> _Rows:
        n = range(len(ids))
        branches = [(s, b, rank) for s in spawns for rank, b in enumerate(s.branch_ids)]
        return cls(
            [*ids, *(b for _, b, _ in branches)],
            [*(0 for _ in n), *(1 for _ in branches)],
            [*ks, *(1 + s.k for s, _, _ in branches)],
            [*n, *(s.row for s, _, _ in branches)],
            [*(-1 for _ in n), *(r for _, _, r in branches)],
        )

    def at(self, j: int) -> list[int]:
        """The rows that draft in step j."""
        return [b for b in range(len(self.ids)) if self.first[b] <= j < self.end[b]]

    def inputs(
        self,
        steps: list[_Step],
        rows: list[int],
        j: int,
        upload: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Step j's input tokens of `rows` on the device: each continuing row's token of the
        step before; a branch starting now, its parent's guess of its rank from step 0.

        Example: step 0 drafted rows [0, 1] and guessed [[5, 6], [7, 8]]; rows [0, 2] at step
        1, row 2 a branch of row 1 with rank 1: tokens [step 0's token of row 0, 8]."""
        if not any(self.first[b] == j for b in rows):
            return steps[-1].select(rows, upload)
        first = steps[0]
        assert j == 1 and first.guesses is not None
        width = first.guesses.shape[1]
        source = torch.cat([steps[-1].tokens, first.guesses.reshape(-1).to(steps[-1].tokens.dtype)])
        where = {b: i for i, b in enumerate(steps[-1].rows)}
        at0 = {b: i for i, b in enumerate(first.rows)}
        index = [
            len(steps[-1].rows) + at0[self.parent[b]] * width + self.rank[b]
            if self.first[b] == j
            else where[b]
            for b in rows
        ]
        return source[upload(torch.tensor(index))]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Drafter:
    """The draft model's steps for a block of requests, and the heads they sample with (made
    once: the runner captures a graph per (shape, head))."""

    def __init__(self, config: DraftConfig, runner: ModelRunner | None, vocab_size: int):
        self.runner = runner
        support = config.support_size if config.q_form == "sparse" else None
        # Saguaro sampling scales down the F + 1 tokens draft-ahead guesses first (`with_guesses`;
        # the spread guesses up to 2F + 1)
        scaled = min(config.draft_ahead + 1, vocab_size)
        self._head = make_head(vocab_size, support, config.saguaro_scale, scaled)
        self._greedy_head = make_greedy_head(vocab_size)
        guesses = min(config.guess_count, vocab_size)
        self._guessing_heads = (
            with_guesses(self._head, vocab_size, guesses),
            with_guesses(self._greedy_head, vocab_size, guesses),
        )
        self._trace = trace_of(runner)  # host spans of the launches and the read, where on
        if runner is not None:  # the `last` head input of one-token steps: row 0
            self._zeros = torch.zeros(
                runner.config.max_slots, dtype=torch.long, device=runner.config.device
            )

    def bonus_step(self, ids: list[str], last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One greedy one-token step of `last` [B, 1] with the guessing head: the guesses for
        the token after it (draft-ahead's all-accepted verdict), last in the outputs."""
        assert self.runner is not None
        out = self.runner.graph_step(ids, last, self._guessing_heads[1], (self._zeros[: len(ids)],))
        assert isinstance(out, tuple)
        return out

    def drafts(
        self,
        ids: list[str],
        reqs: list[DraftRequest],
        ks: list[int],
        guess: bool,
        span: str = "draft",
        spawns: Sequence[Spawn] = (),
    ) -> tuple[list[list[int]], DraftQ, list[bool], list[list[list[int]]], StepTimes]:
        """k_i tokens per request: one catch-up step over the tokens the KV lacks (padded to
        the longest, a CUDA graph where one fits), then k - 1 one-token steps, each fed the
        previous step's tokens on the device. Sampling and q rows are written inside the
        graphs; one host synchronisation reads the drafts and the q rows the block sends.
        Returns the tokens by request, the q rows of the sampled (not greedy) requests in
        order, which requests were sampled, with `guess` each draft position's guesses
        (draft-ahead's, `with_guesses`), and the device time (traced as `span`).

        With `spawns` (and `guess`), each spawn's branches follow the requests in every
        returned list, in order: rows that start at step 1 from their row's guess (`Spawn`),
        so that a request that drafted nothing gets chains in the same pass as its catch-up.
        A branch's q rows and guesses are its k draft positions', like a request's."""
        runner = self.runner
        assert runner is not None and (guess or not spawns)
        eager, graphs = runner.eager_steps, runner.graph_steps
        start = time.perf_counter()
        clock = StepClock(runner.device)
        clock.mark()
        tails = self._catch_up_tails(ids, reqs)
        # temperature, top_k, top_p, seed, position, and each tail's last real position
        *inputs, last = self._sampling_inputs(reqs, [len(t) - 1 for t in tails])
        rows = _Rows.of(ids, ks, spawns)
        sampled = [not reqs[r].sampling.greedy for r in rows.parent]
        heads = self._guessing_heads if guess else (self._head, self._greedy_head)
        head = heads[0] if any(sampled) else heads[1]
        _, out = runner.ragged_step(ids, tails, head, (last, *inputs))
        steps = [_kept(list(range(len(ids))), out, guess)]
        for j in range(1, max(rows.end)):
            if j == 1 and spawns:  # the branches take their row's KV, the catch-up's included
                runner.fork([(ids[s.row], b, runner.cached_length(ids[s.row]))
                             for s in spawns for b in s.branch_ids])  # fmt: skip
            now = rows.at(j)
            prev = rows.inputs(steps, now, j, runner.upload)
            parents = [rows.parent[b] for b in now]
            identity = parents == list(range(len(ids)))
            sel = None if identity else runner.upload(torch.tensor(parents))
            step_in = [t if sel is None else t[sel] for t in inputs]
            step_in[4] = step_in[4] + j
            zero = self._zeros[: len(now)]
            outs = runner.graph_step([rows.ids[b] for b in now], prev[:, None], head,
                                     (zero, *step_in))  # fmt: skip
            assert isinstance(outs, tuple)
            steps.append(_kept(now, outs, guess))
        clock.mark()
        host_span(self._trace, f"{span}: launch", start)
        start = time.perf_counter()
        counts = [e - f for f, e in zip(rows.first, rows.end, strict=True)]
        # the step's one sync
        drafted, q, guesses = _read_drafts(steps, counts, sampled, runner, rows.first)
        host_span(self._trace, f"{span}: read", start)
        for b, req in enumerate(reqs):
            req.kv = req.tokens + drafted[b][: ks[b] - 1]
        graphed = runner.eager_steps == eager and runner.graph_steps > graphs
        times = StepTimes(clock.seconds(0, 1, span), 0.0, graphed)
        return drafted, q, sampled, guesses, times

    def _catch_up_tails(self, ids: list[str], reqs: list[DraftRequest]) -> list[list[int]]:
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
            keep = min(common_prefix(req.kv, req.tokens), len(req.tokens) - 1)
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

    def _sampling_inputs(self, reqs: list[DraftRequest], last: list[int]) -> list[torch.Tensor]:
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
    steps: list[_Step],
    ks: list[int],
    sampled: list[bool],
    runner: ModelRunner,
    first: list[int] | None = None,
) -> tuple[list[list[int]], DraftQ, list[list[list[int]]]]:
    """Every request's drafted tokens, the q rows of the sampled requests, request-major
    (request b's k_b rows together, as a DraftBlock holds them), and each request's guesses
    per draft position where the steps made them (else []), read with one host sync. Request
    b drafts in steps first[b] .. first[b] + k_b - 1 (`first`: 0 for all; a spawned branch
    starts at 1).

    Example, ks [2, 1], both sampled: the steps hold rows [b0 j0, b1 j0] and [b0 j1], i.e.
    rows 0, 1, 2 concatenated; the block's rows are [b0 j0, b0 j1, b1 j0] = rows [0, 2, 1].
    """
    first = first or [0] * len(ks)
    where = torch.full((len(ks), len(steps)), -1, dtype=torch.long)  # (request, step) → row
    start = 0
    for j, step in enumerate(steps):
        where[torch.tensor(step.rows), j] = torch.arange(start, start + len(step.rows))
        start += len(step.rows)
    index_j = torch.arange(len(steps))[None, :]
    begin = torch.tensor(first)[:, None]
    drafted_mask = (index_j >= begin) & (index_j < begin + torch.tensor(ks)[:, None])  # [B, steps]
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
    drafted = [row[f : f + k] for row, f, k in zip(table, first, ks, strict=True)]
    guesses: list[list[list[int]]] = [[] for _ in ks]
    if guessed:
        per_step = host.pop(1)[where.clamp(min=0)].tolist()  # [B, steps, F + 1]
        guesses = [row[f : f + k] for row, f, k in zip(per_step, first, ks, strict=True)]
    if not index:
        return drafted, None, guesses
    if len(host) == 2:
        return drafted, DenseQ(host[1]), guesses
    return drafted, SparseQ(host[2], host[1]), guesses


def q_tensors(q: DraftQ) -> tuple[torch.Tensor, ...] | None:
    """q's tensors row-aligned: (probs,) dense, (probs, token_ids) sparse."""
    if q is None:
        return None
    if isinstance(q, DenseQ):
        return (q.probs,)
    return (q.probs, q.token_ids)


class QRows:
    """Consecutive slices of a block's q rows (`q_tensors`), entry by entry in block order:
    each sampled entry's k rows follow the previous entry's."""

    def __init__(self, q: DraftQ) -> None:
        self._tensors, self._start = q_tensors(q) or (), 0

    def take(self, n: int) -> tuple[torch.Tensor, ...]:
        """The next entry's n rows."""
        start, self._start = self._start, self._start + n
        return tuple(t[start : start + n] for t in self._tensors)


def q_from_rows(rows: list[tuple[torch.Tensor, ...]]) -> DraftQ:
    """The block's q from each sampled entry's rows (in block order)."""
    if not rows:
        return None
    parts = [torch.cat(list(column)) for column in zip(*rows, strict=True)]
    return DenseQ(parts[0]) if len(parts) == 1 else SparseQ(parts[1], parts[0])
