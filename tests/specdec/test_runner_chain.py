"""`ModelRunner.chain_step`: k one-token steps, each fed the token the head sampled in the one
before, as one CUDA graph on a GPU (`graphs.chain_body`). On the CPU: the body the graph
captures, run eagerly, gives what the steps one at a time give (seeded sampling included, so
each step's position input advances as the host's loop advances it), a failed chain leaves the
cache as it was, and bad calls are refused. The graph itself: `test_runner_chain_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from draft_service.drafting import POSITION, make_head
from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.graphs import chain_body
from tests.specdec._runner_models import hf_model

VOCAB = 300


def cpu_runner() -> ModelRunner:
    model = hf_model("llama3")
    config = RunnerConfig(model_path="unused", max_slots=8, max_seq_len=64)
    return ModelRunner.from_hf_weights(config, model.config, model.state_dict())


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
