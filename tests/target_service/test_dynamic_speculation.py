"""Dynamic speculation (target_service.speculation): the k that maximises committed tokens per
second from the measured acceptance and step times, 0 where speculation does not pay, with
probes that find out when it pays again; through the hub, greedy output still equals
target-only and a seeded sampled request keeps its k and its tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.local import LocalPair
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock
from specdec.serving.messages import AdmitRequest
from target_service.speculation import MIN_DRAFTS, MIN_TIMES, KChooser
from target_service.synthetic import SyntheticAcceptance
from tests.draft_service.models import TOKENIZER_VOCAB, greedy_reference
from tests.target_service.hub_helpers import Driver, hub_services


def _steps(
    chooser: KChooser, n: int, rate: float, base: float, per_token: float, plain: float, b: int = 1
) -> list[int]:
    """n steps of a batch of b at the chooser's own choices, each request accepting the
    expected share of drafts; the chosen k of each step."""
    chosen = []
    for _ in range(n):
        k = chooser.choose(b, 4)
        chosen.append(k)
        accepted = round(sum(rate**j for j in range(1, k + 1)))  # E[accepted] at this k
        step_s = base + k * per_token if k else plain
        chooser.observe(b, [k] * b, [accepted] * b, step_s, k * per_token)
    return chosen


def test_a_step_without_drafts_is_timed_before_it_is_compared() -> None:
    """With speculation measured and no step at k = 0 yet, the next step runs at 0: guessing
    its time from a speculative step's would keep k = 1 running where 0 is faster."""
    chooser = KChooser(max_k=4)
    for _ in range(30):
        chooser.observe(1, [4], [0], 0.012, 0.004)  # a_1 = 0: every draft rejected
    assert chooser.choose(1, 4) == 0
    chooser.observe(1, [0], [0], 0.006, 0.0)
    assert chooser.choose(1, 4) == 0, "1 token per 6 ms beats 1 per 9 ms at k = 1"


def test_noise_never_makes_drafts_that_are_never_accepted_look_free() -> None:
    """Acceptance 0: every k commits one token a step, as k = 0 does, at more cost. A noisy
    measurement whose speculative base (step less drafts) comes out below the plain step
    (on a loaded CPU: 5 ms against 6 ms) must still leave k = 0 the choice."""
    chooser = KChooser(max_k=4)
    for _ in range(30):
        chooser.observe(1, [4], [0], 0.0054, 0.0004)  # base 5 ms, 0.1 ms a draft
    chooser.observe(1, [0], [0], 0.006, 0.0)
    assert [chooser.choose(1, 4) for _ in range(8)] == [0] * 8


def test_a_request_that_keeps_its_k_sets_the_least_k_of_the_step() -> None:
    """With a seeded sampled request at k = 3 in the batch, every step drafts 3 anyway: the
    others get the best k of [3, 4], never 0 (which would save nothing), and no k = 0 step
    is needed to decide it."""
    chooser = KChooser(max_k=4)
    for _ in range(30):
        chooser.observe(2, [4, 4], [0, 4], 0.014, 0.004)  # a_1 = 0.5, then all accepted
    assert chooser.choose(2, 4, fixed=3) == 4
    chooser.drafted, chooser.accepted = [100.0] * 4, [100.0, 100.0, 100.0, 0.0]
    assert chooser.choose(2, 4, fixed=3) == 3, "a 4th token is never accepted"
    assert chooser.choose(2, 2, fixed=3) == 2, "the others' own k still bounds theirs"


def test_speculates_at_full_k_until_it_has_measured() -> None:
    chooser = KChooser(max_k=8)
    assert chooser.choose(1, 4) == 4 and chooser.acceptance() is None
    chooser.observe(1, [4], [4], 0.012, 0.004)
    assert chooser.choose(1, 4) == 4, f"fewer than {MIN_DRAFTS} drafts seen"


