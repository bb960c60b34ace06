"""Fast-path logits against transformers' own models, and the KV bookkeeping around them."""

import pytest
import torch

from specdec.errors import CacheFullError, InvalidInputError, UnknownRequestError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import FAMILIES, hf_model, reference_logits

TOL = 1e-4  # float32; the fast path matches transformers to ~1e-7 on these models


def make_runner(model, **overrides) -> ModelRunner:
    config = RunnerConfig(model_path="unused", **({"max_slots": 4, "max_seq_len": 64} | overrides))
    return ModelRunner.from_hf_weights(config, model.config, dict(model.state_dict()))


def seqs(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (13, 9, 17)]


def assert_ragged_then_graph_step(model, runner: ModelRunner) -> None:
    """Prefill two requests, score a ragged step (3 and 1 new tokens), then an equal-length
    graph_step (2 tokens each): every logit against transformers' own model."""
    a, b, _ = seqs(6)
    for rid in "ab":
        runner.add_request(rid)
    runner.forward([ForwardItem("a", a[:8], 0), ForwardItem("b", b[:3], 0)])
    out = runner.forward([ForwardItem("a", a[8:11], 3), ForwardItem("b", b[3:4], 1)])  # ragged
    want = torch.cat([reference_logits(model, a[:11])[8:], reference_logits(model, b[:4])[3:]])
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    logits = runner.graph_step(["a", "b"], torch.tensor([a[11:13], b[4:6]]))  # equal, eager
    assert isinstance(logits, torch.Tensor)
    torch.testing.assert_close(logits[0], reference_logits(model, a)[11:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(model, b[:6])[4:], atol=TOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_decode_and_ragged_verify_match_transformers(family: str) -> None:
    model = hf_model(family)
    runner = make_runner(model)
    a, b, c = seqs()
    ref = [reference_logits(model, s) for s in (a, b, c)]
    for rid in "abc":
        runner.add_request(rid)
    # prefill: a and b together, every position's logits for a, the last two for b
    out = runner.forward([ForwardItem("a", a[:10], 10), ForwardItem("b", b[:5], 2)])
    torch.testing.assert_close(out, torch.cat([ref[0][:10], ref[1][3:5]]), atol=TOL, rtol=0)
    # decode one token each
    out = runner.forward([ForwardItem("a", a[10:11], 1), ForwardItem("b", b[5:6], 1)])
    torch.testing.assert_close(out, torch.cat([ref[0][10:11], ref[1][5:6]]), atol=TOL, rtol=0)
    # ragged verify k = [1, 0, 3 + a prefill]: a scores 2, b decodes 1, c prefills and scores 4
    out = runner.forward(
        [ForwardItem("a", a[11:13], 2), ForwardItem("b", b[6:7], 1), ForwardItem("c", c, 4)]
    )
    want = torch.cat([ref[0][11:13], ref[1][6:7], ref[2][13:17]])
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    assert [runner.cached_length(r) for r in "abc"] == [13, 7, 17]


def test_ragged_batch_equals_each_request_alone() -> None:
    model = hf_model("qwen3")
    together, alone = make_runner(model), make_runner(model)
    a, b, c = seqs(1)
    items = [ForwardItem("a", a, 3), ForwardItem("b", b[:1], 1), ForwardItem("c", c[:6], 0)]
    for it in items:
        together.add_request(it.request_id)
        alone.add_request(it.request_id)
    batched = together.forward(items)
    single = torch.cat([alone.forward([it]) for it in items])
    assert batched.shape == (4, 300)
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=0)


def test_chunked_prefill_matches_one_pass() -> None:
    model = hf_model("llama3")
    runner = make_runner(model, prefill_chunk=4)
    a, b, _ = seqs(2)
    runner.add_request("a")
    runner.add_request("b")
    out = runner.forward([ForwardItem("a", a, 6), ForwardItem("b", b, 9)])
    want = torch.cat([reference_logits(model, a)[-6:], reference_logits(model, b)])
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)


def test_rollback_then_reforward_equals_a_fresh_run() -> None:
    model = hf_model("mistral")
    runner = make_runner(model)
    a = seqs(3)[2]
    runner.add_request("a")
    runner.forward([ForwardItem("a", a[:10], 1)])
    runner.forward([ForwardItem("a", [7, 8, 9, 10], 4)])  # drafts that get rejected
    runner.truncate("a", 11)  # one accepted: a[10] stands in for it below
    assert runner.cached_length("a") == 11
    runner.truncate("a", 10)
    out = runner.forward([ForwardItem("a", a[10:], 7)])
    torch.testing.assert_close(out, reference_logits(model, a)[10:], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="truncate length"):
        runner.truncate("a", 18)


