"""CUDA-only checks: graph replays rewrite their static buffers, and CUDA parity."""

import pytest
import torch

from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import hf_model, reference_logits

pytestmark = pytest.mark.gpu
# the first GPU and, where there is one, another: a service Ray places on cuda:1
DEVICES = [
    "cuda",
    pytest.param("cuda:1", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")),
]  # fmt: skip


def runners(
    family: str, sizes: tuple[int, ...], device: str = "cuda"
) -> tuple[object, ModelRunner, ModelRunner]:
    model = hf_model(family)
    state = {k: v.to(device) for k, v in model.state_dict().items()}
    make = lambda s: ModelRunner.from_hf_weights(
        RunnerConfig(
            model_path="unused",
            device=device,
            max_slots=4,
            max_seq_len=64,
            cuda_graph_batch_sizes=s,
        ),
        model.config,
        state,
    )
    return model, make(sizes), make(())


def draft_head(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # logits [B, n, V] float32; temperature [B]
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
    return probs.argmax(-1).to(torch.int32), probs


@pytest.mark.parametrize("device", DEVICES)
def test_graph_buffers_change_on_replay_and_match_eager(device: str) -> None:
    _, graphed, eager = runners("qwen3", (2, 4), device)
    g = torch.Generator().manual_seed(0)
    ids = ["a", "b", "c"]  # batch 3 pads to the captured size 4
    prompts = [torch.randint(0, 300, (5 + i,), generator=g) for i in range(len(ids))]
    for r in (graphed, eager):
        for rid, prompt in zip(ids, prompts, strict=True):
            r.add_request(rid)
            r.forward([ForwardItem(rid, prompt, 0)])
    temps = torch.tensor([1.0, 0.7, 1.3], device=graphed.device)
    buffer, before = 0, torch.empty(0)
    for step in range(3):
        tokens = torch.randint(0, 300, (3, 1), generator=g).to(graphed.device)
        got = graphed.graph_step(ids, tokens, head=draft_head, head_inputs=(temps,))
        want = eager.graph_step(ids, tokens, head=draft_head, head_inputs=(temps,))
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        assert torch.equal(got[0], want[0]) and got[1].dtype == torch.float32
        if step:
            assert got[1].data_ptr() == buffer  # the same static buffer ...
            assert not torch.equal(got[1], before)  # ... rewritten by the replay
        buffer, before = got[1].data_ptr(), got[1].clone()
    # verify-shaped steps (logits only) replay too, and advance the cache
    for _ in range(2):
        tokens = torch.randint(0, 300, (3, 3), generator=g).to(graphed.device)
        got_logits = graphed.graph_step(ids, tokens)
        want_logits = eager.graph_step(ids, tokens)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
    assert graphed.cached_length("c") == 7 + 3 + 6


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_forward_matches_transformers(device: str) -> None:
    model, runner, _ = runners("llama3", (), device)
    a = torch.randint(0, 300, (20,)).tolist()
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", a[:12], 12)])
    out = torch.cat([out, runner.forward([ForwardItem("a", a[12:], 8)])])
    assert out.device == runner.device
    out = out.cpu()
    torch.testing.assert_close(out, reference_logits(model, a), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype: str) -> None:
    model = hf_model("qwen2")
    state = {k: v.cuda() for k, v in model.state_dict().items()}
    runner = ModelRunner.from_hf_weights(
        RunnerConfig(
            model_path="unused",
            device="cuda",
            dtype=dtype,
            max_seq_len=64,
            cuda_graph_batch_sizes=(1,),
        ),
        model.config,
        state,
    )
    a = torch.randint(0, 300, (10,)).tolist()
    runner.add_request("a")
    runner.forward([ForwardItem("a", a[:9], 0)])
    logits = runner.graph_step(["a"], torch.tensor([a[9:]], device="cuda"))
    assert logits.dtype == torch.float32
    ref = reference_logits(model, a)[9]
    torch.testing.assert_close(logits[0, 0].cpu(), ref, atol=0.15, rtol=0.05)


def test_programmatic_dependent_launch_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runner kernel waits on its predecessor before touching shared data (specdec/gdc.py):
    graphed decode and verify steps with PDL give the same bits as with it off, over several
    dependent steps (each step reads the cache the previous one wrote)."""
    from specdec.gdc import pdl_enabled

    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("needs a GPU with programmatic dependent launch (compute capability 9+)")
    outputs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SPECDEC_PDL", flag)
        _, graphed, _ = runners("qwen3", (2, 4))
        g = torch.Generator().manual_seed(1)
        ids = ["a", "b", "c", "d"]
        for i, rid in enumerate(ids):
            graphed.add_request(rid)
            graphed.forward([ForwardItem(rid, torch.randint(0, 300, (4 + i,), generator=g), 0)])
        steps = []
        for n in (1, 1, 3, 1, 5):
            tokens = torch.randint(0, 300, (4, n), generator=g).cuda()
            steps.append(graphed.graph_step(ids, tokens).clone())
        outputs.append(torch.stack([s.flatten() for s in steps[:2]] + [steps[3].flatten()]))
        outputs.append(torch.cat([steps[2].flatten(), steps[4].flatten()]))
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])


def test_to_host_reads_any_dtype_and_shape_through_one_kept_buffer() -> None:
    """`to_host` copies through one pinned buffer it keeps (a pinned allocation can hold a
    step for milliseconds): every dtype and shape (empty ones too) comes back equal, a later
    read of no more bytes reuses the buffer, and what it returned earlier stays as it was."""
    _, runner, _ = runners("qwen3", ())
    dev = runner.device
    first = [
        torch.arange(7, dtype=torch.int32, device=dev),
        torch.rand(3, 5, device=dev),
        torch.tensor([True, False, True], device=dev),
        torch.empty(0, 4, dtype=torch.int64, device=dev),
        torch.rand(2, 3, device=dev).t(),  # not contiguous
        torch.tensor(2.5, dtype=torch.bfloat16, device=dev),
    ]
    got = runner.to_host(*first)
    for g, t in zip(got, first, strict=True):
        assert g.device.type == "cpu" and g.dtype == t.dtype and g.shape == t.shape
        assert torch.equal(g, t.cpu())
    buffer = runner._staging
    assert buffer is not None and buffer.is_pinned()
    again = runner.to_host(torch.full((9,), 7, dtype=torch.int64, device=dev))
    assert runner._staging is buffer and again[0].tolist() == [7] * 9
    assert torch.equal(got[0], first[0].cpu()), "an earlier result was overwritten"
    big = torch.rand(buffer.numel() // 4 + 1, device=dev)  # more than the buffer: it grows
    assert torch.equal(runner.to_host(big)[0], big.cpu()) and runner._staging is not buffer