def test_expected_tokens_from_acceptance_per_position() -> None:
    chooser = KChooser(max_k=4)
    for _ in range(40):  # half the first drafts accepted, then every one after an accept
        chooser.observe(2, [4, 4], [0, 4], 0.01, 0.004)
    rates = chooser.acceptance()
    assert rates is not None
    assert rates == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert chooser.expected_tokens(0) == 1.0
    assert chooser.expected_tokens(3) == pytest.approx(1 + 0.5 * 3)


def test_the_best_k_by_tokens_per_second() -> None:
    # a = 0.5 per position, a step 10 ms + 1 ms per drafted token, 8 ms without drafts:
    # E(k)/T(k) = 1/8, 1.5/11, 1.75/12, 1.875/13, 1.9375/14 per ms: k = 2 is best
    chooser = KChooser(max_k=4)
    for _ in range(30):
        chooser.observe(1, [4], [0], 0.014, 0.004)
        chooser.observe(1, [0], [0], 0.008, 0.0)
    chooser.drafted = [100.0, 50.0, 25.0, 12.5]  # half accepted at each position
    chooser.accepted = [50.0, 25.0, 12.5, 6.25]
    assert chooser.choose(1, 4) == 2
    assert chooser.choose(1, 1) == 1, "a request's own k is the upper bound"


def test_turns_off_where_it_does_not_pay_and_probes_less_and_less() -> None:
    """Each probe that leaves the choice at 0 doubles the wait for the next, up to the cap:
    where speculation does not pay, probes cost less and less."""
    chooser = KChooser(max_k=4, probe_every=8, probe_every_max=32)
    chosen = _steps(chooser, 160, rate=0.0, base=0.012, per_token=0.001, plain=0.008)
    off = chosen.index(0)
    assert chosen[:off] == [4] * off and off <= 20, chosen
    tail = chosen[off:]  # MIN_TIMES steps at 0 time a step without drafts, then the probes
    assert tail[:MIN_TIMES] == [0] * MIN_TIMES
    at = [i for i, k in enumerate(tail) if k]
    probes = [i - (MIN_TIMES - 1) for i in at]  # counted from the last of those
    assert probes[:5] == [8, 8 + 16, 8 + 16 + 32, 8 + 16 + 32 + 32, 8 + 16 + 32 * 3], chosen
    assert {tail[i] for i in at} == {4}, "a probe drafts the request's whole k"
    with pytest.raises(ValueError, match="probe_every must be in"):
        KChooser(max_k=4, probe_every=64, probe_every_max=32)


def _batch8(chooser: KChooser, k: int, plain_s: float = 0.0054) -> None:
    """One step at batch 8 as an 8B / 1B pair on H200s runs it at L = 1.5 (the synthetic
    rates 0.5, 0, 0, 0): 8 ms plus 1.26 ms per drafted token, `plain_s` without drafts."""
    accepted = [j % 2 if k else 0 for j in range(8)]  # half of the first drafts accepted
    step_s = 0.008 + 0.00126 * k if k else plain_s
    chooser.observe(8, [k] * 8, accepted, step_s, 0.00126 * k)


def test_one_slow_step_without_drafts_does_not_keep_speculation_on() -> None:
    """The first step at k = 0 of a batch can be far slower than the rest (the draft busy with
    the new requests' prefills): one such time must not make k = 1 look better for good. At
    5.4 ms a step without drafts commits 1 / 5.4 tokens per ms, k = 1 at most 1.5 / 9.26."""
    chooser = KChooser(max_k=4)
    first = True
    for _ in range(300):
        k = chooser.choose(8, 4)
        _batch8(chooser, k, 0.015 if k == 0 and first else 0.0054)
        first = first and k != 0
    assert [chooser.choose(8, 4) for _ in range(8)] == [0] * 8


