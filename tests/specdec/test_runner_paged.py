"""The runner over a paged KV cache (`kv_block_size` > 0) on the CPU: every logit equal to
transformers' own model and to the fixed-slot runner's, through prefill in chunks, ragged
verifies, equal-length steps, rollback, forks and swaps; prefix-cache hits that return what a
miss computes; and a pool too small for a step refused with nothing changed."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import CacheFullError
from specdec.runner import ForwardItem, RunnerConfig
from tests.specdec._runner_models import FAMILIES, hf_model, reference_logits
from tests.specdec.test_runner_parity import TOL, assert_ragged_then_graph_step, make_runner, seqs

PAGED = {"kv_block_size": 4, "kv_blocks": 40}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paged_runner_matches_transformers(family: str) -> None:
    model = hf_model(family)
    assert_ragged_then_graph_step(model, make_runner(model, **PAGED))


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_in_chunks_then_verify_and_rollback(block_size: int) -> None:
    model = hf_model("mistral")  # a sliding window of 6 over blocks
    runner = make_runner(model, kv_block_size=block_size, prefill_chunk=5, prefix_caching=False)
    _, b, a = seqs(3)  # 9 and 17 tokens
    ref_a, ref_b = reference_logits(model, a), reference_logits(model, b)
    runner.add_request("a"), runner.add_request("b")
    out = runner.forward([ForwardItem("a", a[:11], 11), ForwardItem("b", b[:4], 1)])
    torch.testing.assert_close(out, torch.cat([ref_a[:11], ref_b[3:4]]), atol=TOL, rtol=0)
    # a verify whose drafts are rejected: roll back, then write other tokens there
    runner.forward([ForwardItem("a", [7, 8, 9], 3)])
    runner.truncate("a", 11)
    out = runner.ragged_step(["a", "b"], [a[11:14], b[4:5]])[0]
    torch.testing.assert_close(out[0], ref_a[11:14], atol=TOL, rtol=0)
    torch.testing.assert_close(out[1, :1], ref_b[4:5], atol=TOL, rtol=0)
    assert [runner.cached_length(r) for r in "ab"] == [14, 5]


def test_forks_and_swap_continue_the_request_exactly() -> None:
    model = hf_model("qwen3")
    runner = make_runner(model, max_slots=5, **PAGED)
    a = seqs(4)[2]  # 17 tokens
    ref = reference_logits(model, a)
    runner.add_request("a")
    runner.forward([ForwardItem("a", a[:10], 1)])
    free = runner._cache.pool.available  # type: ignore[union-attr]
    for h in ("h0", "h1"):
        runner.add_request(h)
    runner.fork([("a", "h0", 10), ("a", "h1", 9)])
    assert runner._cache.pool.available == free  # type: ignore[union-attr]  # shared, no copy
    out = runner.forward([ForwardItem("h0", a[10:13], 3), ForwardItem("h1", [99, 98], 2)])
    torch.testing.assert_close(out[:3], ref[10:13], atol=TOL, rtol=0)
    want_h1 = reference_logits(model, [*a[:9], 99, 98])[9:]
    torch.testing.assert_close(out[3:], want_h1, atol=TOL, rtol=0)
    runner.swap("a", "h0")  # the hypothesis came true: it becomes the request
    runner.release("h0"), runner.release("h1")
    out = runner.forward([ForwardItem("a", a[13:15], 2)])
    torch.testing.assert_close(out, ref[13:15], atol=TOL, rtol=0)


def test_a_prefix_hit_computes_only_the_rest_and_returns_what_a_miss_returns() -> None:
    model = hf_model("llama3")
    runner = make_runner(model, kv_block_size=4, kv_blocks=32, max_slots=3)
    shared = seqs(5)[2][:12]  # three full blocks
    first = [*shared, 1, 2, 3]
    runner.add_request("x")
    miss = runner.forward([ForwardItem("x", first, 2)])
    runner.release("x")
    runner.add_request("y")
    hit = runner.forward([ForwardItem("y", first, 2)])
    # the same keys and values read; only the batch shapes of the products differ
    torch.testing.assert_close(hit, miss, atol=TOL, rtol=0)
    torch.testing.assert_close(hit, reference_logits(model, first)[-2:], atol=TOL, rtol=0)
    stats = runner.prefix_cache_stats
    assert stats is not None and stats.hit_tokens == 12 and stats.queried_tokens == 30
    # a longer prompt on the same prefix: its logits against transformers
    runner.add_request("z")
    other = [*shared, 9, 9, 9, 9, 9]
    out = runner.forward([ForwardItem("z", other, 5)])
    torch.testing.assert_close(out, reference_logits(model, other)[12:], atol=TOL, rtol=0)
    assert runner.cached_length("z") == 17
    # logits asked for the whole prompt: nothing of it can come from the cache
    runner.add_request("w")
    out = runner.forward([ForwardItem("w", first, len(first))])
    torch.testing.assert_close(out, reference_logits(model, first), atol=TOL, rtol=0)


def test_a_step_the_pool_cannot_hold_changes_nothing() -> None:
    model = hf_model("qwen3")
    runner = make_runner(model, kv_block_size=4, kv_blocks=5, max_slots=3)
    b, a = seqs(7)[1:]  # 9 and 17 tokens
    runner.add_request("a"), runner.add_request("b")
    runner.forward([ForwardItem("a", a[:12], 1)])  # 3 of the 5 blocks
    with pytest.raises(CacheFullError, match="more KV blocks"):
        runner.forward([ForwardItem("a", a[12:14], 1), ForwardItem("b", b[:9], 1)])
    assert [runner.cached_length(r) for r in "ab"] == [12, 0]
    with pytest.raises(CacheFullError, match="more KV blocks"):
        runner.graph_step(["a", "b"], torch.tensor([a[12:17], b[:5]]))
    assert [runner.cached_length(r) for r in "ab"] == [12, 0]
    runner.release("a")  # its blocks stay cached but can be taken
    out = runner.forward([ForwardItem("b", b[:9], 1)])
    torch.testing.assert_close(out, reference_logits(model, b[:9])[8:], atol=TOL, rtol=0)


def test_paged_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_block_size too"):
        RunnerConfig("unused", kv_blocks=8)
    with pytest.raises(ValueError, match="kv_block_size must be in"):
        RunnerConfig("unused", kv_block_size=-1)
    config = RunnerConfig("unused", max_slots=4, max_seq_len=100, kv_block_size=16)
    assert config.num_kv_blocks == 4 * 7  # what four slots of 100 positions hold


def _failing_once(runner, what: str = "run") -> None:  # type: ignore[no-untyped-def]
    """The backend's next `what` call raises, as a device error in the forward would."""
    real = getattr(runner._backend, what)
    calls: list[int] = []

    def fail_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not calls:
            calls.append(1)
            raise RuntimeError("injected: device error in the forward")
        return real(*args, **kwargs)

    setattr(runner._backend, what, fail_once)


