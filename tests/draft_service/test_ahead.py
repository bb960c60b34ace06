"""Draft-ahead (draft_service.ahead) over real gRPC on loopback, tiny local models.

A chain drafted ahead is used only when its verdict came true, and then it is what a lock-step
draft would have sent: seeded sampled output is token for token the same with draft-ahead on and
off (dense and sparse q, top-k / top-p, and a poor draft), so its distribution is the
lock-step one, which test_pipeline checks by chi-square; greedy output equals target-only greedy.
The hits must be real: a test that never hit would prove nothing.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import e2e_timeline
from draft_service import ahead
from draft_service.config import DraftConfig
from specdec.runner import ModelRunner, trace
from specdec.sampling_params import SamplingParams
from tests.draft_service.models import (
    TOKENIZER_VOCAB,
    build_checkpoints,
    greedy_reference,
    model_draft,
    services,
)

SLOTS, AHEAD_SLOTS = 64, 48


def with_ahead(
    draft: DraftConfig, fanout: int, backup: str = "auto", spread: bool = False
) -> DraftConfig:
    assert draft.runner is not None
    runner = replace(draft.runner, max_slots=SLOTS)
    slots = AHEAD_SLOTS if fanout else 0
    return replace(
        draft, runner=runner, draft_ahead=fanout, draft_ahead_slots=slots,
        draft_ahead_backup=backup, draft_ahead_spread=spread,  # type: ignore[arg-type]
    )  # fmt: skip


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [
        torch.randint(2, TOKENIZER_VOCAB, (4 + i % 3,), generator=gen).tolist() for i in range(n)
    ]


def _run(
    target_dir: Path, draft: DraftConfig, params: list[SamplingParams], k: int, n: int
) -> tuple[list[list[int]], int, int]:
    """Each request's tokens, and the draft's draft-ahead hits and misses (the pipeline asks
    with fixed_num_draft_tokens for sampled requests, as the hub does for seeded ones)."""
    prompts = _prompts(len(params))
    with services(target_dir, draft, sampler_impl="torch") as svc:
        pipe = svc.pipeline()
        ids = [f"r{i}" for i in range(len(params))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            pipe.admit(rid, prompt, p)
        pipe.generate(dict.fromkeys(ids, k), n)
        out = [pipe.requests[r].generated[:n] for r in ids]
        pipe.close()
        return out, svc.draft_engine.ahead_hits, svc.draft_engine.ahead_misses


def test_hypotheses_skip_the_rejected_draft_and_rank_guesses() -> None:
    top = [[7, 3, 8], [9, 4, 1], [5, 2, 6]]  # the draft's best ids at positions n, n+1, n+2
    got = [(h.accepted, h.token) for h in ahead.hypotheses(top, [7, 9], 2)]
    assert got == [(0, 3), (1, 4), (2, 5), (0, 8), (1, 1), (2, 2)]
    assert ahead.Hypothesis(1, 4).verdict([7, 9]) == (7, 4)
    assert ahead.Hypothesis(2, 5).verdict([7, 9]) == (7, 9, 5)


@pytest.mark.parametrize("spread", [False, True], ids=["fixed", "spread"])
def test_greedy_equals_target_only_with_hits(
    checkpoints: tuple[Path, Path], reference: ModelRunner, spread: bool
) -> None:
    target_dir, draft_dir = checkpoints
    params = [SamplingParams(temperature=0.0)] * 3
    draft = with_ahead(model_draft(draft_dir), 2, spread=spread)
    out, hits, misses = _run(target_dir, draft, params, 3, 20)
    for prompt, got in zip(_prompts(3), out, strict=True):
        assert got == greedy_reference(reference, prompt, len(got))
    assert hits > 0 and misses > 0, (hits, misses)


@pytest.mark.parametrize(
    ("q_form", "top_k", "top_p", "noise", "spread"),
    [
        ("sparse", 0, 1.0, 0.05, False),
        ("dense", 6, 0.9, 0.05, False),
        ("sparse", 0, 1.0, 0.35, False),
        ("sparse", 0, 1.0, 0.35, True),
    ],
    ids=["sparse", "dense-topk-topp", "poor-draft", "poor-draft-spread"],
)
def test_seeded_output_is_the_same_with_draft_ahead_on_and_off(
    tmp_path: Path, q_form: str, top_k: int, top_p: float, noise: float, spread: bool
) -> None:
    target_dir, draft_dir = build_checkpoints(tmp_path, noise=noise)
    params = [SamplingParams(0.3, top_k, top_p, seed=100 + i) for i in range(4)]
    draft = model_draft(draft_dir, q_form, support=8)
    off, _, _ = _run(target_dir, with_ahead(draft, 0), params, 3, 16)
    # a miss drafts now, whatever the backup setting: a backup (k = 0) step would draw other
    # tokens than a speculative one
    on, hits, misses = _run(target_dir, with_ahead(draft, 3, backup="always", spread=spread),
                            params, 3, 16)  # fmt: skip
    assert on == off
    assert hits > 0 and misses > 0, (hits, misses)


def test_branches_are_freed(checkpoints: tuple[Path, Path]) -> None:
    """Every hypothesis slot goes back: at release, and at each ask, hit or miss."""
    target_dir, draft_dir = checkpoints
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        runner = svc.draft_engine.runner
        assert runner is not None
        free = runner.free_slots
        pipe = svc.pipeline()
        pipe.admit("a", _prompts(1)[0], SamplingParams(temperature=0.0))
        pipe.generate({"a": 3}, 12)
        assert runner.free_slots < free - 1, "chains were drafted ahead"
        pipe.release(["a"])
        pipe.close()
        assert runner.free_slots == free


def test_an_ask_for_no_drafts_is_neither_a_hit_nor_a_miss(checkpoints: tuple[Path, Path]) -> None:
    """Dynamic speculation asks for k = 0 at times: the chains made ahead go unused, but
    nothing was missed (the hit rate counts asks that could have hit)."""
    target_dir, draft_dir = checkpoints
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        engine = svc.draft_engine
        assert engine.runner is not None
        pipe = svc.pipeline()
        pipe.admit("a", _prompts(1)[0], SamplingParams(temperature=0.0))
        free = engine.runner.free_slots  # the request's own slot taken, no chain yet
        pipe.generate({"a": 3}, 9)
        counts = (engine.ahead_hits, engine.ahead_misses)
        assert sum(counts) > 0, "asks found chains made ahead"
        # the service drafts ahead after each answer and reads the next ask only then, so
        # the k = 0 ask below finds the chains of the last pass
        pipe.step({"a": 0})
        assert (engine.ahead_hits, engine.ahead_misses) == counts
        assert engine.runner.free_slots == free, "its chains were dropped, none drafted anew"
        pipe.close()


def test_k_changing_every_step_drafts_ahead_without_a_failure_or_a_leaked_slot(
    checkpoints: tuple[Path, Path], reference: ModelRunner, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub changes k from step to step (dynamic speculation, a request's last tokens),
    k = 0 included: a pass ahead of a step whose k differs from the last one's, or of a k = 0
    step, used to fork past the request's KV or give two hypotheses one key (their slots
    leaked)."""
    target_dir, draft_dir = checkpoints
    prompts = _prompts(2)
    with services(target_dir, with_ahead(model_draft(draft_dir), 2), sampler_impl="torch") as svc:
        engine = svc.draft_engine
        assert engine.runner is not None
        free = engine.runner.free_slots
        pipe = svc.pipeline()
        for rid, prompt in zip("ab", prompts, strict=True):
            pipe.admit(rid, prompt, SamplingParams(temperature=0.0))
        for k in (4, 4, 2, 1, 4, 0, 4, 4, 3, 0, 0, 4, 4, 1, 4, 4, 2, 4):
            pipe.step({"a": k, "b": min(k, 3)})
            with engine._lock:  # the pass ahead may be running: between its steps, no check
                for rid in "ab":  # the KV holds what the engine thinks it does (a hit asked
                    # for fewer drafts than its chain holds keeps only those it sends)
                    assert engine.runner.cached_length(rid) == len(engine._requests[rid].kv)
        out = [pipe.requests[rid].generated for rid in "ab"]
        pipe.release(["a", "b"])
        pipe.close()
        assert engine.runner.free_slots == free, "every hypothesis's slot went back"
    failed = [r.getMessage() for r in caplog.records if "draft-ahead failed" in r.getMessage()]
    assert not failed
    assert engine.ahead_hits > 0
    for prompt, got in zip(prompts, out, strict=True):
        assert got == greedy_reference(reference, prompt, len(got))


