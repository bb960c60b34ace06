"""Draft-ahead: while the target verifies step s, the draft drafts step s + 1 for the verdicts
it thinks likely, so that a verdict it guessed finds its drafts ready.

After proposing d_1..d_k on the committed sequence S (length n), the verdict of step s commits
S + d_1..d_j + t for some accepted count j in [0, k] and added token t (the recovered token
when j < k, the bonus token when j = k). For each j and each of the draft's own top-F
tokens t at that position (never d_{j+1}: a rejection does not add the token it rejected), a
*hypothesis* drafts k tokens on S + d_1..d_j + t in a KV slot of its own, forked from the
request's at length n + j. The guesses for j < k come out of the proposal's own draft forwards
(the same captured graphs, `drafting.with_guesses`); the all-accepted verdict's (j = k) take one
more draft forward, of d_k, made only while that verdict comes true often enough. Example,
k = 2, F = 1, drafts (7, 9): hypotheses (j=0: t=g0), (j=1: 7, g1), (j=2: 7, 9, g2), where g_j
is the draft's best token at that position other than d_{j+1}. Only the accepted counts that
come true are drafted (`AcceptedCounts`), and one pass drafts at most as many hypotheses as the
largest captured graph holds.

The next ask carries the verdict's tokens as new_token_ids. If they equal a hypothesis's
(d_1..d_j, t) and the ask is for step s + 1, that hypothesis's drafts and q are the answer and
its slot becomes the request's (a hit: no forward on the critical path); otherwise the draft
drafts as without draft-ahead (a miss). Every other hypothesis is dropped.

Exactness: draws are keyed by (seed, absolute position, stream), never by batch row, so a
hypothesis drafted on exactly the prefix the verdict committed draws with the keys a lock-step
draft would use on that prefix, and its q is the distribution it sampled from. A hit is used only
when the committed prefix equals the hypothesis's (the key is the whole verdict), so the target
receives drafts and q that a lock-step draft could have sent: the output distribution stays the
target's. The guesses only decide how often that happens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.synthetic_keys import key_uniform

BRANCH_MARK = "\x1f"  # in no admitted request id: the draft engine refuses ids holding it


@dataclass(slots=True)
class Chain:
    """A hypothesis's drafts, ready to be the answer to the next ask."""

    branch_id: str  # its KV slot's id in the runner
    tokens: list[int]  # [k] drafted tokens
    q: tuple[torch.Tensor, ...] | None  # (probs [k, K'|V], ids [k, K']?) on the host; None: greedy
    kv: list[int]  # the tokens its KV slot holds
    guesses: list[list[int]]  # [k][F + 1]: its own guesses, for the step after it


@dataclass(slots=True)
class Hypothesis:
    """One guessed verdict of the last step: j drafts accepted, then `token` added."""

    accepted: int
    token: int

    def verdict(self, drafts: list[int]) -> tuple[int, ...]:
        """The new_token_ids the next ask carries if this hypothesis comes true."""
        return (*drafts[: self.accepted], self.token)


def branch_id(request_id: str, h: Hypothesis) -> str:
    return f"{request_id}{BRANCH_MARK}{h.accepted}:{h.token}"


def spawn_id(request_id: str, rank: int) -> str:
    """The slot of a chain spawned from a catch-up (`drafting.Spawn`): its token, the guess of
    this rank, is not known when the slot is taken."""
    return f"{request_id}{BRANCH_MARK}next:{rank}"


def guesses_at(ids: list[int], drafts: list[int], accepted: int) -> list[int]:
    """The guesses, best first, of the token a verdict that accepts `accepted` of `drafts`
    adds: the draft's best `ids` at that position but the draft it rejected (a rejection does
    not add the token it rejected; after all of them nothing was rejected)."""
    rejected = drafts[accepted] if accepted < len(drafts) else None
    return [t for t in ids if t != rejected]


