"""A seeded sampled request's output does not depend on the draft's timing, through the client
API: the same seeded requests, beside unseeded ones, through a local pair drafting ahead and
through one in lock-step, each run once with the draft on time and once with its engine stuck
while they run (its lock held inside a Release, here in this process: it answers no Propose and
no probe either), give the same tokens, with the same k at every step.

What the hub promises (docs/design.md, "A seeded request's k does not depend on the draft's
timing"): during a stall the unseeded requests go on at k = 0, while a seeded one sits steps out
and waits for its drafts up to `seeded_deadline_s`; only a draft taken as down changes its k.
The stall here lasts past the hub's deadline (until steps have fallen back) and ends well
before `seeded_deadline_s`; the test checks that it took effect (steps fell back, the unseeded
request running beside ran at k = 0, the seeded ones ended after it). CPU, float32: the tokens
are equal bit for bit.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from specdec.client import AsyncClient
from tests.orchestrator.local_exactness import Served, serving_ahead
from tests.orchestrator.test_serve_exactness import PROMPT, K
from tests.orchestrator.test_serve_exactness_ahead import _total

MAX_REQUESTS = 8
SEEDED, SEEDED_TOKENS = 4, 96  # sent first
SHORT, SHORT_TOKENS = 2, 2  # unseeded, sent next: they end while the seeded ones run
ARMED_AT = 8  # tokens every seeded request has streamed when the short ones are sent
LONG_TOKENS = 128  # one unseeded request that runs through the stall, at k = 0
TEMPERATURE = 0.3  # draft-ahead's guesses hold the verdict often enough for hits
DEADLINE_S = 0.5  # the hub's deadline (its floor); a seeded request waits up to 10 of them
STALL_MAX_S = 4.0  # how long the stall waits at most for steps to fall back
STALL_AFTER_S = 0.5  # and then goes on for, while the seeded requests sit it out
FALLBACKS = "specdec:draft_fallback_steps_total"


class Stall:
    """While `on`, the draft engine stuck in its first Release, its lock held so that it
    answers no Propose and no probe either: the hub's release of the first request to end
    misses its deadline and the draft is stalled. The engine answers again STALL_AFTER_S after
    `fallen_back()` (steps went on at k = 0 past the deadline, which rises on a loaded machine)
    or after STALL_MAX_S, well short of the seeded requests' wait."""

    def __init__(self, engine: Any) -> None:
        self.on = False
        self.span: tuple[float, float] | None = None
        self.fallen_back: Callable[[], bool] = lambda: False
        self._lock = threading.Lock()
        self._engine_lock = engine._lock
        self._release: Callable[..., Any] = engine.release

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            stall = self.on and self.span is None
            if stall:  # its end is set once the engine answers again
                start = time.monotonic()
                self.span = (start, math.inf)
        if stall:
            with self._engine_lock:
                while not self.fallen_back() and time.monotonic() - start < STALL_MAX_S:
                    time.sleep(0.05)
                time.sleep(STALL_AFTER_S)
                self.span = (start, time.monotonic())
        return self._release(*args, **kwargs)


def _serving(tmp: Any, draft_ahead: int) -> Iterator[tuple[Served, Stall]]:
    with serving_ahead(tmp, MAX_REQUESTS, target={"draft_deadline_s": DEADLINE_S},
                       draft_ahead=draft_ahead) as served:  # fmt: skip
        engine = served.pair.draft_engine
        stall = Stall(engine)
        engine.release = stall  # the Release handler looks it up on every call
        yield served, stall


@pytest.fixture(scope="module")
def ahead(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Stall]]:
    yield from _serving(tmp_path_factory.mktemp("stall_ahead"), 2)


@pytest.fixture(scope="module")
def lockstep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Stall]]:
    yield from _serving(tmp_path_factory.mktemp("stall_lockstep"), 0)


Output = tuple[tuple[int, ...], tuple[int, ...], float]  # tokens, k per step, when it ended


