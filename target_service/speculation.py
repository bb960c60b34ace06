"""Dynamic speculation: the hub chooses each step's k from what it measures.

A step of batch B at k drafted tokens per request takes about T(k) = base + k * per_token
(the verify, the hub and the transport, plus one draft forward per token; with draft-ahead the
measured per-token cost is what the pass ahead did not hide), and a step without drafts T(0);
base is taken as at least T(0), since a step that drafts does all that one without does.
A request commits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens per step, where a_j is
the measured rate at which the j-th draft token is accepted given that those before it were.
The hub runs the k in [0, K] that maximises E(k) / T(k): speculation turns itself off where it
does not pay (poor acceptance, large batches whose verify costs more than it commits) and back
on when it does, because a step at k = K now and then (a probe) keeps measuring the
acceptance of every position while the chosen k is lower. The first probe comes `probe_every`
steps after the choice fell below K; each probe after which the choice stays the same doubles
the wait for the next, up to PROBE_EVERY_MAX; a change of choice, or a probe whose first
drafts were accepted clearly more often than measured (beyond two binomial standard
deviations), starts again from `probe_every`. Where speculation does not pay, probes (each a
step that drafts K tokens for nothing) cost less and less, and a return of acceptance is
seen at the next probe, after which probes come often again until the choice moves.
Acceptance counts decay with each step that drafts, so the choice follows the traffic.

A request's own k is an upper bound. A sampled request with a seed of its own keeps its k:
the accept/reject path and a k = 0 step draw different (equally distributed) tokens, so a
k that depends on the batch would make its output depend on the batch. Greedy output does not
depend on k, and unseeded requests promise no particular sample, so both follow the choice.
The choice changes which tokens are drafted, never how they are accepted: the output stays
the target's distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY = 0.99  # per step with drafts: acceptance over about the last 100 such steps
TIME_WEIGHT = 0.1  # of each new step in the step-time averages
MIN_DRAFTS = 16.0  # first-position drafts seen before the acceptance is trusted
PROBE_EVERY = 32  # steps below K before the first probe at k = K
PROBE_EVERY_MAX = 256  # the longest wait between two probes, once each confirmed the choice


@dataclass(slots=True)
class _Times:
    """Step-time averages (seconds) of one batch-size bucket."""

    base: float | None = None  # a speculative step less its draft forwards
    per_token: float | None = None  # the draft's forward time per drafted position
    plain: float | None = None  # a step without drafts

    def add(self, k: int, step_s: float, draft_s: float) -> None:
        if k > 0:
            self.base = _average(self.base, max(step_s - draft_s, 0.0))
            self.per_token = _average(self.per_token, draft_s / k)
        else:
            self.plain = _average(self.plain, step_s)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + TIME_WEIGHT * (new - old)


@dataclass(slots=True)
class KChooser:
    """The k of each step for requests drafted by one proposer, up to `max_k`."""

    max_k: int
    probe_every: int = PROBE_EVERY
    drafted: list[float] = field(init=False)  # position j: drafts there (all before accepted)
    accepted: list[float] = field(init=False)
    probe_every_max: int = PROBE_EVERY_MAX
    _times: dict[int, _Times] = field(init=False, default_factory=dict)
    _below: int = field(init=False, default=0)  # steps run below `upper` since a probe
    _interval: int = field(init=False, default=0)  # steps below `upper` before the next probe
    _last: int | None = field(init=False, default=None)  # the last choice
    _probing: bool = field(init=False, default=False)  # the last choice was a probe

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}.")
        if not 1 <= self.probe_every <= self.probe_every_max:
            raise ValueError(f"probe_every must be in [1, probe_every_max], got "
                             f"{self.probe_every} and {self.probe_every_max}.")  # fmt: skip
        self._interval = self.probe_every
        self.drafted = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def acceptance(self) -> list[float] | None:
        """a_1..a_K, or None until enough drafts were seen (an unseen position counts as the
        one before it)."""
        if self.drafted[0] < MIN_DRAFTS:
            return None
        rates, last = [], 0.0
        for d, a in zip(self.drafted, self.accepted, strict=True):
            last = a / d if d > 0 else last
            rates.append(last)
        return rates

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a request commits per step at k (needs `acceptance`)."""
        rates = self.acceptance()
        assert rates is not None
        total, run = 1.0, 1.0
        for a in rates[:k]:
            run *= a
            total += run
        return total

    def observe(
        self, batch: int, ks: list[int], accepted: list[int], step_s: float, draft_s: float
    ) -> None:
        """One step of `batch` requests: the k and accepted drafts of this proposer's requests,
        the step's time and its draft forward time."""
        if self._probing:
            self._probing = False
            self._probed(ks, accepted)
        if any(ks):  # counts age with new drafts, not with steps run at k = 0
            for j in range(self.max_k):
                self.drafted[j] *= DECAY
                self.accepted[j] *= DECAY
        for k, a in zip(ks, accepted, strict=True):
            for j in range(min(k, a + 1, self.max_k)):  # tested: all before it accepted
                self.drafted[j] += 1.0
                self.accepted[j] += 1.0 if j < a else 0.0
        k_step = max(ks, default=0)
        self._times.setdefault(_bucket(batch), _Times()).add(k_step, step_s, draft_s)

    def _probed(self, ks: list[int], accepted: list[int]) -> None:
        """A probe's first drafts accepted clearly more often than measured (acceptance is
        coming back): the next probe comes `probe_every` steps on, not after the backed-off
        wait."""
        rates = self.acceptance()
        if rates is None:
            return
        n = sum(k > 0 for k in ks)
        hits = sum(k > 0 and a > 0 for k, a in zip(ks, accepted, strict=True))
        p = rates[0]
        if hits > n * p + 2.0 * math.sqrt(n * p * (1.0 - p)) + 0.5:
            self._interval, self._below = self.probe_every, 0

    def choose(self, batch: int, upper: int, fixed: int = 0) -> int:
        """This step's k, at most `upper` (the largest k the step's requests ask for), for a
        batch of `batch` requests of which some keep a k of their own, the largest `fixed`:
        `upper` until acceptance and speculative step times are known, then one step at 0 to
        time a step without drafts, then the best by E(k) / T(k); a probe at `upper` after
        `probe_every` steps below it, then after twice as many while the choice holds (up to
        `probe_every_max`). With `fixed` > 0 the step drafts that many anyway, so a smaller k
        would save nothing: the best k in [fixed, upper]."""
        upper = min(upper, self.max_k)
        times = self._times.get(_bucket(batch))
        if upper < 1 or self.acceptance() is None or times is None or times.base is None:
            return upper
        assert times.per_token is not None
        if fixed > 0:
            per_token, base = times.per_token, times.base
            ks = range(min(fixed, upper), upper + 1)
            return max(ks, key=lambda k: self.expected_tokens(k) / (base + k * per_token))
        if times.plain is None:  # one step at k = 0 measures it (else k = 1 could run for good)
            return 0
        # a step that drafts does all a step without drafts does (and verifies more): a
        # measured base below T(0) is noise, which must not make drafts that are never
        # accepted look free
        base = max(times.base, times.plain)
        best, best_rate = 0, 1.0 / times.plain
        for k in range(1, upper + 1):
            rate = self.expected_tokens(k) / (base + k * times.per_token)
            if rate > best_rate:
                best, best_rate = k, rate
        if best != self._last:  # a new choice: probes come at the first interval again
            self._last, self._interval, self._below = best, self.probe_every, 0
        if best == upper:
            self._below = 0
            return best
        self._below += 1  # positions past `best` are measured only by probes
        if self._below >= self._interval:
            self._below, self._probing = 0, True
            self._interval = min(2 * self._interval, self.probe_every_max)
            return upper
        return best


def _bucket(batch: int) -> int:
    """Batch sizes whose steps cost about the same: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()
