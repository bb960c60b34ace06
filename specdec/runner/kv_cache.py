"""Per-request KV state in preallocated fixed slots.

Each admitted request owns one slot of `max_seq_len` tokens in every layer's cache tensor
[max_slots + 1, 2, kv_heads, max_seq_len, head_dim]; the extra last slot is scratch that the
padding rows of a CUDA-graph batch write into. Fixed slots rather than pages: the services cap
each request at `max_seq_len` anyway, a slot needs no block table (so attention is a plain
index_select + SDPA that a CUDA graph captures with static shapes), and admission is a single
check — a request either gets a whole slot or a CacheFullError, and nothing is ever evicted.
The price is memory reserved for the longest request; paging would be the next step if
requests of very different lengths must share a small cache.

Lengths live on the host: rollback (`truncate`) only lowers a request's length, since stale
K/V past it is masked out and overwritten by the next forward. Releasing a slot likewise only
returns it to the free list.
"""

import torch

from specdec.errors import CacheFullError, UnknownRequestError


class SlotCache:
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
        # zeros, not empty: masked keys still meet a 0 weight, and 0 * NaN garbage would be NaN
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
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
        slot = self.slot(request_id)
        if not 0 <= length <= self._length[slot]:
            raise ValueError(
                f"truncate length must be in [0, {self._length[slot]}] (the cached length of "
                f"{request_id!r}), got {length}."
            )
        self._length[slot] = length

    def fork(self, branches: list[tuple[str, str, int]]) -> None:
        """Each (source, branch, length): `branch` (already added) holds `source`'s first
        `length` positions, so that a draft-ahead hypothesis continues the request's sequence in
        a slot of its own. One copy per layer for all of them."""
        if not branches:
            return
        for source, _, length in branches:
            have = self.length(source)
            if not 0 <= length <= have:
                raise ValueError(
                    f"fork length must be in [0, {have}] (the cached length of {source!r}), "
                    f"got {length}."
                )
        device = self.layers[0].device
        src = torch.tensor([self.slot(s) for s, _, _ in branches], device=device)
        dst = torch.tensor([self.slot(b) for _, b, _ in branches], device=device)
        longest = max(length for _, _, length in branches)
        for layer in self.layers:  # past a branch's own length its rows are never read
            layer[dst, :, :, :longest] = layer[src, :, :, :longest]
        for _, branch, length in branches:
            self._length[self.slot(branch)] = length

    def swap(self, a: str, b: str) -> None:
        """`a` and `b` exchange slots (a hypothesis that came true becomes the request)."""
        slot_a, slot_b = self.slot(a), self.slot(b)
        self._slot[a], self._slot[b] = slot_b, slot_a

    def check_room(self, request_id: str, new_tokens: int) -> None:
        have = self.length(request_id)
        if have + new_tokens > self.max_seq_len:
            raise CacheFullError(
                f"Request {request_id!r} holds {have} tokens and {new_tokens} more would exceed "
                f"max_seq_len={self.max_seq_len}."
            )

    def extend(self, request_id: str, new_tokens: int) -> None:
        self._length[self.slot(request_id)] += new_tokens

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def request_ids(self) -> list[str]:
        return list(self._slot)
