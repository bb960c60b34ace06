"""Dynamic speculation: the hub chooses each step's k from what it measures.

A step of batch B at k drafted tokens per request takes about T(k) = base + k * per_token
(the verify, the hub and the transport, plus one draft forward per token; with draft-ahead the
measured per-token cost is what the pass ahead did not hide), and a step without drafts T(0);
base is taken as at least T(0), since a step that drafts does all that one without does.
A request commits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens per step, where a_j is
the measured rate at which the j-th draft token is accepted given that those before it were.
The hub runs the k in [0, K] that maximises E(k) / T(k): speculation turns itself off where it
does not pay (poor acceptance, large batches whose verify costs more than it commits) and back
on when it does.

Each time is the median of its last TIME_SAMPLES measurements in the batch's bucket, and the
first comparison waits for MIN_TIMES of each: one step can be far off (the draft busy with new
requests' prefills, a collection, a first use), and a time that is measured only while its k
runs would keep such an outlier for good.

Probes keep the choice honest. Now and then a step runs another k than the best: K, to measure
the acceptance of the positions past the chosen k, and 0, to time a step without drafts again
(the choice between speculating and not rests on that time, which is measured only at k = 0).
Where both are needed they alternate. The first probe comes `probe_every` steps after the
choice settled; each probe after which the choice stays the same doubles the wait for the
next, up to PROBE_EVERY_MAX; a change of choice, or a probe at K whose first drafts were
accepted clearly more often than measured (beyond two binomial standard deviations), starts
again from `probe_every`. Probes therefore cost less and less while the choice holds (a probe
at K where speculation does not pay is a step that drafts K tokens for little), and a return
of acceptance is seen at the next probe, after which probes come often again until the choice
moves. Acceptance counts decay with each step that drafts, so the choice follows the traffic.

A request's own k is an upper bound. A sampled request with a seed of its own keeps its k:
the accept/reject path and a k = 0 step draw different (equally distributed) tokens, so a
k that depends on the batch would make its output depend on the batch. Greedy output does not
depend on k, and unseeded requests promise no particular sample, so both follow the choice.
The choice changes which tokens are drafted, never how they are accepted: the output stays
the target's distribution.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.99  # per step with drafts: acceptance over about the last 100 such steps
TIME_SAMPLES = 9  # the step times each estimate is the median of
MIN_TIMES = 3  # of each time (with drafts, without) before the two are compared
MIN_DRAFTS = 16.0  # first-position drafts seen before the acceptance is trusted
PROBE_EVERY = 32  # steps at one choice before the first probe
PROBE_EVERY_MAX = 256  # the longest wait between two probes, once each confirmed the choice


def _samples() -> deque[float]:
    return deque(maxlen=TIME_SAMPLES)


@dataclass(slots=True)
class _Times:
    """Step times (seconds) of one batch-size bucket, the last TIME_SAMPLES of each."""

    base: deque[float] = field(default_factory=_samples)  # speculative steps less their drafts
    per_token: deque[float] = field(default_factory=_samples)  # draft time per drafted position
    plain: deque[float] = field(default_factory=_samples)  # steps without drafts

    def add(self, k: int, step_s: float, draft_s: float) -> None:
        if k > 0:
            self.base.append(max(step_s - draft_s, 0.0))
            self.per_token.append(draft_s / k)
        else:
            self.plain.append(step_s)


@dataclass(slots=True)
class KChooser:
    """The k of each step for requests drafted by one proposer, up to `max_k`."""

    max_k: int
    probe_every: int = PROBE_EVERY
    drafted: list[float] = field(init=False)  # position j: drafts there (all before accepted)
    accepted: list[float] = field(init=False)
    probe_every_max: int = PROBE_EVERY_MAX
    _times: dict[int, _Times] = field(init=False, default_factory=dict)
    _since: int = field(init=False, default=0)  # steps at the choice since the last probe
    _interval: int = field(init=False, default=0)  # such steps before the next probe
    _last: int | None = field(init=False, default=None)  # the last choice
    _probes: int = field(init=False, default=0)  # probes run (they alternate up and down)
    _probing: bool = field(init=False, default=False)  # the last step was a probe at K

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
            self._interval, self._since = self.probe_every, 0

    def choose(self, batch: int, upper: int, fixed: int = 0) -> int:
        """This step's k, at most `upper` (the largest k the step's requests ask for), for a
        batch of `batch` requests of which some keep a k of their own, the largest `fixed`:
        `upper` until acceptance and MIN_TIMES speculative step times are known, then steps at
        0 until MIN_TIMES of those are timed, then the best by E(k) / T(k), with probes
        (`_probe`). With `fixed` > 0 the step drafts that many anyway, so a smaller k would
        save nothing: the best k in [fixed, upper]."""
        upper = min(upper, self.max_k)
        times = self._times.get(_bucket(batch))
        if upper < 1 or self.acceptance() is None or times is None:
            return upper
        if len(times.base) < MIN_TIMES:
            return upper
        base, per_token = statistics.median(times.base), statistics.median(times.per_token)
        if fixed > 0:
            ks = range(min(fixed, upper), upper + 1)
            return max(ks, key=lambda k: self.expected_tokens(k) / (base + k * per_token))
        if len(times.plain) < MIN_TIMES:  # else k = 1 could run for good
            return 0
        plain = statistics.median(times.plain)
        # a step that drafts does all a step without drafts does (and verifies more): a
        # measured base below T(0) is noise, which must not make drafts that are never
        # accepted look free
        base = max(base, plain)
        best, best_rate = 0, 1.0 / plain
        for k in range(1, upper + 1):
            rate = self.expected_tokens(k) / (base + k * per_token)
            if rate > best_rate:
                best, best_rate = k, rate
        return self._probe(best, upper)

    def _probe(self, best: int, upper: int) -> int:
        """`best`, or a probe: `upper` (the positions past `best` measured) or 0 (a step
        without drafts timed again), alternating where both differ from `best`; the first
        after `probe_every` steps at one choice, each next after twice as many while the
        choice holds, up to `probe_every_max`."""
        if best != self._last:  # a new choice: probes come at the first interval again
            self._last, self._interval, self._since = best, self.probe_every, 0
        self._since += 1
        if self._since < self._interval:
            return best
        self._since = 0
        self._interval = min(2 * self._interval, self.probe_every_max)
        ways = [k for k in (upper, 0) if k != best]
        k = ways[self._probes % len(ways)]
        self._probes += 1
        self._probing = k > 0
        return k


def _bucket(batch: int) -> int:
    """Batch sizes whose steps cost about the same: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()