def hypotheses(
    top: list[list[int]],  # [m][F + 1]: the draft's best ids at positions n .. n + m - 1
    drafts: list[int],  # [k]
    fanout: int,
) -> list[Hypothesis]:
    """The hypotheses worth drafting, best first: every accepted count's first guess, then every
    count's second, and so on (a slot shortage drops the last ones).

    >>> [(h.accepted, h.token) for h in hypotheses([[7, 3], [9, 4], [5, 2]], [7, 9], 1)]
    [(0, 3), (1, 4), (2, 5)]
    """
    per_count = []
    # a verdict accepts at most every draft: rows past that would fork past what the KV holds
    # and give verdict keys that collide with the real counts' (a leaked slot each)
    for j, ids in enumerate(top[: len(drafts) + 1]):
        per_count.append(guesses_at(ids, drafts, j)[:fanout])
    return [
        Hypothesis(j, guesses[rank])
        for rank in range(fanout)
        for j, guesses in enumerate(per_count)
        if rank < len(guesses)
    ]


@dataclass(slots=True)
class AcceptedCounts:
    """How often each accepted count j has come true: hypotheses of counts that (almost) never
    happen are not drafted, so the draft's batch holds the likely ones (with a synthetic
    acceptance length of 3, only j = 2)."""

    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0
    # verdicts before any count is left out. Until then every pass also runs the bonus forward
    # (`AheadPass._bonus_guesses`) with a host sync of its own: 1.8 ms of a 7.3 ms pass at batch 1
    # on an H200 (1B draft, F = 2). A count left out this early comes back as soon as it is
    # seen: one sighting in the first 50 verdicts is a share of 2% or more
    min_seen: int = 16
    min_share: float = 0.02  # a count seen less often than this is left out

    def add(self, accepted: int) -> None:
        self.counts[accepted] = self.counts.get(accepted, 0) + 1
        self.total += 1

    def wants(self, accepted: int) -> bool:
        """Whether hypotheses with this accepted count are worth drafting."""
        if self.total < self.min_seen:
            return True
        return self.counts.get(accepted, 0) / self.total >= self.min_share

    def probability(self, accepted: int, k: int) -> float:
        """The estimated chance that a verdict on k drafts accepts `accepted` of them (each of
        the k + 1 counts starts from one pseudo-verdict)."""
        return (self.counts.get(accepted, 0) + 1) / (self.total + k + 1)

    def likely(self, found: list[Hypothesis]) -> list[Hypothesis]:
        """`found` without the unlikely counts, the likelier counts first within each rank."""
        if self.total < self.min_seen:
            return found
        share = {j: c / self.total for j, c in self.counts.items()}
        kept = [h for h in found if share.get(h.accepted, 0.0) >= self.min_share]
        rank: dict[int, int] = {}
        keyed = []
        for h in kept:
            r = rank.get(h.accepted, 0)
            rank[h.accepted] = r + 1
            keyed.append(((r, -share[h.accepted]), h))
        return [h for _, h in sorted(keyed, key=lambda x: x[0])]


SPREAD_DEPTH = 2  # accepted counts from this one on share a rank table (`GuessRanks`)
RANK_PRIOR = 4.0  # pseudo-verdicts of a rank table before any is seen: half on rank 0, ...