def test_probes_time_a_step_without_drafts_again_while_speculating() -> None:
    """Steps without drafts that were all slow (a busy draft) make k = 1 the choice; once they
    are fast again, the probes at k = 0 (which alternate with those at K) time them again and
    the choice goes back to 0."""
    chooser = KChooser(max_k=4, probe_every=4, probe_every_max=16)
    chosen = []
    for step in range(400):
        k = chooser.choose(8, 4)
        chosen.append(k)
        _batch8(chooser, k, 0.015 if step < 40 else 0.0054)
    settled = chosen[6:60]  # after the first timings: k = 1, probes up and down among them
    assert settled.count(1) >= 48 and 0 in settled and 4 in settled, settled
    assert chosen[-40:].count(0) >= 36, chosen[-40:]


def test_a_new_choice_brings_probes_back_to_their_first_interval() -> None:
    """After probes have backed off at k = 0, acceptance that makes k = 2 the best restarts
    them at `probe_every`: the positions past 2 are measured as often as at first."""
    chooser = KChooser(max_k=4, probe_every=4, probe_every_max=64)
    _steps(chooser, 120, rate=0.0, base=0.012, per_token=0.001, plain=0.008)
    assert chooser._interval == 64  # backed off
    # acceptance returns, half at each position: k = 2 is best (see the test below)
    for _ in range(30):
        chooser.observe(1, [4], [0], 0.014, 0.004)
    chooser.drafted = [100.0, 50.0, 25.0, 12.5]
    chooser.accepted = [50.0, 25.0, 12.5, 6.25]
    chooser.observe(1, [0], [0], 0.008, 0.0)
    chosen = [chooser.choose(1, 4) for _ in range(13)]
    assert [i for i, k in enumerate(chosen) if k != 2] == [3, 3 + 8], chosen  # 4th, then 8 on


def test_turns_back_on_when_acceptance_returns() -> None:
    chooser = KChooser(max_k=4, probe_every=4)
    assert _steps(chooser, 40, 0.0, 0.012, 0.001, 0.008)[-4:].count(0) >= 3
    chosen = _steps(chooser, 120, 1.0, 0.012, 0.001, 0.008)
    assert chosen[-10:] == [4] * 10, chosen


def test_large_batches_measure_their_own_step_times() -> None:
    """The same acceptance pays at batch 1 and not at batch 32, where verify costs more."""
    chooser = KChooser(max_k=4)
    for _ in range(30):
        chooser.observe(1, [4], [0], 0.014, 0.004)  # base 10 ms, 1 ms per drafted token
        chooser.observe(1, [0], [0], 0.008, 0.0)
        chooser.observe(32, [4] * 32, [0] * 32, 0.038, 0.008)  # base 30 ms, 2 ms per token
        chooser.observe(32, [0] * 32, [0] * 32, 0.008, 0.0)
    chooser.drafted = [100.0, 50.0, 25.0, 12.5]  # half accepted at each position
    chooser.accepted = [50.0, 25.0, 12.5, 6.25]
    assert chooser.choose(1, 4) == 2
    assert chooser.choose(32, 4) == 0  # at most 1.94 tokens per 38 ms against 1 per 8 ms
    with pytest.raises(ValueError, match="max_k must be >= 1"):
        KChooser(max_k=0)


def _prompt(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, TOKENIZER_VOCAB, (5 + seed % 3,), generator=gen).tolist()


@pytest.fixture(scope="module")
def dynamic(checkpoints: tuple[Path, Path]) -> Iterator[LocalPair]:
    with hub_services(*checkpoints, dynamic_speculation=True) as s:
        yield s


