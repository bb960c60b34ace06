"""The paged KV bookkeeping (`specdec.runner.blocks.BlockPool`) against a simulated device: each
block's positions hold what a forward writes there, the whole token prefix up to that position
(a key or value depends on every token before it). Every request must read back, position by
position, what a forward of its own tokens would have written: after prefix hits, forks, copies
on write, rollbacks, evictions, and a refused write."""

from __future__ import annotations

import random

import pytest

from specdec.errors import CacheFullError, UnknownRequestError
from specdec.runner.blocks import BlockPool

Content = tuple[int, ...]


class Device:
    """Block memory as the runner would drive it: copies first, then the forward's writes."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.mem: list[list[Content | None]] = [
            [None] * pool.block_size for _ in range(pool.num_blocks)
        ]
        self.copies = 0
        self.real: dict[str, list[int]] = {}  # each request's token ids, known or not to the pool

    def forward(self, rid: str, start: int, new: list[int], known: bool = True) -> None:
        """What a runner's forward of `new` at `start` does to the cache; `known=False`: the
        runner commits the tokens without their ids (sampled on the device)."""
        pool, bs = self.pool, self.pool.block_size
        for src, dst in pool.prepare_write(rid, start, len(new)):
            self.mem[dst] = list(self.mem[src])
            self.copies += 1
        tokens = self.real.get(rid, [])[:start] + new
        table = pool.table(rid)
        for p in range(start, start + len(new)):
            self.mem[table[p // bs]][p % bs] = tuple(tokens[: p + 1])
        pool.commit(rid, start, new if known else [None] * len(new))
        self.real[rid] = tokens

    def truncate(self, rid: str, length: int) -> None:
        self.pool.truncate(rid, length)
        self.real[rid] = self.real.get(rid, [])[:length]

    def fork(self, rid: str, child: str) -> None:
        self.pool.fork(rid, child)
        self.real[child] = list(self.real.get(rid, []))

    def swap(self, a: str, b: str) -> None:
        self.pool.swap(a, b)
        self.real[a], self.real[b] = self.real.get(b, []), self.real.get(a, [])

    def prefill(self, rid: str, prompt: list[int]) -> int:
        """Admission with the prefix cache: the hit, then a forward of the rest."""
        self.pool.add(rid)
        hit = self.pool.match_prefix(rid, prompt)
        self.real[rid] = prompt[:hit]
        self.forward(rid, hit, prompt[hit:])
        return hit

    def check(self, rid: str) -> None:
        pool, bs = self.pool, self.pool.block_size
        tokens, table = self.real.get(rid, []), pool.table(rid)
        assert len(tokens) == pool.length(rid)
        assert all(k is None or k == t for k, t in zip(pool.tokens(rid), tokens, strict=True))
        for p in range(len(tokens)):
            assert self.mem[table[p // bs]][p % bs] == tuple(tokens[: p + 1]), (rid, p)


def test_a_prefix_hit_shares_full_blocks_and_reads_what_a_miss_computes() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    dev = Device(pool)
    system = list(range(100, 110))  # 10 tokens: two full blocks and two more
    assert dev.prefill("a", [*system, 1, 2, 3]) == 0
    assert dev.prefill("b", [*system, 7, 8]) == 8  # the two full blocks, not the partial one
    assert pool.table("a")[:2] == pool.table("b")[:2]
    assert pool.table("a")[2] != pool.table("b")[2]
    dev.check("a"), dev.check("b")
    assert pool.stats.hit_tokens == 8 and pool.stats.queried_tokens == 25
    pool.check()


def test_a_hit_leaves_the_last_prompt_token_to_compute() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    dev = Device(pool)
    dev.prefill("a", list(range(8)))
    pool.release("a")
    # the same 8 tokens again: one block only, so the forward still has a token to score
    assert dev.prefill("b", list(range(8))) == 4
    dev.check("b")
    pool.check()


def test_released_blocks_stay_cached_until_evicted_least_recently_used_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] [5]
    dev.prefill("b", [7, 8, 9])  # [7 8] [9]; one block never used
    pool.release("a")  # [1 2] [3 4] cached, [5] free
    pool.release("b")  # [7 8] cached (released after a's), [9] free
    assert pool.available == 6
    dev.prefill("c", list(range(20, 29)))  # 5 blocks: the 3 free, then 2 evicted
    assert pool.stats.evicted_blocks == 2
    pool.release("c")
    # a's blocks went first (least recently used); b's prefix is still cached
    pool.add("d")
    assert pool.match_prefix("d", [1, 2, 3, 4, 5]) == 0
    pool.add("e")
    assert pool.match_prefix("e", [7, 8, 9]) == 2
    pool.check()


def test_a_cached_block_taken_again_is_not_evicted() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3])
    pool.release("a")
    assert dev.prefill("b", [1, 2, 5]) == 2  # holds the cached [1 2] again
    with pytest.raises(CacheFullError):
        dev.forward("b", 3, [6, 7, 8, 9])  # needs 2 more; only 1 is free
    dev.check("b")
    pool.check()


def test_rollback_frees_whole_blocks_and_a_rewrite_takes_the_block_out_of_the_cache() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    dev = Device(pool)
    dev.prefill("a", list(range(10)))  # 3 blocks
    before = pool.available
    dev.truncate("a", 5)  # [0..3] [4] kept; the third block freed
    assert pool.length("a") == 5 and len(pool.table("a")) == 2
    assert pool.available == before + 1
    dev.forward("a", 5, [50, 51, 52])  # rewrites the second block past position 4
    dev.check("a")
    pool.add("b")
    assert pool.match_prefix("b", list(range(10))) == 4  # the old [4..7] is no longer cached
    pool.check()


def test_forks_share_blocks_and_copy_only_the_partial_block_they_write() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    dev = Device(pool)
    dev.prefill("req", list(range(10)))  # [0..3] [4..7] [8 9]
    held = pool.available
    for h in range(3):  # draft-ahead's hypotheses
        dev.fork("req", f"h{h}")
    assert pool.available == held  # forking takes no block
    for h in range(3):
        dev.forward(f"h{h}", 10, [100 + h, 200 + h, 300 + h])  # fills [8 9 x y], then one more
    assert dev.copies == 3  # each hypothesis copied the shared partial block, nothing else
    for rid in ("req", "h0", "h1", "h2"):
        dev.check(rid)
        assert pool.table(rid)[:2] == pool.table("req")[:2]
    for h in range(3):
        pool.release(f"h{h}")
    assert pool.available >= held
    pool.check()


def test_a_refused_write_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3])
    dev.fork("a", "b")
    state = (pool.table("a"), pool.table("b"), pool.tokens("b"), pool.available)
    with pytest.raises(CacheFullError, match="needs 4 more KV blocks"):
        pool.prepare_write("b", 3, 6)  # a copy of [3] and three new: 4 > 2
    assert state == (pool.table("a"), pool.table("b"), pool.tokens("b"), pool.available)
    pool.check()


def test_bad_calls_are_refused_with_clear_errors() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    with pytest.raises(UnknownRequestError):
        pool.prepare_write("x", 0, 1)
    pool.add("a")
    with pytest.raises(ValueError, match="already in the cache"):
        pool.add("a")
    with pytest.raises(ValueError, match="writes start at most at the length"):
        pool.prepare_write("a", 1, 1)
    with pytest.raises(ValueError, match="Cannot truncate"):
        pool.truncate("a", 1)
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0, 16)


def test_without_prefix_caching_nothing_is_shared_between_requests() -> None:
    pool = BlockPool(num_blocks=8, block_size=2, prefix_caching=False)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3, 4, 5])
    assert dev.prefill("b", [1, 2, 3, 4, 5]) == 0
    assert not set(pool.table("a")) & set(pool.table("b"))
    pool.release("a"), pool.release("b")
    assert pool.available == 8
    pool.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_reads_back_what_was_computed(seed: int) -> None:
    """Admissions with shared prefixes, decode, speculative writes rolled back, forks,
    releases, under memory pressure: every request reads its own prefix's values and the
    bookkeeping stays consistent; a refused write leaves the request readable."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=24, block_size=rng.choice([1, 2, 4]))
    dev = Device(pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    live: list[str] = []
    refused = 0
    for step in range(400):
        op = rng.random()
        try:
            if op < 0.2 or not live:
                rid = f"r{step}"
                prompt = rng.choice(prefixes) + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 6))
                ]
                try:
                    dev.prefill(rid, prompt)
                finally:
                    live.append(rid)  # admitted, possibly short of its prompt
            elif op < 0.27:
                rid = rng.choice(live)
                child = f"f{step}"
                dev.fork(rid, child)
                live.append(child)
            elif op < 0.3:
                dev.swap(rng.choice(live), rng.choice(live))
            elif op < 0.45:
                rid = live.pop(rng.randrange(len(live)))
                pool.release(rid)
            elif op < 0.6:
                rid = rng.choice(live)
                dev.truncate(rid, rng.randrange(pool.length(rid) + 1))
            else:  # a verify: k + 1 tokens written from the length or a little before it
                rid = rng.choice(live)
                start = max(0, pool.length(rid) - rng.randrange(3))
                new = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
                dev.forward(rid, start, new, known=rng.random() < 0.8)
        except CacheFullError:
            refused += 1
        for rid in live:
            dev.check(rid)
        pool.check()
    assert refused > 0  # the pool was under pressure
    assert pool.stats.hit_tokens > 0