@dataclass(slots=True)
class GuessRanks:
    """How often the token a verdict added was the draft's r-th guess at its position (r = 0:
    its most likely token other than the draft it rejected), for the fan-out spread.

    Kept per (accepted count, bonus) up to SPREAD_DEPTH: a recovered token (j < k, a sample
    of the residual max(0, p - q)) ranks otherwise than a bonus token (j = k, a sample of p),
    and the first positions otherwise than later ones. Each table starts from RANK_PRIOR
    pseudo-verdicts, geometric over the ranks (half on rank 0, a quarter on rank 1, ...): with
    nothing seen yet the spread is SSD's geometric fan-out."""

    counts: dict[tuple[int, bool], list[int]] = field(default_factory=dict)
    totals: dict[tuple[int, bool], int] = field(default_factory=dict)

    def add(self, accepted: int, bonus: bool, rank: int | None) -> None:
        """A verdict of `accepted` drafts added its position's guess of this rank (None: a
        token it did not guess)."""
        key = (min(accepted, SPREAD_DEPTH), bonus)
        self.totals[key] = self.totals.get(key, 0) + 1
        if rank is not None:
            row = self.counts.setdefault(key, [])
            row.extend([0] * (rank + 1 - len(row)))
            row[rank] += 1

    def probability(self, accepted: int, bonus: bool, rank: int) -> float:
        """The estimated chance that such a verdict adds the guess of this rank."""
        key = (min(accepted, SPREAD_DEPTH), bonus)
        row = self.counts.get(key, [])
        seen = row[rank] if rank < len(row) else 0
        return (seen + RANK_PRIOR * 0.5 ** (rank + 1)) / (self.totals.get(key, 0) + RANK_PRIOR)


def spread(
    top: list[list[int]],  # [m][2F + 1]: the draft's best ids at positions n .. n + m - 1
    drafts: list[int],  # [k]; none for a backup proposal (its verdict accepts nothing)
    counts: AcceptedCounts,
    ranks: GuessRanks,
) -> list[tuple[float, Hypothesis]]:
    """Every hypothesis the guesses allow, with its estimated chance of being the verdict:
    P(j drafts accepted) (`AcceptedCounts.probability`) times P(the added token is that
    guess) (`GuessRanks`). Accepted counts left out by `counts` are left out here too.

    >>> [(h.accepted, h.token) for _, h in spread([[7, 3], [9, 4]], [7], AcceptedCounts(),
    ...                                           GuessRanks())]
    [(0, 3), (1, 9), (1, 4)]
    """
    k = len(drafts)
    found = []
    for j, ids in enumerate(top[: k + 1]):
        if drafts and not counts.wants(j):
            continue
        p_count = counts.probability(j, k) if drafts else 1.0
        found += [(p_count * ranks.probability(j, j == k, r), Hypothesis(j, t))
                  for r, t in enumerate(guesses_at(ids, drafts, j))]  # fmt: skip
    return found


def spread_order(
    chances: list[list[tuple[float, Hypothesis]]],
) -> list[tuple[int, Hypothesis]]:
    """(request index, hypothesis) of every request's `spread`, in the order a pass drafts
    them: each request's likeliest first (a request left without a chain drafts after its
    verdict, and a step of pushed chains then asks), then all the others by chance.

    >>> h = [Hypothesis(0, t) for t in range(4)]
    >>> [(i, x.token) for i, x in spread_order([[(0.5, h[0]), (0.4, h[1])], [(0.1, h[2])]])]
    [(0, 0), (1, 2), (0, 1)]
    """
    keyed = []
    for i, mine in enumerate(chances):
        for n, (p, hyp) in enumerate(sorted(mine, key=lambda x: -x[0])):
            keyed.append(((min(n, 1), -p, i), hyp))
    keyed.sort(key=lambda x: x[0])
    return [(key[2], hyp) for key, hyp in keyed]


def synthetic_hit(
    chains: dict[tuple[int, ...], Chain],
    verdict: tuple[int, ...],
    rate: float,
    request_id: str,
    step: int,
) -> tuple[int, ...]:
    """BENCHMARKING ONLY: the key of a chain with the verdict's accepted count, with probability
    `rate` (a hash of request and step, so reruns agree), else the verdict itself. The drafts
    then do not follow the committed tokens; only a synthetic acceptance test, which ignores
    them, may be served so."""
    if not synthetic_any(request_id, step, rate):
        return verdict
    same_count = [key for key in chains if len(key) == len(verdict)]
    return same_count[0] if same_count else verdict


