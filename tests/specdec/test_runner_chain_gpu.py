"""`ModelRunner.chain_step` on a GPU: one CUDA graph replay for a chain of one-token steps gives
the tokens (and, to float32 rounding, the q rows) of the same steps replayed one graph at a
time, greedy and seeded sampled, at a batch padded to a captured size; a second chain of the
same shape replays without a capture and rewrites its buffers."""

from __future__ import annotations

import pytest
import torch

from draft_service.drafting import POSITION, make_head, with_guesses
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import hf_model
from tests.specdec.test_runner_chain import VOCAB, head_inputs

pytestmark = pytest.mark.gpu


def gpu_runner(block_size: int = 0) -> ModelRunner:
    model = hf_model("llama3")
    state = {k: v.cuda() for k, v in model.state_dict().items()}
    config = RunnerConfig(model_path="unused", device="cuda", max_slots=8, max_seq_len=64,
                          cuda_graph_batch_sizes=(2, 4), kv_block_size=block_size)  # fmt: skip
    return ModelRunner.from_hf_weights(config, model.config, state)


@pytest.mark.parametrize("block_size", [0, 16], ids=["slots", "paged"])
@pytest.mark.parametrize(
    "temperature, guesses", [(0.0, 0), (0.9, 0), (0.9, 3)], ids=["greedy", "sampled", "guessing"]
)  # fmt: skip
def test_a_chain_in_one_graph_is_the_steps_replayed_one_at_a_time(
    block_size: int, temperature: float, guesses: int
) -> None:
    runner = gpu_runner(block_size)
    ids = ["a", "b", "c"]  # batch 3 pads to the captured 4
    g = torch.Generator().manual_seed(0)
    for i, rid in enumerate(ids):
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, torch.randint(0, VOCAB, (5 + i,), generator=g), 0)])
        runner.add_request(rid + "'")
    runner.fork([(rid, rid + "'", runner.cached_length(rid)) for rid in ids])
    head = make_head(VOCAB, 16 if temperature else None)
    if guesses:  # draft-ahead's: the ids of the most likely tokens, last in the outputs
        head = with_guesses(head, VOCAB, guesses)
    inputs = head_inputs(3, temperature, runner.device)
    first = torch.tensor([[7], [8], [9]], device="cuda")
    steps = 3
    one_at_a_time = runner._chain_of_steps(ids, first, head, inputs, steps, POSITION)
    captured, replays = runner.graphs_captured, runner.graph_steps
    chained = [r + "'" for r in ids]
    got = [t.clone() for t in runner.chain_step(chained, first, head, inputs, steps, POSITION)]
    assert runner.graphs_captured == captured + 1 and runner.graph_steps == replays + 1
    assert torch.equal(got[0], one_at_a_time[0])
    for a, b in zip(got[1:], one_at_a_time[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert [runner.cached_length(r) for r in chained] == [runner.cached_length(r) for r in ids]
    # the same shape again, from other tokens: no capture, the buffers rewritten
    again = runner.chain_step(chained, first + 1, head, inputs, steps, POSITION)
    assert runner.graphs_captured == captured + 1
    want = runner._chain_of_steps(ids, first + 1, head, inputs, steps, POSITION)
    assert torch.equal(again[0], want[0])