def test_greedy_equals_target_only_and_a_seeded_request_keeps_its_k(
    dynamic: LocalPair, checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    seeded = SamplingParams(0.8, seed=5)
    driver = Driver(dynamic.target_address, max_new_tokens=24)
    for i in range(3):
        driver.admit(f"greedy{i}", _prompt(i), "draft", 4)
    driver.admit("seeded", _prompt(9), "draft", 3, sampling=seeded, fixed_k=True)
    driver.run()
    driver.client.close()
    for i in range(3):
        rec = driver.records[f"greedy{i}"]
        assert rec.generated == greedy_reference(reference, rec.prompt, len(rec.generated))
    steps = [e.num_draft_tokens for e in driver.records["seeded"].events][1:]
    assert steps == [3] * len(steps) and steps
    with hub_services(*checkpoints) as fixed:  # dynamic speculation off
        plain = Driver(fixed.target_address, max_new_tokens=24)
        plain.admit("seeded", _prompt(9), "draft", 3, sampling=seeded, fixed_k=True)
        plain.run()
        plain.client.close()
    assert driver.records["seeded"].generated == plain.records["seeded"].generated


def test_the_hub_stops_drafting_what_is_never_accepted(checkpoints: tuple[Path, Path]) -> None:
    """BENCHMARKING ONLY synthetic acceptance of 0: after its first measurements the hub runs
    k = 0, with a probe at the request's k PROBE_EVERY steps later (then less often)."""
    never = SyntheticAcceptance(num_draft_tokens=4, mean_acceptance_length=1.0)
    with hub_services(*checkpoints, dynamic_speculation=True, synthetic=never) as svc:
        driver = Driver(svc.target_address, max_new_tokens=90)
        driver.admit("a", _prompt(1), "draft", 4)
        driver.run(timeout_s=120)
        driver.client.close()
    ks = [e.num_draft_tokens for e in driver.records["a"].events][1:]
    assert all(e.num_accepted == 0 for e in driver.records["a"].events)
    assert ks[:16] == [4] * 16, "k = 4 until MIN_DRAFTS first drafts are seen"
    tail = ks[20:]
    assert tail.count(0) >= len(tail) - 3 and 4 in tail, ks


class WarmUpEngine:
    """What `warm_up` calls of a TargetEngine: the blocks it verifies, the requests it holds."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.blocks: list[DraftBlock] = []

    def admit(self, adm: AdmitRequest) -> None:
        self.held.add(adm.request_id)

    def verify(self, block: DraftBlock) -> None:
        self.blocks.append(block)

    def release(self, ids: list[str]) -> None:
        self.held -= set(ids)


def test_the_target_warms_up_every_k_it_may_run() -> None:
    """Under dynamic speculation any k up to the limit can come: each is verified once before
    serving, so no request pays a compile (the sampler's kernels are compiled per k)."""
    from target_service.server import warm_up

    engine = WarmUpEngine()
    warm_up(engine, range(1, 5))  # type: ignore[arg-type]
    # per k a block of k alone, then one mixing k with k = 0 (the sampler's gather); last a
    # lone request without drafts (a backup at batch 1: a one-token graph of its own)
    verified = [b.num_draft_tokens for b in engine.blocks]
    assert verified == [[1], [1, 0], [2], [2, 0], [3], [3, 0], [4], [4, 0], [0]]
    assert not engine.held


def test_on_a_gpu_the_target_also_warms_up_each_q_form() -> None:
    """With the vocabulary size (a GPU's warm-up), each k is verified with no q, a sparse q and
    a dense q over the vocabulary: each q form is a sampler variant of its own."""
    from target_service.server import warm_up

    engine = WarmUpEngine()
    warm_up(engine, range(1, 3), vocab_size=50)  # type: ignore[arg-type]
    verified = [
        (b.num_draft_tokens, b.q_forms, None if b.dense is None else b.dense.probs.shape[1])
        for b in engine.blocks
    ]
    none, sparse, dense = 0, 2, 1  # specdec.v1.QForm
    assert verified == [
        ([1], [none], None), ([1, 0], [none, none], None), ([1], [sparse], None),
        ([1], [dense], 50), ([2], [none], None), ([2, 0], [none, none], None),
        ([2], [sparse], None), ([2], [dense], 50), ([0], [none], None),
    ]  # fmt: skip
    assert not engine.held
