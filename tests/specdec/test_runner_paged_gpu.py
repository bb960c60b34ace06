"""The paged KV cache on a GPU (CUDA graphs over block tables, the paged Triton decode kernel,
copies on write between a request's forks) against fixed slots and transformers, in float32."""

import pytest
import torch

from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import hf_model, reference_logits

pytestmark = pytest.mark.gpu
TOL = 1e-4


def _runner(model: object, **kv: object) -> ModelRunner:
    state = {k: v.cuda() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    config = RunnerConfig(
        "unused", device="cuda", max_slots=6, max_seq_len=64, cuda_graph_batch_sizes=(1, 2, 4), **kv
    )  # type: ignore[arg-type]
    return ModelRunner.from_hf_weights(config, model.config, state)  # type: ignore[attr-defined]


@pytest.mark.parametrize("block_size", [4, 16])
def test_graphed_paged_steps_match_slots_and_transformers(block_size: int) -> None:
    model = hf_model("mistral")  # GQA and a sliding window
    paged, slots = _runner(model, kv_block_size=block_size), _runner(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (30,), generator=g).tolist() for _ in range(3)]
    for r in (paged, slots):
        for i, s in enumerate(seqs):
            r.add_request(f"r{i}")
            r.forward([ForwardItem(f"r{i}", s[: 9 + i], 0)])
    ids = ["r0", "r1", "r2"]  # batch 3 pads to the captured 4
    for step in range(3):  # decode steps, graphed
        tokens = torch.tensor([[s[9 + i + step]] for i, s in enumerate(seqs)], device="cuda")
        got, want = paged.graph_step(ids, tokens), slots.graph_step(ids, tokens)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert paged.graph_steps == 3
    # a ragged verify, graphed: rows of 3, 1 and 2 tokens
    rows = [s[12 + i : 12 + i + n] for i, (s, n) in enumerate(zip(seqs, (3, 1, 2), strict=True))]
    got, want = paged.ragged_step(ids, rows)[0], slots.ragged_step(ids, rows)[0]
    for i, n in enumerate((3, 1, 2)):
        torch.testing.assert_close(got[i, :n], want[i, :n], atol=TOL, rtol=0)
        ref = reference_logits(model, seqs[i][: 12 + i + n])[12 + i :]
        torch.testing.assert_close(got[i, :n].cpu(), ref, atol=TOL, rtol=0)
    assert paged.graph_steps == 4


def test_forks_on_the_gpu_copy_only_what_they_write() -> None:
    model = hf_model("qwen3")
    runner = _runner(model, kv_block_size=4)
    seq = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.add_request("a")
    runner.forward([ForwardItem("a", seq[:10], 0)])
    for h in ("h0", "h1"):
        runner.add_request(h)
    runner.fork([("a", "h0", 10), ("a", "h1", 10)])
    out = runner.ragged_step(["h0", "h1"], [seq[10:13], [7, 8, 9]])[0]
    torch.testing.assert_close(out[0].cpu(), reference_logits(model, seq[:13])[10:], atol=TOL,
                               rtol=0)  # fmt: skip
    want = reference_logits(model, [*seq[:10], 7, 8, 9])[10:]
    torch.testing.assert_close(out[1].cpu(), want, atol=TOL, rtol=0)
    runner.swap("a", "h0")
    runner.release("h0"), runner.release("h1")
    out = runner.forward([ForwardItem("a", seq[13:15], 2)])
    torch.testing.assert_close(out.cpu(), reference_logits(model, seq[:15])[13:], atol=TOL,
                               rtol=0)  # fmt: skip