@pytest.mark.parametrize("what", ["run", "step"])
def test_a_failed_forward_or_step_leaves_the_requests_as_they_were(what: str) -> None:
    model = hf_model("llama3")
    runner = make_runner(model, kv_block_size=4, kv_blocks=16)
    a = seqs(1)[2]
    runner.add_request("a")
    if what == "step":
        runner.forward([ForwardItem("a", a[:9], 1)])
    free, length = runner.free_kv_blocks, runner.cached_length("a")
    _failing_once(runner, what)
    call = (lambda: runner.forward([ForwardItem("a", a, 1)])) if what == "run" else (
        lambda: runner.graph_step(["a"], torch.tensor([a[9:14]])))  # fmt: skip
    with pytest.raises(RuntimeError, match="injected"):
        call()
    assert (runner.cached_length("a"), runner.free_kv_blocks) == (length, free)
    out = call()  # the retry is served as on a runner that never failed
    if what == "run":
        torch.testing.assert_close(out, reference_logits(model, a)[-1:], atol=TOL, rtol=0)
    else:
        torch.testing.assert_close(out[0], reference_logits(model, a[:14])[9:], atol=TOL, rtol=0)


def test_a_failed_call_undoes_an_earlier_items_prefix_hit() -> None:
    model = hf_model("llama3")
    runner = make_runner(model, kv_block_size=4, kv_blocks=32)
    a = seqs(2)[2]
    runner.add_request("x")
    runner.forward([ForwardItem("x", a, 1)])
    runner.release("x")  # its blocks stay cached
    runner.add_request("z")
    _failing_once(runner)
    with pytest.raises(RuntimeError, match="injected"):
        runner.forward([ForwardItem("z", a, 1)])  # a hit of 16 tokens, then the failure
    assert runner.cached_length("z") == 0
    out = runner.forward([ForwardItem("z", a, 1)])
    torch.testing.assert_close(out, reference_logits(model, a)[-1:], atol=TOL, rtol=0)