def test_unlikely_accepted_counts_are_not_drafted() -> None:
    found = ahead.hypotheses([[7, 3, 8], [9, 4, 1], [5, 2, 6]], [7, 9], 2)
    counts = ahead.AcceptedCounts(min_seen=10)
    for _ in range(9):
        counts.add(1)
    assert counts.likely(found) == found, "too few verdicts seen to leave any count out"
    counts.add(1)
    got = [(h.accepted, h.token) for h in counts.likely(found)]
    assert got == [(1, 4), (1, 1)], "only j = 1 ever came true"
    counts.add(2)  # 1 of 11: kept, after the likelier count within each rank
    got = [(h.accepted, h.token) for h in counts.likely(found)]
    assert got == [(1, 4), (2, 5), (1, 1), (2, 2)]


def test_a_count_left_out_early_comes_back_once_seen() -> None:
    """The default leaves counts out after 16 verdicts, so that a synthetic L = 3 (only j = 2)
    stops the bonus forward within a short benchmark window; a count it left out comes back
    at its first sighting in the first 50 verdicts."""
    counts = ahead.AcceptedCounts()
    for _ in range(15):
        counts.add(2)
    assert counts.wants(4), "15 verdicts are too few to leave a count out"
    counts.add(2)
    assert not counts.wants(4) and counts.wants(2)
    for _ in range(33):
        counts.add(2)
    counts.add(4)  # 1 of 50: the share is 2%, which is kept
    assert counts.wants(4)


