"""The draft engine: q rows from step-major step outputs, request-major; and a step that fails
leaves every request as it was."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service.drafting import _read_drafts, _Step
from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, SparseQ
from specdec.serving.messages import AdmitRequest, ErrorReason, ProposeEntry
from tests.draft_service.models import build_checkpoints, model_draft


class _HostRunner:
    """What `_read_drafts` needs of a runner, on the CPU."""

    @staticmethod
    def upload(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return list(tensors)


def _steps(ks: list[int], sparse: bool) -> list[_Step]:
    """Outputs per step; request b drafts token 10 b + j at step j, with q row 10 b + j."""
    out = []
    for j in range(max(ks)):
        rows = [b for b, k in enumerate(ks) if k > j]
        probs = torch.tensor([[10.0 * b + j] * 3 for b in rows])
        tokens = torch.tensor([10 * b + j for b in rows], dtype=torch.int32)
        out.append(_Step(rows, tokens, probs, (probs + 100).int() if sparse else None))
    return out


def test_drafts_and_q_rows_are_request_major_and_skip_greedy_requests() -> None:
    ks, sampled, runner = [2, 1, 3], [True, False, True], _HostRunner()
    drafted, dense, _ = _read_drafts(_steps(ks, False), ks, sampled, runner)  # type: ignore[arg-type]
    assert drafted == [[0, 1], [10], [20, 21, 22]]
    assert isinstance(dense, DenseQ)
    assert dense.probs[:, 0].tolist() == [0, 1, 20, 21, 22]
    _, sparse, _ = _read_drafts(_steps(ks, True), ks, sampled, runner)  # type: ignore[arg-type]
    assert isinstance(sparse, SparseQ) and sparse.token_ids.dtype == torch.int32
    assert sparse.token_ids[:, 0].tolist() == [100, 101, 120, 121, 122]
    assert torch.equal(sparse.probs, dense.probs)
    _, none, _ = _read_drafts(_steps(ks, True), ks, [False] * 3, runner)  # type: ignore[arg-type]
    assert none is None


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[1]


def _engine(draft_dir: Path) -> DraftEngine:
    config = model_draft(draft_dir)
    assert config.runner is not None
    runner = ModelRunner.load(config.runner)
    return DraftEngine(config, runner, model_info(config, runner))


def _admit(engine: DraftEngine) -> None:
    for i, rid in enumerate(("a", "b")):
        sampling = SamplingParams(0.8 if i else 0.0, seed=7)
        engine.admit(AdmitRequest(rid, tuple(range(3 + i, 12 + i)), sampling))


def test_a_failed_step_leaves_requests_as_they_were(
    draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean, faulty = _engine(draft_dir), _engine(draft_dir)
    _admit(clean)
    _admit(faulty)
    first = [ProposeEntry("a", 0, (), 9, 3), ProposeEntry("b", 0, (), 9, 2)]
    for e in (clean, faulty):
        assert not e.propose(first)[1]
    # step 1 commits 2 tokens for a and 1 for b, then fails inside its draft steps
    asks = [ProposeEntry("a", 1, (5, 6), 11, 4), ProposeEntry("b", 1, (7,), 10, 3)]
    calls = {"n": 0}
    real = faulty.runner.graph_step  # type: ignore[union-attr]

    def fail_second(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(faulty.runner, "graph_step", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        faulty.propose(asks)
    monkeypatch.undo()
    want, _ = clean.propose(asks)
    got, errors = faulty.propose(asks)  # the identical retry is served
    assert not errors
    assert got.draft_token_ids == want.draft_token_ids
    assert isinstance(got.sparse, SparseQ) and isinstance(want.sparse, SparseQ)
    assert torch.equal(got.sparse.token_ids, want.sparse.token_ids)
    # the retry re-prefills the rolled-back tail in a longer catch-up: float rounding may differ
    torch.testing.assert_close(got.sparse.probs, want.sparse.probs, atol=1e-6, rtol=0)
    for rid in ("a", "b"):
        assert faulty.runner.cached_length(rid) == clean.runner.cached_length(rid)  # type: ignore[union-attr]


def test_a_late_admissions_first_ask_at_a_later_step_is_caught_up(draft_dir: Path) -> None:
    """The target decoded steps at k = 0 while the draft prefilled a new request: its first ask
    comes at a later step with the tokens of the steps it missed, and is served as an ask at
    its expected step with the same tokens would be (the same drafts); steps go on from there.
    A later step whose tokens fall short of the committed length, or an earlier step, is
    refused."""
    late, on_time = _engine(draft_dir), _engine(draft_dir)
    prompt = tuple(range(3, 12))
    for e in (late, on_time):
        e.admit(AdmitRequest("a", prompt, SamplingParams(0.0), 1))  # the prefill's verdict: step 0
    missed = (5, 6, 7)  # three steps decoded at k = 0 meanwhile
    jumped, errors = late.propose([ProposeEntry("a", 4, missed, 12, 3)])
    assert not errors
    want, errors = on_time.propose([ProposeEntry("a", 1, missed, 12, 3)])
    assert not errors and jumped.draft_token_ids == want.draft_token_ids
    assert jumped.steps == [4]
    verdict = (*jumped.draft_token_ids[:1], 9)
    after, errors = late.propose([ProposeEntry("a", 5, verdict, 14, 2)])
    assert not errors and after.steps == [5]
    _, errors = late.propose([ProposeEntry("a", 9, (1,), 16, 2)])  # a token short of 16
    assert [e.reason for _, e in errors] == [ErrorReason.COMMITTED_LENGTH_MISMATCH]
    _, errors = late.propose([ProposeEntry("a", 3, (), 14, 2)])
    assert [e.reason for _, e in errors] == [ErrorReason.STALE_STEP]


def _graph_engine(draft_dir: Path, device: str, draft_ahead: int = 0) -> DraftEngine:
    config = model_draft(draft_dir)
    assert config.runner is not None
    slots = 4 if draft_ahead else 0  # draft-ahead's hypotheses
    runner_config = replace(
        config.runner, device=device, max_slots=4 + slots, cuda_graph_batch_sizes=(1, 2, 4)
    )
    config = replace(config, runner=runner_config, draft_ahead=draft_ahead, draft_ahead_slots=slots)
    runner = ModelRunner.load(runner_config)
    return DraftEngine(config, runner, model_info(config, runner))


def _serve_steps(engine: DraftEngine, batch: int) -> list[list[int]]:
    """Greedy and sampled requests, admitted, then six steps (each followed by the pass ahead
    where draft-ahead is on): tails of two tokens (after the admission), one (a rejection) and
    two (all accepted), then two steps at k = 0 and one whose tail is three tokens."""
    ids = [f"r{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        sampling = SamplingParams(0.8 if i % 2 else 0.0, seed=i)
        engine.admit(AdmitRequest(rid, tuple(range(3 + i, 12 + i)), sampling))
    out = []
    told = {rid: 9 for rid in ids}
    news = [  # the verdict each ask carries, and its k
        (lambda d: (5,), 2), (lambda d: (d[0], 11), 2), (lambda d: (*d, 13), 2),
        (lambda d: (d[0], 17), 0), (lambda d: (18,), 0), (lambda d: (19,), 2),  # tail 17 18 19
    ]  # fmt: skip
    drafts: dict[str, list[int]] = {rid: [] for rid in ids}
    for step, (new, k) in enumerate(news):
        asks = []
        for rid in ids:
            tokens = new(drafts[rid])
            told[rid] += len(tokens)
            asks.append(ProposeEntry(rid, step, tokens, told[rid], k))
        block, errors = engine.propose(asks)
        assert not errors
        for j, rid in enumerate(ids):
            drafts[rid] = block.tokens(j)
        out += [drafts[rid] for rid in ids]
        engine.draft_ahead(ids)
    engine.release(ids)
    return out


def test_capturing_graphs_at_start_up_leaves_the_engine_as_it_was(draft_dir: Path) -> None:
    """On the CPU no graph is captured, but the warm-up's steps run: they hold no slot and no
    request afterwards, and the drafts that follow are those of an engine without them."""
    warm, cold = _graph_engine(draft_dir, "cpu", 1), _graph_engine(draft_dir, "cpu", 1)
    assert warm.runner is not None
    free = warm.runner.free_slots
    assert warm.capture_graphs() == 0  # no graphs on the CPU
    assert warm.runner.free_slots == free
    assert _serve_steps(warm, 4) == _serve_steps(cold, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft_ahead", [0, 2])
def test_serving_captures_no_graph_after_start_up(draft_dir: Path, draft_ahead: int) -> None:
    """Every batch size's graphs are captured at start-up: the steps serving runs (greedy and
    sampled, tails of one and two tokens, a longer tail after k = 0 steps, draft-ahead's
    passes) capture nothing more, so no Propose pays a compile and capture."""
    engine = _graph_engine(draft_dir, "cuda", draft_ahead)
    assert engine.runner is not None
    captured = engine.capture_graphs()
    assert captured > 0 and engine.runner.graphs_captured == captured
    eager = engine.runner.eager_steps
    for batch in (1, 2, 3, 4):
        _serve_steps(engine, batch)
    assert engine.runner.graphs_captured == captured
    assert engine.runner.eager_steps == eager


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_spawned_chains_are_lock_step_drafts_and_stay_on_graphs(
    draft_dir: Path, device: str
) -> None:
    """After backups (no drafts, the KV behind the verdict), one pass ahead catches two
    requests up and spawns their chains (`drafting.Spawn`), on CUDA within the graphs
    captured at start-up: each chain holds k - 1 drafts, greedy those of a request
    [*committed, g] drafting k - 1, and an ask of its verdict is answered with them."""
    engine = _graph_engine(draft_dir, device, 2)
    runner = engine.runner
    assert runner is not None
    engine.capture_graphs()
    captured, eager = runner.graphs_captured, runner.eager_steps
    k, ids = 3, ["a", "b"]
    prompts = {rid: tuple(range(3 + i, 12 + i)) for i, rid in enumerate(ids)}
    for rid in ids:
        engine.admit(AdmitRequest(rid, prompts[rid], SamplingParams(0.0)))
    first, errors = engine.propose([ProposeEntry(rid, 0, (), 9, k) for rid in ids])
    assert not errors and engine.draft_ahead(ids) > 0
    committed = {rid: (*prompts[rid], first.tokens(i)[0], 5) for i, rid in enumerate(ids)}
    asks = [ProposeEntry(rid, 1, committed[rid][9:], 11, k, backup=True) for rid in ids]
    answer, errors = engine.propose(asks)
    assert not errors and answer.num_draft_tokens == [0, 0]
    assert engine.draft_ahead(ids) == 4  # F = 2 chains each, spawned from the catch-ups
    assert (runner.graphs_captured, runner.eager_steps) == (captured, eager)
    push = engine.pushed(ids)
    assert push is not None and push.block.num_draft_tokens == [k - 1] * 4
    pairs = zip(push.block.request_ids, push.keys, strict=True)
    chains = {(rid, key): push.block.tokens(i) for i, (rid, key) in enumerate(pairs)}
    verdicts = {rid: key for rid, key in chains if rid == "a"} | {"b": push.keys[-1]}
    answer, errors = engine.propose([ProposeEntry(rid, 2, verdicts[rid], 12, k) for rid in ids])
    assert not errors and answer.num_draft_tokens == [k - 1] * 2
    for i, rid in enumerate(ids):
        assert answer.tokens(i) == chains[(rid, verdicts[rid])]
    engine.release(ids)
    for rid in ids:  # what a request [*committed, g] drafting k - 1 gets
        ref = f"ref-{rid}"
        engine.admit(AdmitRequest(ref, (*committed[rid], *verdicts[rid]), SamplingParams(0.0)))
        want, errors = engine.propose([ProposeEntry(ref, 0, (), 12, k - 1)])
        assert not errors and want.tokens(0) == chains[(rid, verdicts[rid])]
        engine.release([ref])
