"""Per-request KV state: in preallocated fixed slots (`SlotCache`, the default), or in blocks of
a shared pool addressed through a block table per request (`PagedCache`, with prefix caching).

Both give the runner the same calls: `prepare` before a forward (what the attention reads and
writes through: slot ids [B], or block tables [B, W]), `commit` after it (the new length).

SlotCache: each admitted request owns one slot of `max_seq_len` tokens in every layer's cache
tensor [max_slots + 1, 2, kv_heads, max_seq_len, head_dim]; the extra last slot is scratch that
the padding rows of a CUDA-graph batch write into. Admission is a single check (a whole slot or
a CacheFullError) and nothing is ever evicted; the price is memory reserved for the longest
request, which PagedCache avoids.

Lengths live on the host: rollback (`truncate`) only lowers a request's length, since stale
K/V past it is masked out and overwritten by the next forward. Releasing a slot likewise only
returns it to the free list.
"""

from collections.abc import Sequence

import torch

from specdec.errors import CacheFullError, UnknownRequestError
from specdec.runner.blocks import BlockPool, CacheStats


class _Checks:
    """The checks both caches make the same way, from each request's length."""

    max_seq_len: int

    def length(self, request_id: str) -> int:
        raise NotImplementedError

    def check_room(self, request_id: str, new_tokens: int) -> None:
        have = self.length(request_id)
        if have + new_tokens > self.max_seq_len:
            raise CacheFullError(
                f"Request {request_id!r} holds {have} tokens and {new_tokens} more would exceed "
                f"max_seq_len={self.max_seq_len}."
            )

    def _check_length(self, what: str, request_id: str, length: int) -> None:
        """ValueError unless 0 <= length <= the request's length (a truncate's or fork's)."""
        have = self.length(request_id)
        if not 0 <= length <= have:
            raise ValueError(
                f"{what} length must be in [0, {have}] (the cached length of {request_id!r}), "
                f"got {length}."
            )