async def _generate(address: str, stall: Stall | None) -> tuple[list[Output], Output]:
    """The seeded requests' outputs and the long unseeded one's. The short ones are sent once
    every seeded one has streamed ARMED_AT tokens; `stall`, if any, is armed just before, so
    that the short ones' release stalls the draft while the seeded ones run."""
    async with AsyncClient(address, timeout=300.0) as client:
        running = asyncio.Semaphore(0)

        async def seeded(seed: int) -> Output:
            tokens: list[int] = []
            steps: list[int] = []
            async for out in client.generate(
                list(PROMPT), max_tokens=SEEDED_TOKENS, ignore_eos=True,
                temperature=TEMPERATURE, seed=seed, proposer="draft", num_draft_tokens=K,
            ):  # fmt: skip
                was = len(tokens)
                tokens += out.token_ids
                steps += [s.num_draft_tokens for s in out.steps]
                if was < ARMED_AT <= len(tokens):
                    running.release()
            assert len(tokens) == SEEDED_TOKENS, tokens
            return tuple(tokens), tuple(steps), time.monotonic()

        async def unseeded(n: int) -> Output:
            out = await client.complete(
                list(PROMPT), max_tokens=n, ignore_eos=True, temperature=TEMPERATURE,
                proposer="draft", num_draft_tokens=K,
            )  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == n, out
            steps = tuple(s.num_draft_tokens for s in out.steps)
            return tuple(out.token_ids), steps, time.monotonic()

        firsts = [asyncio.create_task(seeded(700 + i)) for i in range(SEEDED)]
        long = asyncio.create_task(unseeded(LONG_TOKENS))
        for _ in range(SEEDED):
            await running.acquire()
        if stall is not None:
            stall.on = True
        await asyncio.gather(*(unseeded(SHORT_TOKENS) for _ in range(SHORT)))
        return list(await asyncio.gather(*firsts)), await long


def _run(pair: tuple[Served, Stall], stalled: bool) -> list[Output]:
    """The seeded requests' outputs; with `stalled`, checks that the stall took effect while
    they ran: steps fell back at the deadline, the long unseeded request ran at k = 0."""
    served, stall = pair
    stall.on, stall.span = False, None
    before = _total(served.orchestrator, FALLBACKS)
    stall.fallen_back = lambda: _total(served.orchestrator, FALLBACKS) > before
    t0 = time.monotonic()
    try:
        seeded, long = asyncio.run(_generate(served.address, stall if stalled else None))
    finally:
        stall.on = False
    fallbacks = _total(served.orchestrator, FALLBACKS) - before
    print(f"\n{'stalled' if stalled else 'on time'}: {fallbacks:.0f} steps fell back at the "
          "deadline")  # fmt: skip
    if stalled:
        assert stall.span is not None, "no Release was held up"
        start, end = stall.span
        ended = [e - t0 for _, _, e in seeded]
        print(f"stall from {start - t0:.2f} to {end - t0:.2f} s; the seeded requests ended at "
              + ", ".join(f"{e:.2f}" for e in ended) + " s")  # fmt: skip
        # they ran when it began, and sat it out (at k = 0 they would have ended meanwhile)
        assert all(start - t0 < e for e in ended), "a seeded one ended before the stall"
        assert all(end - t0 < e for e in ended), "a seeded one went on during the stall"
        assert fallbacks >= 1, "no step went on at k = 0 past the deadline"
        # (its step 0 is the prefill's, at k = 0 always)
        assert 0 in long[1][1:-1], "the long unseeded request never ran at k = 0"
    return seeded


def test_seeded_output_is_the_same_whatever_the_drafts_timing(
    ahead: tuple[Served, Stall], lockstep: tuple[Served, Stall]
) -> None:
    hits = "specdec:draft_ahead_hits_total"
    before = _total(ahead[0].orchestrator, hits)
    runs = {"ahead, on time": _run(ahead, False), "ahead, stalled": _run(ahead, True)}
    hits_ahead = _total(ahead[0].orchestrator, hits) - before
    runs |= {"lock-step, on time": _run(lockstep, False),
             "lock-step, stalled": _run(lockstep, True)}  # fmt: skip
    print(f"draft-ahead answered {hits_ahead:.0f} asks from chains")
    assert hits_ahead >= 10, "the draft-ahead pair seldom served a chain"
    first = runs["ahead, on time"]
    assert len({tokens for tokens, _, _ in first}) > 1, "the seeded requests drew alike"
    for name, out in runs.items():
        assert [t for t, _, _ in out] == [t for t, _, _ in first], f"{name}: other tokens"
        assert [ks for _, ks, _ in out] == [ks for _, ks, _ in first], f"{name}: other k"
