"""Tensor parallelism on two GPUs (NCCL), CUDA graphs on: two ranks against one rank holding the
whole model, in float32 (exact up to the order of the partial sums) and in bfloat16 (greedy
equal where the top two logits are apart)."""

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.parallel import launch
from tests.specdec._runner_models import hf_model, save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
    pytest.mark.timeout(300),  # a group that hangs (its stop did once) fails, with its stacks
]


def _config(path: Path, world: int, dtype: str) -> RunnerConfig:
    return RunnerConfig(
        str(path), device="cuda", dtype=dtype, max_slots=4, max_seq_len=64,
        cuda_graph_batch_sizes=(1, 2, 4), tensor_parallel=world,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model("qwen3"), tmp_path_factory.mktemp("qwen3"))


def _head(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, ...]:
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
    return probs.argmax(-1).to(torch.int32), probs


def _steps(runner: ModelRunner, prompts: list[list[int]]) -> list[Any]:
    """Prefill, three graphed decode steps with a head, a ragged verify: what each returned."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, prompt, 0)])
    temps = torch.ones(len(ids), device=runner.device)
    out: list[Any] = []
    last = torch.tensor([[p[-1]] for p in prompts], device=runner.device)
    for _ in range(3):
        greedy, probs = runner.graph_step(ids, last, _head, (temps,))  # type: ignore[misc]
        out += [greedy.clone(), probs.clone()]
        last = greedy.long()
    logits, _ = runner.ragged_step(ids, [[5, 6, 7], [8]][: len(ids)])
    out.append(logits.clone())
    for rid in ids:
        runner.release(rid)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_give_one_gpus_steps_with_graphs(
    checkpoint: Path, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = [list(range(3, 14)), list(range(20, 27))]
    one = ModelRunner.load(_config(checkpoint, 1, dtype))
    want = _steps(one, prompts)
    two = launch(_config(checkpoint, 2, dtype))
    try:
        got = _steps(two, prompts)
        assert two.graph_steps >= 3, "the decode steps replayed no graph"
    finally:
        with caplog.at_level(logging.WARNING, logger="specdec.runner.parallel"):
            two.close()
    # the group ended in order: NCCL's orderly end returned (a graph holding a communicator
    # made it time out, and the end left waiting aborted this process two tests later)
    assert not dist.is_initialized()
    stuck = [t.name for t in threading.enumerate() if t.name in ("tp-leave", "tp-abort")]
    assert not stuck, f"the group's end is still waiting in {stuck}"
    assert "orderly end" not in caplog.text, caplog.text
    atol = 1e-4 if dtype == "float32" else 5e-2
    compared = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype != torch.int32:
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=0)
            continue
        top2 = want[i + 1].topk(2, dim=-1).values  # the step's probs follow its greedy tokens
        # a greedy token must agree where its logit leads the runner-up's by more than the
        # precision can move it (bfloat16: near-ties may go either way)
        clear = (top2[..., 0].log() - top2[..., 1].log()) > (1e-3 if dtype == "float32" else 0.1)
        assert torch.equal(g[clear], w[clear]), (g, w)
        compared += int(clear.sum())
    assert compared > 0, "every greedy token was a near-tie: nothing compared"