def test_guess_ranks_start_geometric_and_follow_the_verdicts() -> None:
    ranks = ahead.GuessRanks()
    prior = [ranks.probability(0, False, r) for r in range(4)]
    assert prior == [0.5, 0.25, 0.125, 0.0625], "nothing seen: SSD's geometric fan-out"
    for _ in range(12):
        ranks.add(0, False, 2)  # the recovered token at j = 0 was always the third guess
    ranks.add(0, False, None)  # and once no guess at all
    assert ranks.probability(0, False, 2) > ranks.probability(0, False, 0)
    assert ranks.probability(0, True, 0) == 0.5, "a bonus position has a table of its own"
    ranks.add(5, False, 1)  # past SPREAD_DEPTH: the table of j = SPREAD_DEPTH
    assert ranks.probability(ahead.SPREAD_DEPTH, False, 1) == ranks.probability(9, False, 1)
    assert ranks.probability(ahead.SPREAD_DEPTH, False, 1) > 0.25


def test_the_spread_ranks_hypotheses_by_their_chance() -> None:
    """With j = 2 the only count seen and its recovered token mostly the draft's third guess,
    the likeliest hypotheses are j = 2's guesses, its third first, then by rank; unseen counts are
    left out as the fixed fan-out leaves them."""
    top = [[7, 3, 8, 6, 0], [9, 4, 1, 0, 2], [5, 2, 6, 3, 1], [4, 8, 0, 2, 7]]
    counts, ranks = ahead.AcceptedCounts(min_seen=10), ahead.GuessRanks()
    for _ in range(20):
        counts.add(2)
        ranks.add(2, False, 2)
    found = ahead.spread(top, [7, 9, 4], counts, ranks)
    best = [(h.accepted, h.token) for _, h in sorted(found, key=lambda x: -x[0])]
    assert best == [(2, 6), (2, 5), (2, 2), (2, 3), (2, 1)]
    fixed = counts.likely(ahead.hypotheses(top, [7, 9, 4], 2))
    assert [(h.accepted, h.token) for h in fixed] == [(2, 5), (2, 2)], "F = 2 misses rank 2"


def test_the_spread_gives_every_request_a_chain_before_any_a_second() -> None:
    """Backups' guesses (their count certain: chance 0.5, 0.25, ...) outrank a drafting
    request's (P(j) x P(rank), here 0.15 at best); with a slot per request every request
    still gets its likeliest, so none is left to draft after its verdict."""
    counts, ranks = ahead.AcceptedCounts(min_seen=4), ahead.GuessRanks()
    for _ in range(10):
        counts.add(1)
        counts.add(2)
        counts.add(3)
    top = [[7, 3, 8, 6, 0], [9, 4, 1, 0, 2], [5, 2, 6, 3, 1], [4, 8, 0, 2, 7]]
    backups = [ahead.spread(top[:1], [], counts, ranks) for _ in range(4)]
    drafting = [ahead.spread(top, [7, 9, 5], counts, ranks) for _ in range(4)]
    assert max(p for p, _ in drafting[0]) < min(p for p, _ in backups[0][:2])
    order = ahead.spread_order(backups + drafting)
    assert sorted(i for i, _ in order[:8]) == list(range(8)), "one each first"
    assert [i for i, _ in order[8:12]] == [0, 1, 2, 3], "then the likeliest: backups' seconds"


