"""`ModelRunner.chain_step`: k one-token steps, each fed the token the head sampled in the one
before, as one CUDA graph on a GPU (`graphs.chain_body`). On the CPU: the body the graph
captures, run eagerly, gives what the steps one at a time give (seeded sampling included, so
each step's position input advances as the host's loop advances it); the runner's graph path
around it (buffers, padding rows, the KV bookkeeping of a slot or a paged cache, forked
branches) with "graphs" that run their bodies at replay; a failed chain leaves the cache as it
was, and bad calls are refused. The CUDA graph itself: `test_runner_chain_gpu.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from draft_service.drafting import POSITION, make_head
from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.graphs import StepGraphs, _Graph, chain_body
from tests.specdec._runner_models import hf_model

VOCAB = 300


def cpu_runner(block_size: int = 0) -> ModelRunner:
    model = hf_model("llama3")
    config = RunnerConfig(model_path="unused", max_slots=8, max_seq_len=64,
                          kv_block_size=block_size)  # fmt: skip
    return ModelRunner.from_hf_weights(config, model.config, model.state_dict())


class _Replay:
    def __init__(self, run: Callable[[], object]) -> None:
        self.replay = run


class EagerGraphs(StepGraphs):
    """`StepGraphs` whose graphs run their bodies eagerly at each replay (the CPU has no CUDA
    graphs): the same buffers, input copies, padding rows and output slices."""

    def _capture(
        self,
        bs: int,
        n: int,
        head: Any,
        head_inputs: Sequence[torch.Tensor],
        chain: tuple[int, int] | None = None,
    ) -> _Graph:
        inputs, logits, body = self._buffers(bs, n, head, head_inputs, chain)
        outputs = tuple(torch.empty_like(x) for x in body(None))  # as the warm-up, on scratch
        return _Graph(_Replay(lambda: body(outputs)), *inputs, logits, outputs)  # type: ignore[arg-type]


def with_eager_graphs(runner: ModelRunner, sizes: tuple[int, ...]) -> ModelRunner:
    cache = runner._cache
    width = cache.table_width if cache.page is not None else None  # type: ignore[union-attr]
    graphs = EagerGraphs(runner._backend.step, (), runner.vocab_size, runner.config.max_seq_len,
                         cache.scratch_slot, runner.device, width)  # fmt: skip
    graphs._sizes = sorted(sizes)  # no CUDA graph pool: captured "graphs" run eagerly
    runner._graphs = graphs
    return runner


def prefilled(runner: ModelRunner, ids: list[str], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for i, rid in enumerate(ids):
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, torch.randint(0, VOCAB, (5 + i,), generator=g), 0)])


def head_inputs(b: int, temperature: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(last, temperature, top_k, top_p, seed, position) as `Drafter.drafts` passes them."""
    return tuple(t.to(device) for t in (
        torch.zeros(b, dtype=torch.long), torch.full((b,), temperature),
        torch.zeros(b, dtype=torch.int32), torch.ones(b), torch.arange(b) + 11,
        torch.tensor([20 + 3 * i for i in range(b)]),
    ))  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_captured_body_run_eagerly_is_the_steps_one_at_a_time(temperature: float) -> None:
    runner = cpu_runner()
    ids = ["a", "b", "c"]
    prefilled(runner, ids)
    for rid in ids:  # the same requests again under other ids, for the chain
        runner.add_request(rid + "'")
    runner.fork([(rid, rid + "'", runner.cached_length(rid)) for rid in ids])
    head = make_head(VOCAB, 16 if temperature else None)
    inputs = head_inputs(3, temperature, runner.device)
    first = torch.tensor([[7], [8], [9]])
    steps = 4
    want = runner.chain_step(ids, first, head, inputs, steps, POSITION)  # the host's loop
    lengths = [runner.cached_length(r + "'") for r in ids]
    chained = [r + "'" for r in ids]
    cache = runner._cache
    slots = torch.tensor(cache.prepare(chained, lengths, [steps] * 3, 64))
    logits = torch.empty(3, 1, runner.vocab_size)
    with torch.inference_mode():
        got = chain_body(runner._backend.step, first, torch.tensor(lengths), slots, 64,
                         logits, head, inputs, steps, POSITION)  # fmt: skip
    assert len(got) == len(want) == (3 if temperature else 2)
    assert [tuple(t.shape[:2]) for t in got] == [(steps, 3)] * len(got)
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_a_failed_chain_leaves_every_request_as_it_was() -> None:
    runner = cpu_runner()
    ids = ["a", "b"]
    prefilled(runner, ids)
    before = [runner.cached_length(r) for r in ids]
    calls = []
    head = make_head(VOCAB, None)

    def failing(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the third step fails")
        return head(*args)

    with pytest.raises(RuntimeError, match="third"):
        runner.chain_step(ids, torch.tensor([[1], [2]]), failing,
                          head_inputs(2, 0.0, runner.device), 4, POSITION)  # fmt: skip
    assert [runner.cached_length(r) for r in ids] == before


@pytest.mark.parametrize(
    "tokens, steps, advance",
    [(torch.tensor([[1, 2], [3, 4]]), 2, POSITION), (torch.tensor([[1], [2]]), 0, POSITION),
     (torch.tensor([[1], [2]]), 2, 6)],
)  # fmt: skip
def test_a_chain_of_bad_shape_is_refused(tokens: torch.Tensor, steps: int, advance: int) -> None:
    runner = cpu_runner()
    prefilled(runner, ["a", "b"])
    with pytest.raises(InvalidInputError, match="chain_step needs"):
        runner.chain_step(["a", "b"], tokens, make_head(VOCAB, None),
                          head_inputs(2, 0.0, runner.device), steps, advance)  # fmt: skip
    assert [runner.cached_length(r) for r in ("a", "b")] == [5, 6]


@pytest.mark.parametrize("block_size", [0, 4], ids=["slots", "paged"])
@pytest.mark.parametrize("batch", [2, 3])  # a captured size, and one padded to 4
def test_the_graph_path_keeps_the_kv_as_the_steps_do(block_size: int, batch: int) -> None:
    """A chain through the graph path, on requests and on branches forked from them (a paged
    cache copies the partly written block a branch writes into), gives the steps' outputs and
    cached lengths, and the KV it wrote serves the next step as theirs does."""
    graphed = with_eager_graphs(cpu_runner(block_size), (2, 4))
    plain = cpu_runner(block_size)
    ids = ["a", "b", "c"][:batch]
    branches = [r + "/1" for r in ids]
    head = make_head(VOCAB, 16)
    inputs = head_inputs(batch, 0.9, graphed.device)
    for r in (graphed, plain):
        prefilled(r, ids)
        pairs = list(zip(ids, branches, strict=True))
        for _, bid in pairs:
            r.add_request(bid)
        r.fork([(rid, bid, r.cached_length(rid) - 1) for rid, bid in pairs])
    for chain_ids, steps in ((ids, 3), (branches, 2), (ids, 2)):
        first = torch.tensor([[11 + i] for i in range(batch)])
        captured = graphed.graphs_captured
        got = graphed.chain_step(chain_ids, first, head, inputs, steps, POSITION)
        want = plain.chain_step(chain_ids, first, head, inputs, steps, POSITION)
        assert graphed.graphs_captured in (captured, captured + 1)
        assert [tuple(t.shape[:2]) for t in got] == [(steps, batch)] * 3
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        lengths = [graphed.cached_length(r) for r in chain_ids]
        assert lengths == [plain.cached_length(r) for r in chain_ids]
    assert graphed.graph_steps >= 3
    every = ids + branches
    step = torch.tensor([[7]] * len(every))
    torch.testing.assert_close(graphed.graph_step(every, step), plain.graph_step(every, step),
                               rtol=0, atol=1e-4)  # fmt: skip


def test_a_failed_graphed_chain_leaves_every_request_as_it_was() -> None:
    runner = with_eager_graphs(cpu_runner(4), (2,))
    prefilled(runner, ["a", "b"])
    before = [runner.cached_length(r) for r in ("a", "b")]
    head = make_head(VOCAB, None)
    calls = []

    def failing(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        calls.append(1)
        if len(calls) == 5:  # the capture's run is 3 steps, then the replay's second step
            raise RuntimeError("a step fails")
        return head(*args)

    with pytest.raises(RuntimeError, match="a step fails"):
        runner.chain_step(["a", "b"], torch.tensor([[1], [2]]), failing,
                          head_inputs(2, 0.0, runner.device), 3, POSITION)  # fmt: skip
    assert [runner.cached_length(r) for r in ("a", "b")] == before
    out = runner.chain_step(["a", "b"], torch.tensor([[1], [2]]), failing,
                            head_inputs(2, 0.0, runner.device), 3, POSITION)  # fmt: skip
    assert out[0].shape == (3, 2) and [runner.cached_length(r) for r in ("a", "b")] == [
        b + 3 for b in before
    ]
