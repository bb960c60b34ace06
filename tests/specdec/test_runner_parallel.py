"""Tensor parallelism on the CPU (gloo): two ranks, each a process holding half of a tiny
float32 checkpoint, against one rank holding all of it and against transformers."""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.errors import CheckpointError, InvalidInputError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.parallel import ParallelRunner, launch
from tests.specdec._runner_models import hf_model, reference_logits, save_checkpoint

TOL = 1e-4  # float32: the ranks' partial sums add in another order than one matmul's


def _config(path: Path, world: int, **overrides: Any) -> RunnerConfig:
    return RunnerConfig(
        model_path=str(path), **({"max_slots": 4, "max_seq_len": 64, "prefill_chunk": 8}
                                 | overrides), tensor_parallel=world,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """qwen3 (q/k norm, untied head), qwen2 (biases, tied head, a vocabulary of 299 rows that
    two ranks split 150 + 149), llama2 (multi-head, four ranks possible)."""
    out = {}
    for family, vocab in (("qwen3", None), ("qwen2", 299), ("llama2", None)):
        model = hf_model(family)
        if vocab is not None:
            model.resize_token_embeddings(vocab)
        out[family] = (model, save_checkpoint(model, tmp_path_factory.mktemp(family)))
    return out


@pytest.fixture
def lost() -> list[str]:
    return []


def _launch(path: Path, world: int, lost: list[str], **overrides: Any) -> ParallelRunner:
    return launch(_config(path, world, **overrides), on_rank_death=lambda: lost.append("rank"))


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_two_ranks_give_one_ranks_logits(
    family: str, checkpoints: dict[str, tuple[Any, Path]], lost: list[str]
) -> None:
    """Prefill in chunks, a ragged verify, an equal-length step, a rollback and a fork: every
    logit of two ranks equals one rank's and transformers' within float32 tolerance."""
    model, path = checkpoints[family]
    one = ModelRunner.load(_config(path, 1))
    two = _launch(path, 2, lost)
    try:
        assert two.world == 2 and two.vocab_size == one.vocab_size == model.config.vocab_size
        g = torch.Generator().manual_seed(3)
        a, b = (torch.randint(0, 250, (n,), generator=g).tolist() for n in (21, 12))
        for runner in (one, two):
            runner.add_request("a")
            runner.add_request("b")
        for runner in (one, two):
            runner.forward([ForwardItem("a", a[:17], 1), ForwardItem("b", b[:6], 1)])
        outs = []
        for runner in (one, two):
            ragged, _ = runner.ragged_step(["a", "b"], [a[17:20], b[6:7]])
            step = runner.graph_step(["a", "b"], torch.tensor([[a[20]], [b[7]]]))
            runner.truncate("a", 18)  # reject two of a's tokens, then score others
            runner.add_request("a2")
            runner.fork([("a", "a2", 18)])
            again = runner.forward([ForwardItem("a", [5, 6], 2), ForwardItem("a2", [7], 1)])
            outs.append((ragged, step, again))
        for got, want in zip(outs[1], outs[0], strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        ragged, _, again = outs[1]
        want = reference_logits(model, a[:20])[17:]
        torch.testing.assert_close(ragged[0], want, atol=TOL, rtol=0)
        want = reference_logits(model, [*a[:18], 5, 6])[18:]
        torch.testing.assert_close(again[:2], want, atol=TOL, rtol=0)
    finally:
        two.close()
    assert not lost


def test_an_error_in_a_call_changes_nothing_on_any_rank(
    checkpoints: dict[str, tuple[Any, Path]], lost: list[str]
) -> None:
    model, path = checkpoints["qwen3"]
    two = _launch(path, 2, lost)
    try:
        two.add_request("a")
        with pytest.raises(InvalidInputError):
            two.forward([ForwardItem("a", [1, 2, 10_000], 1)])  # out of the vocabulary
        with pytest.raises(ValueError):
            two.add_request("a")  # a duplicate: refused on every rank
        logits = two.forward([ForwardItem("a", [1, 2, 3], 1)])
        torch.testing.assert_close(logits, reference_logits(model, [1, 2, 3])[2:], atol=TOL, rtol=0)
    finally:
        two.close()
    assert not lost


def test_four_ranks(checkpoints: dict[str, tuple[Any, Path]], lost: list[str]) -> None:
    model, path = checkpoints["llama2"]
    four = _launch(path, 4, lost)
    try:
        four.add_request("a")
        ids = list(range(3, 19))
        logits = four.forward([ForwardItem("a", ids, 4)])
        torch.testing.assert_close(logits, reference_logits(model, ids)[-4:], atol=TOL, rtol=0)
    finally:
        four.close()


def test_close_destroys_the_graphs_before_the_group_ends(
    checkpoints: dict[str, tuple[Any, Path]], lost: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA graph that captured a collective holds its NCCL communicator, and NCCL's end
    waits for it: rank 0 destroys its graphs before it leaves the group (each other rank does
    on its stop; the GPU test sees both, as an orderly end that returns)."""
    import specdec.runner.parallel as parallel

    _, path = checkpoints["qwen3"]
    order: list[str] = []
    leave = parallel._leave_group
    monkeypatch.setattr(
        parallel,
        "_leave_group",
        lambda orderly=True: (order.append(f"leave {orderly}"), leave(orderly)),
    )
    two = _launch(path, 2, lost)
    monkeypatch.setattr(two, "release_graphs", lambda: order.append("release"))
    two.close()
    assert order == ["release", "leave True"], order
    assert not lost


def test_a_head_count_the_ranks_do_not_divide_is_refused_before_any_process_starts(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    _, path = checkpoints["qwen3"]  # 4 heads, 2 KV heads
    with pytest.raises(CheckpointError, match=r"size of 4 does not divide .*num_key_value_heads"):
        launch(_config(path, 4))
    with pytest.raises(CheckpointError, match=r"size of 3 does not divide .*num_attention_heads"):
        launch(_config(path, 3))


def test_a_rank_that_dies_is_reported(
    checkpoints: dict[str, tuple[Any, Path]], lost: list[str]
) -> None:
    """A rank killed from outside: rank 0's watcher calls on_rank_death (in a service: the
    process exits, and the group is restarted as one)."""
    _, path = checkpoints["qwen3"]
    two = _launch(path, 2, lost)
    try:
        two._ranks[0].process.kill()
        deadline = time.monotonic() + 10.0
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == ["rank"]
    finally:
        two.close()


def test_a_failure_past_the_checks_ends_the_group(
    checkpoints: dict[str, tuple[Any, Path]], lost: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that fails on rank 0 after its checks (here: its forward, as an out-of-memory
    error would) may leave the ranks out of step: rank 0 ends the group (on_rank_death) and
    raises the error; an error of the checks does not (the test above)."""
    _, path = checkpoints["qwen3"]
    two = _launch(path, 2, lost)
    try:
        two.add_request("a")

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("CUDA out of memory (stand-in)")

        monkeypatch.setattr(two._backend, "run", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            two.forward([ForwardItem("a", [1, 2, 3], 1)])
        assert lost == ["rank"]
    finally:
        two.close(wait_s=1.0)  # rank 1 waits in the forward's first all-reduce: it is killed


def test_a_clean_exit_stops_the_ranks_and_exits_0(
    checkpoints: dict[str, tuple[Any, Path]], tmp_path: Path
) -> None:
    """A process that launched ranks and exits without closing them exits 0 (an exit hook
    stops them before multiprocessing ends them, which the watcher would take for a lost
    rank: exit status 70)."""
    _, path = checkpoints["qwen3"]
    script = tmp_path / "run.py"
    script.write_text(  # spawned ranks import the main module again: it is guarded
        "from specdec.runner import ForwardItem, RunnerConfig\n"
        "from specdec.runner.parallel import launch\n"
        "if __name__ == '__main__':\n"
        f"    r = launch(RunnerConfig({str(path)!r}, max_slots=2, max_seq_len=64, "
        "tensor_parallel=2))\n"
        "    r.add_request('a')\n"
        "    print(r.forward([ForwardItem('a', [1, 2, 3], 1)]).shape)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    command = [sys.executable, str(script)]
    out = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([1, 300])" in out.stdout and "exited with status" not in out.stderr