def test_a_failed_copy_on_write_leaves_the_fork_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    model = hf_model("qwen3")
    runner = make_runner(model, max_slots=3, kv_block_size=4, kv_blocks=40)
    a = seqs(4)[2]
    ref = reference_logits(model, a)
    runner.add_request("a"), runner.add_request("h")
    runner.forward([ForwardItem("a", a[:10], 1)])
    runner.fork([("a", "h", 10)])
    cache = runner._cache

    def boom(copies: object) -> None:
        raise RuntimeError("injected: out of memory in the copy")

    monkeypatch.setattr(cache, "_copy_blocks", boom)
    with pytest.raises(RuntimeError, match="injected"):
        runner.forward([ForwardItem("h", a[10:12], 2)])
    monkeypatch.undo()
    assert runner.cached_length("h") == 10
    out = runner.forward([ForwardItem("h", a[10:12], 2)])
    torch.testing.assert_close(out, ref[10:12], atol=TOL, rtol=0)
    cache.pool.check()  # type: ignore[union-attr]


def test_forks_are_refused_when_a_branch_is_a_source_or_repeats() -> None:
    runner = make_runner(hf_model("qwen3"), max_slots=4, **PAGED)
    for rid in ("a", "b", "c"):
        runner.add_request(rid)
    with pytest.raises(ValueError, match="distinct requests"):
        runner.fork([("a", "b", 0), ("b", "c", 0)])
    with pytest.raises(ValueError, match="distinct requests"):
        runner.fork([("a", "a", 0)])


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_gives_the_slot_runners_logits(seed: int) -> None:
    """Admissions on shared prefixes (prefix hits), verifies, rollbacks, forks, swaps and
    releases, in the same order on a fixed-slot runner and on a paged one whose small pool
    evicts cached blocks and refuses steps: every logit the paged runner returns is the slot
    runner's, and a refused step leaves it able to go on."""
    import random

    rng = random.Random(seed)
    model = hf_model("qwen3")
    slots = make_runner(model, max_slots=6, max_seq_len=48)
    paged = make_runner(model, max_slots=6, max_seq_len=48, kv_block_size=3, kv_blocks=36)
    # equal blocks after different prefixes (and at different positions), which a hit must
    # tell apart: a block A repeated, and A after another block B
    a, b = ([rng.randrange(300) for _ in range(3)] for _ in range(2))
    prefixes = [a + a + a, b + a]
    live: list[str] = []
    refused = 0
    for step in range(80):
        op = rng.random()
        try:
            if op < 0.25 and len(live) < 6:
                rid = f"r{step}"
                prompt = rng.choice(prefixes) + [rng.randrange(300) for _ in range(3)]
                for r in (paged, slots):  # the paged one first: it may refuse
                    r.add_request(rid)
                live.append(rid)
                try:
                    want = [paged.forward([ForwardItem(rid, prompt, 2)])]
                except CacheFullError:
                    slots.release(rid), paged.release(rid), live.remove(rid)
                    raise
                want.append(slots.forward([ForwardItem(rid, prompt, 2)]))
            elif op < 0.35 and live and len(live) < 6:
                rid, child = rng.choice(live), f"f{step}"
                length = rng.randrange(paged.cached_length(rid) + 1)
                for r in (paged, slots):
                    r.add_request(child)
                    r.fork([(rid, child, length)])
                live.append(child)
                continue
            elif op < 0.45 and live:
                rid = live.pop(rng.randrange(len(live)))
                paged.release(rid), slots.release(rid)
                continue
            elif op < 0.55 and live:
                rid = rng.choice(live)
                length = rng.randrange(paged.cached_length(rid) + 1)
                paged.truncate(rid, length), slots.truncate(rid, length)
                continue
            elif op < 0.6 and len(live) > 1:
                a, b = rng.sample(live, 2)
                paged.swap(a, b), slots.swap(a, b)
                continue
            elif live:  # a verify of the live requests with room: 1 to 4 tokens each
                rids = [r for r in live if paged.cached_length(r) + 4 <= 48]
                if not rids:
                    continue
                rows = [[rng.randrange(300) for _ in range(rng.randrange(1, 5))] for _ in rids]
                got = paged.ragged_step(rids, rows)[0]
                ref = slots.ragged_step(rids, rows)[0]
                # each row's real positions (its padding's logits mean nothing)
                want = [torch.cat([got[i, : len(r)] for i, r in enumerate(rows)]),
                        torch.cat([ref[i, : len(r)] for i, r in enumerate(rows)])]  # fmt: skip
            else:
                continue
        except CacheFullError:
            refused += 1
            continue
        torch.testing.assert_close(want[0], want[1], atol=TOL, rtol=0)
        assert [paged.cached_length(r) for r in live] == [slots.cached_length(r) for r in live]
    assert refused > 0 and paged.prefix_cache_stats.hit_tokens > 0  # type: ignore[union-attr]