def test_the_spread_drafts_as_many_hypotheses_as_the_fixed_fanout(
    checkpoints: tuple[Path, Path],
) -> None:
    """Per pass the spread drafts the fixed F's number of hypotheses (so it costs the same),
    and ranks each verdict's added token among its position's 2F guesses."""
    target_dir, draft_dir = checkpoints
    drafted = {}
    for spread in (False, True):
        with services(target_dir, with_ahead(model_draft(draft_dir), 2, spread=spread),
                      sampler_impl="torch") as svc:  # fmt: skip
            engine = svc.draft_engine
            pipe = svc.pipeline()
            pipe.admit("a", _prompts(1)[0], SamplingParams(temperature=0.0))
            counts = []
            for _ in range(8):
                pipe.step({"a": 3})
                req = engine._requests["a"]
                deadline = time.monotonic() + 10.0  # the pass runs after the answer
                while time.monotonic() < deadline:
                    with engine._lock:
                        if req.chains_step == req.next_step:
                            counts.append(len(req.chains))
                            break
                    time.sleep(0.005)
                else:
                    raise AssertionError("no pass ahead ran")
            ranks = engine._ahead._ranks
            pipe.close()
        drafted[spread] = counts
        if spread:
            assert all(len(g) == 5 for g in req.guesses), "2F + 1 guesses a position"
            assert sum(ranks.totals.values()) >= 6, "the verdicts' ranks were counted"
        else:
            assert all(len(g) == 3 for g in req.guesses), "F + 1 guesses a position"
            assert not ranks.totals, "only the spread counts ranks"
    assert drafted[True] == drafted[False], drafted


def test_the_spread_needs_draft_ahead(checkpoints: tuple[Path, Path]) -> None:
    _, draft_dir = checkpoints
    with pytest.raises(ValueError, match=r"draft_ahead_spread .* needs draft_ahead >= 1"):
        replace(with_ahead(model_draft(draft_dir), 0), draft_ahead_spread=True)


def test_synthetic_hit_rate_picks_a_chain_of_the_verdicts_accepted_count() -> None:
    chains = {(3,): None, (7, 4): None, (7, 1): None, (7, 9, 5): None}
    keys = [ahead.synthetic_hit(chains, (7, 8), 1.0, "r", s) for s in range(50)]  # type: ignore[arg-type]
    assert keys == [(7, 4)] * 50
    assert all(ahead.synthetic_hit(chains, (7, 8), 0.0, "r", s) == (7, 8) for s in range(50))  # type: ignore[arg-type]
    hits = sum(ahead.synthetic_hit(chains, (7, 8), 0.3, "r", s) != (7, 8) for s in range(2000))  # type: ignore[arg-type]
    assert 500 < hits < 700, hits


