"""SPECDEC_DRAFT_CHAIN_STEPS: a block's last draft steps as one chain (`ModelRunner.chain_step`,
one CUDA graph on a GPU). Where a chain may take over (`_Rows.chain_from`), and that the draft
engine answers every ask and drafts every chain ahead exactly as without it: lock-step asks of
mixed k, greedy and seeded sampled, draft-ahead's hypotheses and the chains a backup spawns in
its catch-up's pass (which start a step later). On the CPU a chain is its steps in turn, so
this checks which rows, tokens and positions the drafter hands it; the graph is checked
against the steps in `tests/specdec/test_runner_chain_gpu.py`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.drafting import CHAIN_ENV, Spawn, _Rows, chain_steps
from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock
from specdec.serving.messages import AdmitRequest, ProposeEntry
from tests.draft_service.models import build_checkpoints, model_draft


@pytest.mark.parametrize(
    "ks, spawns, end, want",
    [
        ([4, 4], [], 4, 1),  # the same rows from step 1: steps 1 .. 3 in one chain
        ([4, 2], [], 4, 2),  # request 1 ends after step 1: row 0 alone from step 2
        ([4, 1, 4], [Spawn(1, ("x", "y"), 3)], 4, 1),  # branches from step 1, the row ends
        ([4, 1, 4], [Spawn(1, ("x",), 2)], 4, 3),  # the branch ends after step 2
        ([2, 2], [], 2, 1),  # one step after the first: nothing to chain (the caller's test)
    ],
)
def test_a_chain_starts_where_the_rows_stop_changing(
    ks: list[int], spawns: list[Spawn], end: int, want: int
) -> None:
    rows = _Rows.of([f"r{i}" for i in range(len(ks))], ks, spawns)
    assert max(rows.end) == end
    assert rows.chain_from(end) == want
    assert all(rows.at(j) == rows.at(want) for j in range(want, end))


@pytest.mark.parametrize("value", ["1", "16", "-2", "two"])
def test_a_bad_chain_length_is_refused_with_a_sentence(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CHAIN_ENV, value)
    with pytest.raises(ValueError, match=CHAIN_ENV):
        chain_steps()


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[1]


def _engine(draft_dir: Path, q_form: str) -> DraftEngine:
    base = model_draft(draft_dir, q_form)
    assert base.runner is not None
    config = replace(base, runner=replace(base.runner, max_slots=64), draft_ahead=2,
                     draft_ahead_slots=48)  # fmt: skip
    assert isinstance(config, DraftConfig) and config.runner is not None
    runner = ModelRunner.load(config.runner)
    return DraftEngine(config, runner, model_info(config, runner))


def _same(got: DraftBlock, want: DraftBlock) -> None:
    assert got.request_ids == want.request_ids
    assert got.draft_token_ids == want.draft_token_ids
    assert got.num_draft_tokens == want.num_draft_tokens
    assert got.q_forms == want.q_forms
    for a, b in ((got.dense, want.dense), (got.sparse, want.sparse)):
        assert (a is None) == (b is None)
        if a is not None and b is not None:  # the same ops on the CPU: the same bits
            assert torch.equal(a.probs, b.probs)
            assert torch.equal(getattr(a, "token_ids", a.probs), getattr(b, "token_ids", b.probs))


@pytest.mark.parametrize(
    "q_form, greedy", [("sparse", False), ("dense", False), ("sparse", True)],
    ids=["sparse", "dense", "greedy"],
)  # fmt: skip
def test_every_answer_and_chain_is_the_same_with_chains_on(
    draft_dir: Path, q_form: str, greedy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """greedy: every request greedy, so the blocks take the argmax heads; else seeded sampled
    requests beside a greedy one, the full heads."""
    monkeypatch.delenv(CHAIN_ENV, raising=False)
    plain = _engine(draft_dir, q_form)
    monkeypatch.setenv(CHAIN_ENV, "3")
    chained = _engine(draft_dir, q_form)
    assert chained._drafter.chain_max == 3 and plain._drafter.chain_max == 0
    runner = chained.runner
    assert runner is not None
    calls: list[int] = []
    spawned: list[bool] = []  # whether a chain drafted for chains a backup spawned
    chain_step = runner.chain_step

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(a[4])
        spawned.append(any(rid.startswith("g") and rid != "g" and "next:" in rid for rid in a[0]))
        return chain_step(*a, **kw)

    runner.chain_step = counted  # type: ignore[method-assign]
    samplings = {"g": SamplingParams(0.0), "s": SamplingParams(0.8, seed=7),
                 "t": SamplingParams(1.0, top_k=20, seed=3)}  # fmt: skip
    if greedy:
        samplings = dict.fromkeys(samplings, SamplingParams(0.0))
    tokens = {rid: list(range(3 + i, 12 + i)) for i, rid in enumerate(samplings)}
    for e in (plain, chained):
        for rid, sampling in samplings.items():
            e.admit(AdmitRequest(rid, tuple(tokens[rid]), sampling))
    new: dict[str, list[int]] = {rid: [] for rid in samplings}
    backups = 0
    for step in range(10):
        # every third step the seeded-free request missed its chains: a backup (no drafts),
        # whose next pass catches it up and spawns its chains a step later
        backup = {rid: step % 3 == 2 and rid == "g" for rid in samplings}
        ks = {"g": 4, "s": 2 if step % 2 else 4, "t": 4}  # mixed k every other step
        asks = [ProposeEntry(rid, step, tuple(new[rid]), len(tokens[rid]), ks[rid],
                             fixed_num_draft_tokens=not samplings[rid].greedy,
                             backup=backup[rid]) for rid in samplings]  # fmt: skip
        answers = []
        for e in (plain, chained):
            block, errors = e.propose(asks)
            assert not errors
            answers.append(block)
            e.draft_ahead(list(samplings))
        _same(answers[1], answers[0])
        pushed = [e.pushed(list(samplings)) for e in (plain, chained)]
        assert (pushed[0] is None) == (pushed[1] is None)
        if pushed[0] is not None and pushed[1] is not None:
            assert pushed[1].keys == pushed[0].keys
            _same(pushed[1].block, pushed[0].block)
        backups += sum(backup.values())
        block = answers[0]
        for i, rid in enumerate(block.request_ids):  # accept some drafts, then a token
            drafts = block.tokens(i)
            new[rid] = [*drafts[: (step + i) % (len(drafts) + 1)], 5 + step]
            tokens[rid] += new[rid]
    assert backups >= 3
    # chains of 3 steps (k = 4 for all: steps 1 .. 3, the chains a backup spawned too, which
    # start at step 1) and of 2 (from step 2, where a k = 2 row has ended)
    assert set(calls) == {2, 3}, calls
    assert len(calls) >= 20, calls
    assert any(spawned), "no chain drafted a backup's spawned chains"