def test_forks_of_two_sources_continue_each_exactly_and_leave_the_rest() -> None:
    """One fork call copies two sources into three branches: every layer of each branch holds
    its source's K/V up to its own length, each branch continues its source's sequence
    exactly, and the sources, the free slot and the scratch slot are untouched."""
    model = hf_model("qwen2")
    runner = make_runner(model, max_slots=6)
    b, _, a = seqs(5)  # 13 and 17 tokens
    for rid in ("a", "b", "a1", "a2", "b1"):
        runner.add_request(rid)
    runner.forward([ForwardItem("a", a[:12], 1), ForwardItem("b", b[:8], 1)])
    cache = runner._cache
    before = torch.stack(cache.layers).clone()  # [layers, slots + 1, 2, heads, seq, dim]
    runner.fork([("a", "a1", 12), ("a", "a2", 7), ("b", "b1", 8)])
    after = torch.stack(cache.layers)
    slot = cache.slot
    for src, branch, n in (("a", "a1", 12), ("a", "a2", 7), ("b", "b1", 8)):
        assert torch.equal(after[:, slot(branch), :, :, :n], before[:, slot(src), :, :, :n])
    free = ({*range(6)} - {slot(r) for r in ("a", "b", "a1", "a2", "b1")}).pop()
    for s in (slot("a"), slot("b"), free, cache.scratch_slot):
        assert torch.equal(after[:, s], before[:, s])
    out = runner.forward([ForwardItem("a1", a[12:15], 3), ForwardItem("a2", [5, 6], 2),
                          ForwardItem("b1", b[8:10], 2)])  # fmt: skip
    torch.testing.assert_close(out[:3], reference_logits(model, a)[12:15], atol=TOL, rtol=0)
    want_a2 = reference_logits(model, [*a[:7], 5, 6])[7:]
    torch.testing.assert_close(out[3:5], want_a2, atol=TOL, rtol=0)
    torch.testing.assert_close(out[5:], reference_logits(model, b)[8:10], atol=TOL, rtol=0)


def test_release_and_reuse_leaks_nothing() -> None:
    model = hf_model("qwen2")
    runner = make_runner(model, max_slots=2)
    a, b, _ = seqs(4)
    fresh = reference_logits(model, b)
    for _ in range(3):
        runner.add_request("x")
        runner.add_request("y")
        with pytest.raises(CacheFullError):
            runner.add_request("z")
        runner.forward([ForwardItem("x", a, 1)])
        out = runner.forward([ForwardItem("y", b, len(b))])
        torch.testing.assert_close(out, fresh, atol=TOL, rtol=0)
        runner.release("x")
        runner.release("y")
    assert runner._cache.num_free == 2 and runner._cache.request_ids == []


def test_errors_are_typed_and_change_nothing() -> None:
    runner = make_runner(hf_model("llama2"), max_seq_len=16)
    runner.add_request("a")
    with pytest.raises(ValueError, match="already"):
        runner.add_request("a")
    with pytest.raises(UnknownRequestError):
        runner.release("nope")
    runner.forward([ForwardItem("a", list(range(10)), 1)])
    with pytest.raises(CacheFullError, match="max_seq_len=16"):
        runner.forward([ForwardItem("a", list(range(7)), 1)])
    with pytest.raises(InvalidInputError, match="num_logits"):
        runner.forward([ForwardItem("a", [1], 2)])
    with pytest.raises(InvalidInputError, match=r"\[0, 300\)"):
        runner.forward([ForwardItem("a", [300], 1)])
    with pytest.raises(CacheFullError):
        runner.graph_step(["a"], torch.zeros(1, 7, dtype=torch.long))
    assert runner.cached_length("a") == 10


def test_graph_step_eager_matches_forward_and_runs_head() -> None:
    model = hf_model("qwen3")
    runner = make_runner(model)
    a, b, _ = seqs(5)
    runner.add_request("a")
    runner.add_request("b")
    runner.forward([ForwardItem("a", a[:8], 0), ForwardItem("b", b[:4], 0)])
    logits = runner.graph_step(["a", "b"], torch.tensor([a[8:10], b[4:6]]))
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], reference_logits(model, a[:10])[8:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(model, b[:6])[4:], atol=TOL, rtol=0)

    def head(lg: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(lg / temperature[:, None, None], dim=-1)  # [B, n, V]
        return probs.argmax(-1), probs

    ids, probs = runner.graph_step(
        ["a", "b"],
        torch.tensor([[a[10]], [b[6]]]),
        head=head,
        head_inputs=(torch.tensor([1.0, 0.5]),),
    )
    ref = reference_logits(model, b[:7])[6]
    torch.testing.assert_close(probs[1, 0], torch.softmax(ref / 0.5, -1), atol=1e-5, rtol=0)
    assert ids.shape == (2, 1) and runner.cached_length("a") == 11