class SlotCache(_Checks):
    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        max_seq_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.scratch_slot = max_slots
        shape = (max_slots + 1, 2, kv_heads, max_seq_len, head_dim)
        # zeros, not empty: masked keys still meet a 0 weight, and 0 * NaN garbage would be NaN;
        # one tensor, each layer's cache a view of it, so that a fork is one copy for all layers
        self._all = torch.zeros((num_layers, *shape), dtype=dtype, device=device)
        self.layers = list(self._all.unbind(0))
        self._slot: dict[str, int] = {}
        self._length = [0] * max_slots
        self._free = list(range(max_slots - 1, -1, -1))

    @staticmethod
    def bytes_needed(
        num_layers: int,
        max_slots: int,
        max_seq_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        per_slot = 2 * kv_heads * max_seq_len * head_dim * dtype.itemsize
        return num_layers * (max_slots + 1) * per_slot

    def add(self, request_id: str) -> int:
        if request_id in self._slot:
            raise ValueError(f"request_id {request_id!r} is already in the cache.")
        if not self._free:
            raise CacheFullError(
                f"All {self.max_slots} KV slots are in use; release a request before adding "
                f"{request_id!r}."
            )
        slot = self._free.pop()
        self._slot[request_id] = slot
        self._length[slot] = 0
        return slot

    def release(self, request_id: str) -> None:
        slot = self.slot(request_id)
        del self._slot[request_id]
        self._length[slot] = 0
        self._free.append(slot)

    def slot(self, request_id: str) -> int:
        try:
            return self._slot[request_id]
        except KeyError:
            raise UnknownRequestError(f"request_id {request_id!r} is not in the cache.") from None

    def length(self, request_id: str) -> int:
        return self._length[self.slot(request_id)]

    def truncate(self, request_id: str, length: int) -> None:
        self._check_length("truncate", request_id, length)
        self._length[self.slot(request_id)] = length

    def fork(self, branches: list[tuple[str, str, int]]) -> None:
        """Each (source, branch, length): `branch` (already added) holds `source`'s first
        `length` positions, so that a draft-ahead hypothesis continues the request's sequence in
        a slot of its own. One upload and one copy for all of them in every layer: the pass
        ahead forks on the draft's critical path, where a copy per layer (two launches each)
        cost about a millisecond of host time a pass on an H200 host, served."""
        if not branches:
            return
        for source, _, length in branches:
            self._check_length("fork", source, length)
        slots = [[self.slot(s) for s, _, _ in branches], [self.slot(b) for _, b, _ in branches]]
        src, dst = torch.tensor(slots).to(self._all.device, non_blocking=True)
        # [layers, slots, 2, kv_heads, positions, head_dim]: past a branch's own length its
        # positions are never read
        held = self._all.narrow(4, 0, max(length for _, _, length in branches))
        held.index_copy_(1, dst, held.index_select(1, src))
        for _, branch, length in branches:
            self._length[self.slot(branch)] = length

    def swap(self, a: str, b: str) -> None:
        """`a` and `b` exchange slots (a hypothesis that came true becomes the request)."""
        slot_a, slot_b = self.slot(a), self.slot(b)
        self._slot[a], self._slot[b] = slot_b, slot_a

    def extend(self, request_id: str, new_tokens: int) -> None:
        self._length[self.slot(request_id)] += new_tokens

    page: int | None = None  # positions per block: none, a slot holds a whole sequence

    def check_fits(
        self, request_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int]
    ) -> None:
        """Nothing to check past `check_room`: a slot holds max_seq_len positions."""

    def prepare(
        self,
        request_ids: Sequence[str],
        starts: Sequence[int],
        counts: Sequence[int],
        cover: int = 0,
    ) -> list[int]:
        """The slots [B] the forward reads and writes through (a slot covers every position)."""
        return [self.slot(r) for r in request_ids]

    def commit(self, request_id: str, start: int, n: int, tokens: Sequence[int] | None) -> None:
        """After a forward of n tokens at `start` (the request's length)."""
        self._length[self.slot(request_id)] = start + n

    def match_prefix(self, request_id: str, tokens: Sequence[int], limit: int) -> int:
        return 0

    @property
    def prefix_stats(self) -> CacheStats | None:
        return None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def request_ids(self) -> list[str]:
        return list(self._slot)


