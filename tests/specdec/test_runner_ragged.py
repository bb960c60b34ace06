"""ragged_step: a verify or catch-up with a different token count per request in one padded
step (a CUDA graph on GPU), against the ragged eager forward and transformers."""

import pytest
import torch

from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import hf_model, reference_logits
from tests.specdec.test_runner_parity import TOL, make_runner, seqs


def _prefill(runner: ModelRunner, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, prompt, 0)])


def test_ragged_step_matches_transformers_and_extends_by_real_lengths() -> None:
    model = hf_model("llama3")
    runner = make_runner(model)
    a, b, c = seqs(3)
    _prefill(runner, {"a": a[:8], "b": b[:4], "c": c[:10]})
    tails = [a[8:11], b[4:5], c[10:12]]  # k = 2, 0, 1: verify rows 3, 1 and 2
    logits, outs = runner.ragged_step(["a", "b", "c"], tails)
    assert logits.shape[:2] == (3, 3) and outs == ()
    torch.testing.assert_close(logits[0], reference_logits(model, a[:11])[8:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1, :1], reference_logits(model, b[:5])[4:], atol=TOL, rtol=0)
    torch.testing.assert_close(
        logits[2, :2], reference_logits(model, c[:12])[10:], atol=TOL, rtol=0
    )
    assert [runner.cached_length(r) for r in "abc"] == [11, 5, 12]


def test_ragged_step_runs_the_head_on_padded_logits() -> None:
    model = hf_model("llama3")
    runner = make_runner(model)
    a, b, _ = seqs(4)
    _prefill(runner, {"a": a[:6], "b": b[:6]})
    last = torch.tensor([2, 0])

    def head(logits: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[2])).squeeze(1)
        return (rows.argmax(-1),)

    _, (tokens,) = runner.ragged_step(["a", "b"], [a[6:9], b[6:7]], head, (last,))
    want = [int(reference_logits(model, a[:9])[-1].argmax()),
            int(reference_logits(model, b[:7])[-1].argmax())]  # fmt: skip
    assert tokens.tolist() == want


def test_ragged_step_refuses_empty_rows_and_changes_nothing() -> None:
    runner = make_runner(hf_model("llama3"))
    a, b, _ = seqs(5)
    _prefill(runner, {"a": a[:5], "b": b[:5]})
    with pytest.raises(ValueError, match="non-empty"):
        runner.ragged_step(["a", "b"], [a[5:7], []])
    assert [runner.cached_length(r) for r in "ab"] == [5, 5]


def _graph_runners(sizes: tuple[int, ...]) -> tuple[object, ModelRunner, ModelRunner]:
    model = hf_model("llama3")
    state = {k: v.cuda() for k, v in model.state_dict().items()}

    def make(s: tuple[int, ...]) -> ModelRunner:
        config = RunnerConfig(
            model_path="unused", device="cuda", max_slots=4, max_seq_len=64,
            cuda_graph_batch_sizes=s, cuda_graph_max_tokens=5,
        )  # fmt: skip
        return ModelRunner.from_hf_weights(config, model.config, state)

    return model, make(sizes), make(())


@pytest.mark.gpu
def test_ragged_graph_step_matches_eager_and_buffers_change_on_replay() -> None:
    _, graphed, eager = _graph_runners((2, 4))
    g = torch.Generator().manual_seed(0)
    ids = ["a", "b", "c"]
    prompts = {rid: torch.randint(0, 300, (6 + i,), generator=g).tolist()
               for i, rid in enumerate(ids)}  # fmt: skip
    for r in (graphed, eager):
        _prefill(r, prompts)
    g = torch.Generator().manual_seed(1)
    before = None
    for step in range(3):
        tails = [torch.randint(0, 300, (1 + (i + step) % 3,), generator=g).tolist()
                 for i in range(3)]  # fmt: skip
        got, _ = graphed.ragged_step(ids, tails)
        want, _ = eager.ragged_step(ids, tails)
        for i, t in enumerate(tails):
            torch.testing.assert_close(got[i, : len(t)], want[i, : len(t)], atol=2e-4, rtol=0)
            assert torch.equal(got[i, : len(t)].argmax(-1), want[i, : len(t)].argmax(-1))
        if before is not None and got.shape == before.shape:
            assert not torch.equal(got, before), "a replay left its logits buffer unwritten"
        before = got.clone()
    assert [graphed.cached_length(r) for r in ids] == [eager.cached_length(r) for r in ids]
    assert graphed.graph_steps == 3 and graphed.eager_steps == 0


@pytest.mark.gpu
def test_ragged_step_falls_back_to_eager_where_no_graph_fits() -> None:
    _, graphed, _ = _graph_runners((2,))
    _prefill(graphed, {"a": [1, 2, 3], "b": [4, 5], "c": [6]})
    graphed.ragged_step(["a", "b", "c"], [[7], [8], [9]])  # batch 3 > the largest graph, 2
    graphed.ragged_step(["a", "b"], [[1] * 6, [2]])  # 6 tokens > cuda_graph_max_tokens = 5
    assert graphed.eager_steps == 2 and graphed.graph_steps == 0
    graphed.ragged_step(["a", "b"], [[1, 2], [3]])
    assert graphed.graph_steps == 1