def test_synthetic_hit_rate_through_the_services(
    checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    """BENCHMARKING ONLY mode: every ask with chains hits at rate 1. The drafts then need not
    follow the committed tokens, but they are still verified: greedy output is unchanged."""
    target_dir, draft_dir = checkpoints
    draft = replace(with_ahead(model_draft(draft_dir), 1), synthetic_hit_rate=1.0)
    out, hits, misses = _run(target_dir, draft, [SamplingParams(temperature=0.0)] * 2, 3, 16)
    for prompt, got in zip(_prompts(2), out, strict=True):
        assert got == greedy_reference(reference, prompt, 16)
    assert hits > 0 and misses == 0, (hits, misses)


def test_a_failing_ahead_pass_changes_nothing(
    checkpoints: tuple[Path, Path], reference: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft-ahead only saves time: a pass that raises after taking its slots leaves the
    stream up, the output unchanged and every slot free again."""
    target_dir, draft_dir = checkpoints
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        engine, runner = svc.draft_engine, svc.draft_engine.runner
        assert runner is not None
        real = engine._ahead._draft_chains

        def broken(ready: list, added: list[str]) -> int:
            real(ready, added)
            raise RuntimeError("an ahead pass that fails")

        monkeypatch.setattr(engine._ahead, "_draft_chains", broken)
        free = runner.free_slots
        pipe = svc.pipeline()
        prompt = _prompts(1)[0]
        pipe.admit("a", prompt, SamplingParams(temperature=0.0))
        pipe.generate({"a": 3}, 12)
        got = pipe.requests["a"].generated[:12]
        assert got == greedy_reference(reference, prompt, 12)
        assert runner.free_slots == free - 1  # the request's own slot only
        assert engine.ahead_hits == 0
        pipe.release(["a"])
        pipe.close()
        assert runner.free_slots == free


def test_trace_shows_each_kind_of_device_work(
    checkpoints: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SPECDEC_GPU_TRACE set, the draft's steps, its passes ahead and the target's verify
    forwards and sampler are spans on one clock, in the run's own time."""
    monkeypatch.setenv(trace.ENV, str(tmp_path / "trace"))
    monkeypatch.setattr(trace.Trace, "_by_device", {})
    target_dir, draft_dir = checkpoints
    start = time.time()
    _run(target_dir, with_ahead(model_draft(draft_dir), 2), [SamplingParams(0.0)] * 2, 3, 12)
    end = time.time()
    spans = [s for p in e2e_timeline.read(tmp_path / "trace") for s in p["spans"]]
    assert {name for name, _, _ in spans} >= {"draft", "ahead", "verify", "sampler"}
    bad = [s for s in spans if not start <= s[1] <= s[2] <= end]
    assert not bad, (start, end, bad[:5])


def test_backups_keep_greedy_output_and_their_next_step_hits(
    checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    """Backup proposals ("always"): every miss (an ask whose chains hold none for its verdict)
    gets no drafts, so the step does not wait for a draft pass; the pass ahead catches its KV up
    and drafts chains for the token its verdict adds, which later asks hit. Greedy output stays
    target-only greedy, and every hypothesis slot goes back at release."""
    target_dir, draft_dir = checkpoints
    params = [SamplingParams(temperature=0.0)] * 3
    prompts = _prompts(3)
    draft = with_ahead(model_draft(draft_dir), 2, backup="always")
    with services(target_dir, draft, sampler_impl="torch") as svc:
        engine = svc.draft_engine
        assert engine.runner is not None
        free = engine.runner.free_slots
        pipe = svc.pipeline()
        ids = [f"r{i}" for i in range(3)]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            pipe.admit(rid, prompt, p)
        pipe.generate(dict.fromkeys(ids, 3), 20)
        out = [pipe.requests[r].generated[:20] for r in ids]
        pipe.release(ids)
        pipe.close()
        assert engine.runner.free_slots == free, "every slot went back"
    for prompt, got in zip(prompts, out, strict=True):
        assert got == greedy_reference(reference, prompt, len(got))
    assert engine.ahead_backups > 0 and engine.ahead_hits > 0
    assert engine.ahead_backups <= engine.ahead_misses, "only misses are backed up"


def test_a_k0_ask_leaves_the_kv_caught_up_after_the_pass(
    checkpoints: tuple[Path, Path],
) -> None:
    """With draft-ahead off too: steps at k = 0 (dynamic speculation) keep the draft's KV
    holding every committed token, so the next step at k > 0 catches up one token (a graph),
    not everything since (an eager prefill that outlasted the hub's deadline)."""
    target_dir, draft_dir = checkpoints
    with services(target_dir, with_ahead(model_draft(draft_dir), 0), sampler_impl="torch") as svc:
        engine = svc.draft_engine
        assert engine.runner is not None
        pipe = svc.pipeline()
        pipe.admit("a", _prompts(1)[0], SamplingParams(temperature=0.0))
        for _ in range(6):
            pipe.step({"a": 0})
            req = engine._requests["a"]
            deadline = time.monotonic() + 10.0  # the pass runs after the answer, on its own
            while time.monotonic() < deadline:
                with engine._lock:
                    if req.kv == req.tokens:
                        break
                time.sleep(0.005)
            with engine._lock:
                assert req.kv == req.tokens, "the KV holds every committed token"
                assert engine.runner.cached_length("a") == len(req.tokens)
        pipe.close()


def test_backup_choice_weighs_tokens_per_second() -> None:
    choice = ahead.BackupChoice()
    assert not choice.pays(8, 2, 0.007), "nothing measured yet: misses are drafted now"
    choice.committed(3)
    choice.drafted(0.005)
    assert choice.pays(8, 2, 0.007)  # (6 x 3 + 2) / 7 > 8 x 3 / 12 tokens per ms
    assert not choice.pays(1, 1, 0.007)  # 1 / 7 < 3 / 12
    assert not choice.pays(8, 2, 0.0), "the hub's step time unknown"
    assert ahead.BackupChoice(1.5, 0.005).pays(1, 1, 0.007)  # 1 / 7 > 1.5 / 12
    for _ in range(200):
        choice.committed(1)  # L falls towards 1: a lone miss backs up too
    assert choice.mean_committed is not None and choice.mean_committed < 1.01
    assert choice.pays(1, 1, 0.007)
    # after REMEASURE_EVERY backups in a row one miss is drafted now, to time a draft pass
    runs = [choice.pays(8, 2, 0.007) for _ in range(2 * ahead.REMEASURE_EVERY)]
    assert runs.index(False) == ahead.REMEASURE_EVERY - 2  # two backed up above
    choice.drafted(0.005)
    assert choice.pays(8, 2, 0.007)


def test_the_miss_share_is_where_backups_pay() -> None:
    """misses < miss_share x asks exactly where a backup commits more tokens per second,
    ((B - m) L + m) / T_step > B L / (T_step + T_draft): the hub decides by the share for
    pushed chains what the draft decides (`pays`) for asked ones."""
    import math
    import random

    gen = random.Random(3)
    for _ in range(500):
        length, draft_s = gen.uniform(0.5, 5.0), gen.uniform(1e-4, 0.02)
        choice = ahead.BackupChoice(length, draft_s)
        step_s, asks = gen.uniform(1e-3, 0.03), gen.randint(1, 64)
        missed = gen.randint(1, asks)
        faster = ((asks - missed) * length + missed) / step_s > asks * length / (step_s + draft_s)
        assert (missed < choice.miss_share(step_s) * asks) == faster, (choice, step_s)
        assert choice.pays(asks, missed, step_s) == faster, (choice, step_s)
    assert ahead.BackupChoice().miss_share(0.007) == 0.0, "nothing measured: never"
    assert ahead.BackupChoice(3.0, 0.005).miss_share(0.0) == 0.0, "step time unknown: never"
    assert ahead.BackupChoice(1.0, 0.005).miss_share(0.007) == math.inf, "L = 1: always"
    due = ahead.BackupChoice(3.0, 0.005)
    for _ in range(ahead.REMEASURE_EVERY):
        assert due.miss_share(0.007) > 0
        due.backed_up()
    assert due.miss_share(0.007) == 0.0, "a remeasure is due: the next miss is asked for"
    due.drafted(0.005)
    assert due.miss_share(0.007) == pytest.approx(3 * 0.005 / (0.012 * 2))


def test_a_backup_ask_gets_no_drafts_and_its_next_step_is_drafted_ahead(
    checkpoints: tuple[Path, Path],
) -> None:
    """An ask flagged backup (the hub found no pushed chain for its verdict) is answered with
    no drafts even where a chain for its verdict exists, counted as a miss and a backup; the
    pass ahead then drafts chains for the token its verdict adds, as after any backup. An
    ask flagged so with k = 0 or a fixed k is refused as malformed."""
    from specdec.serving.messages import AdmitRequest, ProposeEntry

    target_dir, draft_dir = checkpoints
    prompt = _prompts(1)[0]
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        engine = svc.draft_engine
        engine.admit(AdmitRequest("a", tuple(prompt), SamplingParams(temperature=0.0)))
        _, errors = engine.propose([ProposeEntry("a", 0, (), len(prompt), 3)])
        assert not errors and engine.draft_ahead(["a"]) > 0
        push = engine.pushed(["a"])
        assert push is not None
        key = push.keys[0]  # a verdict the draft guessed: a hit, were it not flagged
        ask = ProposeEntry("a", 1, key, len(prompt) + len(key), 3, backup=True)
        misses, backups = engine.ahead_misses, engine.ahead_backups
        answer, errors = engine.propose([ask])
        assert not errors and answer.num_draft_tokens == [0]
        assert (engine.ahead_misses, engine.ahead_backups) == (misses + 1, backups + 1)
        assert engine.draft_ahead(["a"]) > 0, "chains for the backup's verdict"
        nxt = engine.pushed(["a"])
        assert nxt is not None and all(len(k) == 1 for k in nxt.keys), nxt.keys
        engine.release(["a"])
    with pytest.raises(ValueError, match="backup needs num_draft_tokens > 0"):
        ProposeEntry("a", 1, (3,), 9, 0, backup=True)
    with pytest.raises(ValueError, match="no fixed_num_draft_tokens"):
        ProposeEntry("a", 1, (3,), 9, 2, fixed_num_draft_tokens=True, backup=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pushed_chains_are_the_answers_their_verdicts_get(
    checkpoints: tuple[Path, Path], temperature: float
) -> None:
    """`DraftEngine.pushed` sends, before the next ask, every chain of the pass ahead with the
    verdict it assumed: an ask carrying that verdict is answered with exactly that entry's
    drafts and q (or its first k, asked for fewer), whichever of the chains it is."""
    from specdec.serving.blocks import SparseQ
    from specdec.serving.messages import AdmitRequest, ProposeEntry

    target_dir, draft_dir = checkpoints
    sampling = SamplingParams(temperature=temperature, **({"seed": 5} if temperature else {}))
    prompt = _prompts(1)[0]
    checked = 0
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        engine = svc.draft_engine
        for pick in range(6):
            rid = f"r{pick}"
            engine.admit(AdmitRequest(rid, tuple(prompt), sampling))
            _, errors = engine.propose([ProposeEntry(rid, 0, (), len(prompt), 3)])
            assert not errors
            assert engine.draft_ahead([rid]) > 0
            push = engine.pushed([rid])
            assert push is not None and len(push.keys) == len(push.block) > 1
            assert set(push.block.request_ids) == {rid} and set(push.block.steps) == {1}
            i = pick % len(push.keys)  # a verdict the draft guessed
            key, k = push.keys[i], 3 - pick % 2  # k = 2: asked for fewer than drafted
            assert push.block.committed_lengths[i] == len(prompt) + len(key)
            ask = ProposeEntry(rid, 1, key, len(prompt) + len(key), k)
            hits = engine.ahead_hits
            answer, errors = engine.propose([ask])
            assert not errors and engine.ahead_hits == hits + 1
            assert answer.tokens(0) == push.block.tokens(i)[:k]
            assert answer.q_forms == [push.block.q_forms[i]]
            form = push.block.q_forms[i]
            want, got = push.block.q_rows(form, [i]), answer.q_rows(form, [0])
            if want is None:
                assert temperature == 0.0 and got is None
            else:
                assert got is not None and type(got) is type(want)
                torch.testing.assert_close(got.probs, want.probs[:k], rtol=0, atol=0)
                if isinstance(want, SparseQ):  # the support's ids too, in the same order
                    assert isinstance(got, SparseQ)
                    assert torch.equal(got.token_ids, want.token_ids[:k])
            engine.release([rid])
            checked += 1
    assert checked == 6


def test_push_marks_the_chains_a_synthetic_hit_serves_for_any_verdict() -> None:
    """BENCHMARKING ONLY: with a synthetic hit rate, the chain `synthetic_hit` would serve to
    every verdict of its length is the first of that length, on the steps whose hash says so."""
    chains = {(3,): None, (7, 4): None, (7, 1): None, (7, 9, 5): None}
    assert ahead.synthetic_any_keys(chains, "r", 1, 1.0) == {(3,), (7, 4), (7, 9, 5)}  # type: ignore[arg-type]
    assert ahead.synthetic_any_keys(chains, "r", 1, 0.0) == set()  # type: ignore[arg-type]
    for s in range(100):
        marked = ahead.synthetic_any_keys(chains, "r", s, 0.5)  # type: ignore[arg-type]
        served = ahead.synthetic_hit(chains, (7, 8), 0.5, "r", s)  # type: ignore[arg-type]
        assert (served in marked) == (served != (7, 8))


@pytest.mark.parametrize("fanout", [0, 2])
def test_only_a_draft_that_drafts_ahead_gets_a_push_stream(
    checkpoints: tuple[Path, Path], fanout: int
) -> None:
    """The draft's ModelInfo says whether it drafts ahead, and the hub's link takes pushes only
    from one that does (a lock-step draft would push nothing; a push stream would only add a
    thread's hop to each answer); asked not to, it never does."""
    from dataclasses import replace as copy

    from draft_service.server import start
    from specdec.serving.server import ServerConfig
    from target_service.draft_link import DraftLink

    _, draft_dir = checkpoints
    config = with_ahead(model_draft(draft_dir), fanout)
    server, engine = start(copy(config, server=ServerConfig(host="127.0.0.1", port=0)))
    try:
        assert engine.info.drafts_ahead is (fanout > 0)
        for wanted in (True, False):
            link = DraftLink(f"127.0.0.1:{server.port}", 1 << 24, 10.0, push=wanted)
            try:
                assert link.info.drafts_ahead is (fanout > 0)
                assert link.push is (wanted and fanout > 0)
            finally:
                link.close()
    finally:
        server.stop(0)


def test_each_request_has_its_own_synthetic_hit_rate(checkpoints: tuple[Path, Path]) -> None:
    """Mixed traffic (BENCHMARKING ONLY): with a spread, each request's hit rate is uniform in
    [h - spread, h + spread] by a hash of its id, the same at every call; the mean stays h."""
    plain = with_ahead(model_draft(checkpoints[1]), 2)
    assert plain.hit_rate_for("a") is None
    config = replace(plain, synthetic_hit_rate=0.7, synthetic_hit_rate_spread=0.25)
    rates = [config.hit_rate_for(f"req-{i}") for i in range(4000)]
    assert all(r is not None and 0.45 <= r <= 0.95 for r in rates)
    assert sum(r for r in rates if r is not None) / len(rates) == pytest.approx(0.7, abs=0.01)
    assert config.hit_rate_for("req-3") == rates[3]
    assert replace(config, synthetic_hit_rate_spread=0.0).hit_rate_for("req-3") == 0.7


@pytest.mark.parametrize(
    ("rate", "spread", "message"),
    [(0.8, 0.3, "inside \\[0, 1\\]"), (None, 0.1, "needs a synthetic_hit_rate"),
     (0.5, -0.1, "must be >= 0")],
)  # fmt: skip
def test_a_hit_rate_spread_that_leaves_0_1_is_refused(
    rate: float | None, spread: float, message: str
) -> None:
    from specdec.limits import check_draft_ahead

    with pytest.raises(ValueError, match=message):
        check_draft_ahead(2, 1.0, rate, spread)
    check_draft_ahead(2, 1.0, 0.5, 0.5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_backup_spawns_its_chains_in_the_pass_of_its_catch_up(
    checkpoints: tuple[Path, Path], temperature: float
) -> None:
    """After a backup (no drafts, so the KV lacks the verdict's tokens), the pass ahead
    catches the request up and drafts its chains in one pass of the drafter (no second pass
    and host sync): each chain, for a guess g of the token the next verdict adds, holds k - 1
    drafts: the tokens that a request [*committed, g] drafting k - 1 gets (the same seeded
    draws), and its q to float32 rounding. An ask of that verdict takes it, answered with
    those k - 1 drafts."""
    from specdec.serving.messages import AdmitRequest, ProposeEntry

    target_dir, draft_dir = checkpoints
    sampling = SamplingParams(temperature=temperature, **({"seed": 7} if temperature else {}))
    prompt = _prompts(1)[0]
    k = 3
    with services(target_dir, with_ahead(model_draft(draft_dir), 2)) as svc:
        engine = svc.draft_engine
        engine.admit(AdmitRequest("a", tuple(prompt), sampling))
        _, errors = engine.propose([ProposeEntry("a", 0, (), len(prompt), k)])
        assert not errors and engine.draft_ahead(["a"]) > 0
        push = engine.pushed(["a"])
        assert push is not None
        key = push.keys[0]
        committed = [*prompt, *key]
        answer, errors = engine.propose([ProposeEntry("a", 1, key, len(committed), k, backup=True)])
        assert not errors and answer.num_draft_tokens == [0]
        calls = []
        drafts = engine._drafter.drafts
        engine._drafter.drafts = lambda *a, **kw: calls.append(a) or drafts(*a, **kw)  # type: ignore[method-assign]
        assert engine.draft_ahead(["a"]) == 2  # F = 2 spawned chains
        engine._drafter.drafts = drafts  # type: ignore[method-assign]
        assert len(calls) == 1, "the catch-up and the chains in one pass"
        spawned = engine.pushed(["a"])
        assert spawned is not None and all(len(v) == 1 for v in spawned.keys)
        assert spawned.block.num_draft_tokens == [k - 1] * 2
        for i, (g,) in enumerate(spawned.keys):  # what [*committed, g] drafting k - 1 gets
            rid = f"ref{i}"
            engine.admit(AdmitRequest(rid, (*committed, g), sampling))
            ref, errors = engine.propose([ProposeEntry(rid, 0, (), len(committed) + 1, k - 1)])
            assert not errors and ref.tokens(0) == spawned.block.tokens(i)
            if temperature:
                form = spawned.block.q_forms[i]
                want = ref.q_rows(ref.q_forms[0], [0])
                got = spawned.block.q_rows(form, [i])
                # another order of the same float32 sums (a prefill against a KV catch-up)
                torch.testing.assert_close(got.probs, want.probs, rtol=0, atol=1e-5)  # type: ignore[union-attr]
                assert torch.equal(got.token_ids, want.token_ids)  # type: ignore[union-attr]
            engine.release([rid])
        g = spawned.keys[1][0]
        hits = engine.ahead_hits
        ask = ProposeEntry("a", 2, (g,), len(committed) + 1, k)
        answer, errors = engine.propose([ask])
        assert not errors and engine.ahead_hits == hits + 1
        assert answer.num_draft_tokens == [k - 1] and answer.tokens(0) == spawned.block.tokens(1)
        engine.release(["a"])
