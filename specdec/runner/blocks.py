"""Paged KV bookkeeping on the host: fixed-size blocks, a block table per request, blocks shared
by reference count, full blocks cached by their token prefix and evicted least recently used.

This module decides which device block holds which request's positions; the device memory it
indexes (a [num_blocks, 2, kv_heads, block_size, head_dim] tensor per layer) and the copies it
asks for are the runner's. Its contract with the runner, per forward of a request:

1. `prepare_write(request, start, n)` before the forward: the request's table then covers
   positions [start, start + n) with blocks it alone holds; the returned (source, destination)
   block copies must be made on the device before the forward writes (copy on write, for a
   block a fork or the prefix cache shares). Nothing changes when it raises CacheFullError.
2. `commit(request, start, tokens)` after the forward wrote those positions' keys and values:
   the request's tokens and length, and full blocks registered in the prefix cache.

A full block is keyed by its tokens and the key of the block before it (a chain from the first
block), compared in full, never by a digest: two keys are equal only for the same token
prefix, so a cached block holds exactly the keys and values a forward of that prefix writes,
and a hit cannot change what the model computes. A block is registered once its positions were
written and stays registered while it is unchanged; a request that writes into a block it
registered (after a rollback) first takes it out of the cache, or copies it where another
holder shares it.

Released and rolled-back blocks that are registered stay cached at reference count 0, in
least-recently-used order, and are reused last: a new block comes from the blocks never
registered first, then evicts the least recently used cached one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.errors import CacheFullError, UnknownRequestError

Key = tuple[int, tuple[int, ...]]  # (the previous block's serial, or -1; this block's tokens)


@dataclass(slots=True)
class _Table:
    blocks: list[int] = field(default_factory=list)
    # committed: len(tokens) is the length; None for a token whose id the runner did not
    # read back (sampled on the device), which keeps its block out of the prefix cache
    tokens: list[int | None] = field(default_factory=list)
    # the prefix cache's serial of each full block's content, in order (a chain key's first
    # part): the serial of whichever block is cached under the same key
    serials: list[int] = field(default_factory=list)
    pending: tuple[int, int] | None = None  # the prepared write's [start, end) until commit
    # the prefix cache was asked once since the request last held nothing: a prompt whose
    # start was matched (`ModelRunner.take_prefix`) and then found nothing is not asked again
    # by its first chunk's forward (nor counted twice)
    matched: bool = False


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Prefix-cache counts since the pool was made, in tokens (vLLM's prefix_cache_queries
    and prefix_cache_hits), and the evictions of cached blocks."""

    queried_tokens: int
    hit_tokens: int
    evicted_blocks: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be at least 1 (got {num_blocks}, {block_size})."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never registered, or taken out
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, ref 0, LRU first
        self._key: dict[int, Key] = {}  # block -> its key, while registered
        self._serial: dict[int, int] = {}  # block -> its serial, while registered
        self._by_key: dict[Key, int] = {}
        self._serials = itertools.count()
        self._tables: dict[str, _Table] = {}
        self._queried = self._hits = self._evicted = 0

    # -- sizes -------------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def available(self) -> int:
        """Blocks a request can still get: free ones and cached ones no request holds."""
        return len(self._free) + len(self._cached)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queried, self._hits, self._evicted)

    # -- requests ----------------------------------------------------------------------------

    def add(self, request_id: str) -> None:
        if request_id in self._tables:
            raise ValueError(f"request_id {request_id!r} is already in the cache.")
        self._tables[request_id] = _Table()

    def release(self, request_id: str) -> None:
        table = self._table(request_id)
        for b in reversed(table.blocks):  # the tail first: evicted before the prefix it extends
            self._unref(b)
        del self._tables[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def length(self, request_id: str) -> int:
        return len(self._table(request_id).tokens)

    def table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (a copy)."""
        return list(self._table(request_id).blocks)

    def tokens(self, request_id: str) -> list[int | None]:
        return list(self._table(request_id).tokens)

    def _table(self, request_id: str) -> _Table:
        try:
            return self._tables[request_id]
        except KeyError:
            raise UnknownRequestError(f"request_id {request_id!r} is not in the cache.") from None

    # -- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, request_id: str, tokens: Sequence[int], limit: int | None = None) -> int:
        """For a request that holds nothing yet: shares the cached full blocks that begin
        `tokens` and returns how many tokens they hold (a multiple of block_size, at most
        `limit`, by default len(tokens) - 1, so that a forward of the rest still gives the
        next-token logits)."""
        table = self._table(request_id)
        if table.blocks or table.tokens:
            raise ValueError(f"request_id {request_id!r} already holds tokens.")
        if table.matched:
            return 0
        table.matched = True
        self._queried += len(tokens)
        if not self.prefix_caching:
            return 0
        limit = len(tokens) - 1 if limit is None else min(limit, len(tokens))
        usable = max(0, limit) // self.block_size
        parent = -1
        for i in range(usable):
            chunk = tuple(int(t) for t in tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self._by_key.get((parent, chunk))
            if block is None:
                break
            self._ref(block)
            table.blocks.append(block)
            table.tokens.extend(chunk)
            parent = self._serial[block]
            table.serials.append(parent)
        self._hits += len(table.tokens)
        return len(table.tokens)

    def _register(self, table: _Table, index: int) -> bool:
        """Full block `index` (every one before it done) into the cache, or its serial taken
        from the block cached under the same key; False for a block with a token not known
        (it and every block after it stay out)."""
        assert len(table.serials) == index
        block = table.blocks[index]
        start = index * self.block_size
        parent = table.serials[index - 1] if index else -1
        chunk = table.tokens[start : start + self.block_size]
        if any(t is None for t in chunk):
            return False
        key = (parent, tuple(t for t in chunk if t is not None))
        cached = self._by_key.get(key)
        if cached is None:
            assert block not in self._key, "a registered block was written into"
            cached = block
            self._key[block] = key
            self._serial[block] = next(self._serials)
            self._by_key[key] = block
        table.serials.append(self._serial[cached])
        return True

    def _unregister(self, block: int) -> None:
        key = self._key.pop(block)
        del self._by_key[key]
        del self._serial[block]
        self._cached.pop(block, None)

    # -- blocks ------------------------------------------------------------------------------

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block)  # a cached block with no holder, taken again
        self._refs[block] += 1

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key:
                self._cached[block] = None  # most recently used last
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)  # least recently used
            self._unregister(block)
            self._evicted += 1
        self._refs[block] = 1
        return block

    def needed(self, request_id: str, start: int, n: int) -> int:
        """Blocks `prepare_write(request_id, start, n)` would take from `available`."""
        return self._needed(self._table(request_id), start, n)

    def _needed(self, table: _Table, start: int, n: int) -> int:
        """Blocks `prepare_write` would take: new ones past the table's end, and a copy (or
        nothing, for a block only this request holds) for each held block written into."""
        if n <= 0:
            return 0
        first, end = start // self.block_size, self.blocks_for(start + n)
        copies = sum(1 for b in table.blocks[first:end] if self._refs[b] > 1)
        return copies + max(0, end - len(table.blocks))

    def prepare_write(self, request_id: str, start: int, n: int) -> list[tuple[int, int]]:
        """Makes positions [start, start + n) of the request writable (see the module's
        contract); returns the (source, destination) block copies to make first. `start` is
        at most the request's length (positions past it are rewritten, as after a rollback)."""
        table = self._table(request_id)
        if not 0 <= start <= len(table.tokens) or n < 0:
            raise ValueError(
                f"A write of {n} tokens at {start} for {request_id!r}, whose length is "
                f"{len(table.tokens)}: writes start at most at the length."
            )
        if n == 0:
            return []
        needed = self._needed(table, start, n)
        if needed > self.available:
            raise CacheFullError(
                f"{request_id!r} needs {needed} more KV blocks of {self.block_size} tokens "
                f"and {self.available} of {self.num_blocks} are free; release or shorten a "
                f"request first."
            )
        copies = []
        first, end = start // self.block_size, self.blocks_for(start + n)
        for i in range(first, min(end, len(table.blocks))):
            block = table.blocks[i]
            if self._refs[block] > 1:  # shared: this request writes into a copy of its own
                fresh = self._take()
                self._unref(block)
                table.blocks[i] = fresh
                # positions it holds stay readable until the commit (a forward not made, a
                # failed one): copied, unless none is below the length
                if i * self.block_size < len(table.tokens):
                    copies.append((block, fresh))
            elif block in self._key:  # only ours, but cached under what it holds now
                self._unregister(block)
        while len(table.blocks) < end:
            table.blocks.append(self._take())
        table.pending = (start, start + n)
        return copies

    def revert_copies(self, request_id: str, copies: Sequence[tuple[int, int]]) -> None:
        """Undoes `prepare_write`'s copies on write whose device copies were not made (they
        failed): the request holds the shared source blocks again, and its write is dropped."""
        table = self._table(request_id)
        for src, dst in copies:
            i = table.blocks.index(dst)
            self._ref(src)
            table.blocks[i] = src
            self._unref(dst)
        self.truncate(request_id, len(table.tokens))

    def commit(self, request_id: str, start: int, tokens: Sequence[int | None]) -> None:
        """After a forward wrote positions [start, start + len(tokens)) (`prepare_write`
        first): the request's length is start + len(tokens), and its full blocks are
        registered in the prefix cache (None: a token whose id is not known here)."""
        table = self._table(request_id)
        end = start + len(tokens)
        if tokens and (
            table.pending is None or table.pending[0] != start or end > table.pending[1]
        ):
            raise ValueError(
                f"A commit of positions [{start}, {end}) of {request_id!r} that were not "
                f"prepared for writing (prepared: {table.pending})."
            )
        if not tokens and start != len(table.tokens):
            raise ValueError(f"An empty commit at {start}, not at {request_id!r}'s length.")
        table.pending = None
        del table.tokens[start:]
        table.tokens.extend(None if t is None else int(t) for t in tokens)
        del table.serials[start // self.block_size :]
        self._drop_past(table, end)
        if self.prefix_caching:
            for i in range(len(table.serials), end // self.block_size):
                if not self._register(table, i):
                    break

    def truncate(self, request_id: str, length: int) -> None:
        """Rolls the request back to its first `length` tokens; whole blocks past them are
        released (a partly kept block stays, and is copied or taken out of the cache when
        next written)."""
        table = self._table(request_id)
        if not 0 <= length <= len(table.tokens):
            raise ValueError(
                f"Cannot truncate {request_id!r} to {length}: its length is {len(table.tokens)}."
            )
        del table.tokens[length:]
        del table.serials[length // self.block_size :]
        table.pending = None
        table.matched = table.matched and length > 0
        self._drop_past(table, length)

    def _drop_past(self, table: _Table, length: int) -> None:
        keep = self.blocks_for(length)
        for b in reversed(table.blocks[keep:]):
            self._unref(b)
        del table.blocks[keep:]

    def swap(self, a: str, b: str) -> None:
        """Requests `a` and `b` exchange what they hold."""
        ta, tb = self._table(a), self._table(b)
        self._tables[a], self._tables[b] = tb, ta

    def fork(self, parent_id: str, child_id: str) -> None:
        """A new request `child_id` holding the parent's blocks and tokens, shared: the first
        write into a shared block copies that block alone."""
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"request_id {child_id!r} is already in the cache.")
        for b in parent.blocks:
            self._ref(b)
        self._tables[child_id] = _Table(
            list(parent.blocks), list(parent.tokens), list(parent.serials)
        )

    def check(self) -> None:
        """AssertionError unless the bookkeeping is consistent (tests and debugging)."""
        refs = [0] * self.num_blocks
        for t in self._tables.values():
            assert len(t.blocks) >= self.blocks_for(len(t.tokens))
            assert len(t.serials) <= len(t.tokens) // self.block_size
            if not self.prefix_caching:
                assert not t.serials
            for b in t.blocks:
                refs[b] += 1
        assert refs == self._refs, (refs, self._refs)
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        held = {b for b in range(self.num_blocks) if refs[b]}
        assert not held & (free | cached)
        assert held | free | cached == set(range(self.num_blocks))
        assert all(b in self._key for b in cached) and not free & set(self._key)
        assert {v: k for k, v in self._by_key.items()} == self._key