class PagedCache(_Checks):
    """KV in `num_blocks` blocks of `block_size` positions (`blocks.BlockPool` decides which
    request's positions each holds), in every layer's tensor [num_blocks + 1, 2, kv_heads,
    block_size, head_dim]: the layout of SlotCache with a block for a slot, so the same writes
    (at block, offset) and reads serve both. The extra last block is scratch: padding rows of
    a CUDA-graph batch and table entries past a request's blocks point at it.

    At most `max_requests` requests at once, each of up to `max_seq_len` positions; admission
    takes no memory, a forward takes the blocks its positions need (CacheFullError, with
    nothing changed, when the pool cannot give them). Forks share blocks and copy only a
    partly written block they write into; rollback frees whole blocks; full blocks stay cached
    under their token prefix after their requests end, and a new request's prompt reuses them
    (`match_prefix`).
    """

    def __init__(
        self,
        num_layers: int,
        max_requests: int,
        max_seq_len: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_caching: bool = True,
    ) -> None:
        self.max_slots = max_requests
        self.max_seq_len = max_seq_len
        self.page = block_size
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.scratch_slot = num_blocks
        self.table_width = -(-max_seq_len // block_size)  # blocks of the longest request
        shape = (num_blocks + 1, 2, kv_heads, block_size, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_needed(
        num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> int:  # fmt: skip
        return num_layers * (num_blocks + 1) * 2 * kv_heads * block_size * head_dim * dtype.itemsize

    def add(self, request_id: str) -> None:
        if request_id in self.pool:
            raise ValueError(f"request_id {request_id!r} is already in the cache.")
        if len(self.pool.request_ids) >= self.max_slots:
            raise CacheFullError(
                f"All {self.max_slots} request places of the KV cache are in use; release a "
                f"request before adding {request_id!r}."
            )
        self.pool.add(request_id)

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    def length(self, request_id: str) -> int:
        return self.pool.length(request_id)

    def truncate(self, request_id: str, length: int) -> None:
        self._check_length("truncate", request_id, length)
        self.pool.truncate(request_id, length)

    def fork(self, branches: list[tuple[str, str, int]]) -> None:
        """Each (source, branch, length): `branch` (added; what it held is dropped) shares
        `source`'s blocks up to `length` positions; no copy now."""
        if len({b for _, b, _ in branches}) != len(branches) or any(
            b == src or b in {s for s, _, _ in branches} for src, b, _ in branches
        ):
            raise ValueError("fork branches must be distinct requests, none of them a source.")
        for source, branch, length in branches:
            self._check_length("fork", source, length)
            self.pool.length(branch)  # UnknownRequestError for a branch not added
        for source, branch, length in branches:
            self.pool.release(branch)
            self.pool.fork(source, branch)
            self.pool.truncate(branch, length)

    def swap(self, a: str, b: str) -> None:
        self.pool.swap(a, b)

    def check_fits(
        self, request_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int]
    ) -> None:
        """CacheFullError unless the pool can give every request its write at once."""
        needed = sum(
            self.pool.needed(r, s, n) for r, s, n in zip(request_ids, starts, counts, strict=True)
        )
        if needed > self.pool.available:
            raise CacheFullError(
                f"This step needs {needed} more KV blocks of {self.page} tokens and "
                f"{self.pool.available} of {self.pool.num_blocks} are free; the requests "
                f"{', '.join(map(repr, request_ids))} stay as they were."
            )

    def prepare(
        self,
        request_ids: Sequence[str],
        starts: Sequence[int],
        counts: Sequence[int],
        cover: int = 0,
    ) -> list[list[int]]:
        """Block tables [B, W] with positions [start, start + count) of each request
        writable, copies made; W is the blocks of the longest request after the write, or of
        the first `cover` positions where more (those a step's padding reaches, or a graph's
        max_seq_len); entries past a request's blocks are the scratch block. `check_fits`
        first."""
        made: list[tuple[str, list[tuple[int, int]]]] = []
        for r, start, n in zip(request_ids, starts, counts, strict=True):
            made.append((r, self.pool.prepare_write(r, start, n)))
        copies = [c for _, cs in made for c in cs]
        if copies:
            try:
                self._copy_blocks(copies)
            except BaseException:  # the tables back on the blocks that hold the positions
                for r, cs in made:
                    self.pool.revert_copies(r, cs)
                raise
        tables = [self.pool.table(r) for r in request_ids]
        width = max(self.pool.blocks_for(cover), *(len(t) for t in tables), 1)
        return [t + [self.scratch_slot] * (width - len(t)) for t in tables]

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Each (source, destination) block's K/V copied, in every layer."""
        device = self.layers[0].device
        pairs = torch.tensor(copies, pin_memory=device.type == "cuda")
        pairs = pairs.to(device, non_blocking=True)  # no wait for the stream
        src, dst = pairs[:, 0], pairs[:, 1]
        for layer in self.layers:
            layer.index_copy_(0, dst, layer.index_select(0, src))

    def commit(self, request_id: str, start: int, n: int, tokens: Sequence[int] | None) -> None:
        """After a forward of n tokens at `start` (their ids, where known on the host)."""
        self.pool.commit(request_id, start, [None] * n if tokens is None else tokens)

    def match_prefix(self, request_id: str, tokens: Sequence[int], limit: int) -> int:
        return self.pool.match_prefix(request_id, tokens, limit)

    @property
    def prefix_stats(self) -> CacheStats:
        return self.pool.stats

    @property
    def num_free(self) -> int:
        return self.max_slots - len(self.pool.request_ids)

    @property
    def request_ids(self) -> list[str]:
        return self.pool.request_ids