def synthetic_any(request_id: str, step: int, rate: float) -> bool:
    """BENCHMARKING ONLY: whether `synthetic_hit` serves this ask a chain of its verdict's
    accepted count whatever the verdict's tokens (a hash of request and step below `rate`)."""
    return key_uniform(f"{request_id}:{step}") < rate


def synthetic_any_keys(chains: dict[tuple[int, ...], Chain], request_id: str, step: int,
                       rate: float) -> set[tuple[int, ...]]:  # fmt: skip
    """BENCHMARKING ONLY: the keys of the chains that `synthetic_hit` serves to an ask of this
    step whatever its verdict's tokens: the first of each length, if the hash says so."""
    if not synthetic_any(request_id, step, rate):
        return set()
    first: dict[int, tuple[int, ...]] = {}
    for key in chains:
        first.setdefault(len(key), key)
    return set(first.values())


EWMA_WEIGHT = 0.1  # of each new measurement in BackupChoice's averages
REMEASURE_EVERY = 32  # backups in a row after which misses are drafted now once, to time it


@dataclass(slots=True)
class BackupChoice:
    """Whether the asks that found no chain are drafted now or get a backup proposal of no
    drafts, by expected committed tokens per second of the step.

    Drafting them now makes the whole step wait for a draft pass: B requests commit L tokens
    each in T_step + T_draft. A backup (k = 0) commits one token for each of the m missed
    requests (a target sample: exact, and the output does not change for greedy requests) and
    L for the B - m hits, in T_step; their drafts for the next step are made behind the
    verify (`DraftEngine.draft_ahead`). So back up when ((B - m) L + m) / T_step exceeds
    B L / (T_step + T_draft). Example (8B / 1B on H100s, L = 3, T_step 7 ms, T_draft 5 ms):
    batch 8 with 2 misses backs up (3.1 against 2.0 tokens/ms); batch 1 with its one miss drafts
    now (0.25 against 0.14); at L = 1.5 that miss backs up too. L is the mean committed per
    verdict on drafts, T_draft the wall time of drafting now, both measured here; T_step is the
    hub's (ProposeBlock.target_step_s). Until all three are known, misses are drafted now; and
    once in REMEASURE_EVERY backups in a row, so that T_draft follows the draft's load (a first
    measurement that was slow would otherwise hold backups on for good).
    """

    mean_committed: float | None = None  # L
    draft_s: float | None = None  # T_draft
    backups_in_a_row: int = 0

    def committed(self, tokens: int) -> None:
        """A verdict on drafts committed `tokens`."""
        self.mean_committed = _average(self.mean_committed, float(tokens))

    def drafted(self, seconds: float) -> None:
        """A pass drafting missed asks now took `seconds`."""
        self.draft_s = _average(self.draft_s, seconds)
        self.backups_in_a_row = 0

    def backed_up(self) -> None:
        """The hub backed up a step's misses of its pushed chains (by `miss_share`)."""
        self.backups_in_a_row += 1

    def miss_share(self, step_s: float) -> float:
        """The share s of a step's asks below which its misses pay to back up: `pays` holds
        for m missed of B exactly when m < s B, s = L T_draft / ((T_step + T_draft)(L - 1)).
        The hub decides by it for pushed chains, which it takes without asking. 0 where `pays`
        holds for none (a figure unknown, or a remeasure due); inf where L <= 1."""
        length, draft_s = self.mean_committed, self.draft_s
        if length is None or draft_s is None or step_s <= 0:
            return 0.0
        if self.backups_in_a_row >= REMEASURE_EVERY:
            return 0.0
        if length <= 1.0:
            return math.inf
        return length * draft_s / ((step_s + draft_s) * (length - 1.0))

    def pays(self, asks: int, missed: int, step_s: float) -> bool:
        """Whether `missed` of `asks` requests with drafts wanted should take the backup (the
        rule above, as `miss_share` states it)."""
        pays = 0 < missed <= asks and missed < self.miss_share(step_s) * asks
        self.backups_in_a_row += pays
        return pays


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)