def test_blocks_of_tokens_not_read_back_stay_out_of_the_prefix_cache() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3])  # [1 2] cached, [3] partial
    dev.forward("a", 3, [4, 5, 6], known=False)  # sampled on the device: [3 ?] [? ?]
    dev.check("a")
    pool.add("b")
    assert pool.match_prefix("b", [1, 2, 3, 4, 5, 6, 7]) == 2  # [1 2] only
    dev.truncate("a", 3)
    dev.forward("a", 3, [4, 5, 6])  # the same ids, now known: cached from [3 4] on
    pool.add("c")
    assert pool.match_prefix("c", [1, 2, 3, 4, 5, 6, 7]) == 6
    pool.check()


def test_a_forward_not_made_after_its_prepare_leaves_the_request_readable() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3, 4, 5])
    dev.fork("a", "b")
    for src, dst in pool.prepare_write("b", 2, 1):  # the copies made, the forward never run
        dev.mem[dst] = list(dev.mem[src])
    dev.check("b"), dev.check("a")
    pool.check()


def test_released_blocks_are_evicted_tail_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    dev = Device(pool)
    dev.prefill("a", [1, 2, 3, 4, 5])
    pool.release("a")
    dev.prefill("b", [9, 9, 9])  # one eviction: [3 4], which extends [1 2], goes first
    pool.add("c")
    assert pool.match_prefix("c", [1, 2, 3, 4, 5]) == 2


def test_a_commit_must_match_the_prepared_write() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    pool.add("a")
    with pytest.raises(ValueError, match="not prepared"):
        pool.commit("a", 0, [1, 2])
    pool.prepare_write("a", 0, 2)
    with pytest.raises(ValueError, match="not prepared"):
        pool.commit("a", 0, [1, 2, 3])  # more than was written
    pool.commit("a", 0, [1])  # fewer (a verify's accepted part) is fine
    assert pool.length("a") == 1
    pool.check()
