"""ModelRunner: a causal LM with per-request KV state that both services drive.

`forward` runs one ragged pass over any mix of prefill chunks, decodes and verifies (k_i + 1
tokens, k_i may be 0) and returns float32 logits only for the positions asked for.
`graph_step` is the equal-length fast path (decode, verify, draft) that replays a CUDA graph.
KV state lives in fixed slots (see `kv_cache`). Llama, Mistral, Qwen2 and Qwen3 run on the
plain-torch `model.Transformer`; any other causal LM on transformers' own model (`fallback`).
"""

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from specdec.errors import InvalidInputError
from specdec.runner.attention import build_meta
from specdec.runner.blocks import CacheStats
from specdec.runner.config import CheckpointInfo, ForwardItem, RunnerConfig
from specdec.runner.decode_attention import MAX_ROWS
from specdec.runner.fallback import HFBackend
from specdec.runner.graphs import Head, StepGraphs
from specdec.runner.kv_cache import PagedCache, SlotCache
from specdec.runner.loader import Checkpoint, open_checkpoint, tensor_reader, tokenizer_hash
from specdec.runner.model import (
    ONE_RANK,
    ModelArgs,
    Shard,
    Transformer,
    rope_tables,
    slicing_getter,
)

log = logging.getLogger(__name__)
Cache = SlotCache | PagedCache


class FastBackend:
    """model.Transformer over a SlotCache: the flat-token forward both entry points share."""

    def __init__(self, model: Transformer, cache: Cache) -> None:
        self.model, self.cache = model, cache
        self.page = cache.page  # None: slots
        a = model.args
        self.vocab_size = model.vocab_size
        self._group = a.num_heads // a.num_kv_heads
        self._kv_heads = a.num_kv_heads
        self._windows = set(a.windows)
        # the Triton decode kernel on CUDA; SDPA on the CPU, where Triton only interprets
        self._kernel = model.w["embed"].device.type == "cuda"

    def _use_kernel(self, n_max: int) -> bool:
        return self._kernel and self._group * n_max <= MAX_ROWS

    def run(
        self,
        slots: list[int] | list[list[int]],
        starts: list[int],
        tokens: list[torch.Tensor],
        num_logits: list[int],
    ) -> torch.Tensor:
        """float32 logits [sum(num_logits), vocab]; tokens[i] [n_i] goes after starts[i] in
        slot (paged: through block table) slots[i]."""
        dev = self.model.w["embed"].device
        counts = [t.numel() for t in tokens]
        kv_len = max(s + c for s, c in zip(starts, counts, strict=True))
        meta = build_meta(
            torch.tensor(slots, device=dev),
            torch.tensor(starts, device=dev),
            counts,
            kv_len,
            self._group,
            self._windows,
            self.model.cos,
            self.model.sin,
            equal=False,
            kernel=self._use_kernel(max(counts)),
            kv_heads=self._kv_heads,
            page=self.page,
        )
        hidden = self.model.hidden(torch.cat(tokens), meta, self.cache.layers)
        ends = torch.tensor(counts).cumsum(0).tolist()
        keep = [torch.arange(e - k, e) for e, k in zip(ends, num_logits, strict=True)]
        return self.model.logits(hidden[torch.cat(keep).to(dev)])

    def step(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        kv_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 logits [B, n, vocab] for tokens [B, n] after starts [B] in slots [B] (paged:
        through block tables [B, W])."""
        b, n = tokens.shape
        meta = build_meta(
            slots,
            starts,
            [n] * b,
            kv_len,
            self._group,
            self._windows,
            self.model.cos,
            self.model.sin,
            equal=True,
            kernel=self._use_kernel(n),
            kv_heads=self._kv_heads,
            page=self.page,
        )
        hidden = self.model.hidden(tokens.reshape(-1), meta, self.cache.layers)
        logits = self.model.head(hidden).view(b, n, -1)
        if out is None:
            return logits.float()
        return out.copy_(logits)


_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """`device` as the current CUDA device meanwhile: Triton launches its kernels on the
    current device, so work for cuda:1 launched while cuda:0 is current fails."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def _on_own_device(method: _F) -> _F:
    """The runner method runs with the runner's GPU as the current CUDA device."""

    @functools.wraps(method)
    def scoped(self: "ModelRunner", *args: Any, **kwargs: Any) -> Any:
        with on_device(self._device):
            return method(self, *args, **kwargs)

    return scoped  # type: ignore[return-value]


class ModelRunner:
    def __init__(
        self,
        config: RunnerConfig,
        backend: FastBackend | HFBackend,
        cache: Cache,
        info: CheckpointInfo,
        tokenizer: Any,
    ) -> None:
        self.config, self.info, self.tokenizer = config, info, tokenizer
        self.vocab_size = backend.vocab_size
        self._backend, self._cache = backend, cache
        self._device = config.torch_device
        self._graphs: StepGraphs | None = None
        # steps that replayed a captured graph, and steps on a graph-capable runner that could
        # not (no captured shape fits): the services report both
        self.graph_steps = 0
        self.eager_steps = 0
        self._staging: torch.Tensor | None = None  # `to_host`'s pinned buffer, kept
        self._staging_lock = threading.Lock()
        if (
            isinstance(backend, FastBackend)
            and self._device.type == "cuda"
            and config.cuda_graph_batch_sizes
        ):
            with on_device(self._device):  # the graphs' memory pool lives on the current device
                self._graphs = self._step_graphs(backend, cache)

    def _step_graphs(self, backend: FastBackend, cache: Cache) -> StepGraphs:
        config = self.config
        return StepGraphs(
            backend.step,
            config.cuda_graph_batch_sizes,
            self.vocab_size,
            config.max_seq_len,
            cache.scratch_slot,
            self._device,
            cache.table_width if isinstance(cache, PagedCache) else None,
        )

    @classmethod
    def load(cls, config: RunnerConfig) -> "ModelRunner":
        """Loads a local checkpoint; CheckpointError (a full sentence) on any problem with it.
        With `config.tensor_parallel` N > 1, this process is rank 0 of N (`parallel`)."""
        if config.tensor_parallel > 1:
            from specdec.runner.parallel import launch

            return launch(config)
        return cls.load_rank(config)

    @classmethod
    def load_rank(cls, config: RunnerConfig, shard: Shard = ONE_RANK) -> "ModelRunner":
        """This rank's part of the checkpoint (all of it on one rank)."""

        def kv_bytes(hf: Any) -> int:
            try:  # every transformers config maps its own names onto these
                heads = int(hf.num_attention_heads)
                kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
                head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
                layers = int(hf.num_hidden_layers)
            except (AttributeError, TypeError):
                return 0
            kv_heads = max(1, kv_heads // config.tensor_parallel)  # a rank's share
            if config.paged:
                return PagedCache.bytes_needed(
                    layers, config.num_kv_blocks, config.kv_block_size, kv_heads, head_dim,
                    config.torch_dtype,
                )  # fmt: skip
            return SlotCache.bytes_needed(
                layers, config.max_slots, config.max_seq_len, kv_heads, head_dim, config.torch_dtype
            )

        ckpt = open_checkpoint(config, kv_bytes)
        info = CheckpointInfo(
            ckpt.architecture,
            0,
            len(ckpt.tokenizer),
            config.max_seq_len,
            config.dtype,
            ckpt.fast_path,
            tokenizer_hash(ckpt.tokenizer),
        )
        if ckpt.fast_path:
            return cls.from_hf_weights(config, ckpt.hf_config, ckpt, info, ckpt.tokenizer, shard)
        return cls._load_fallback(config, ckpt, info)

    @classmethod
    def from_hf_weights(
        cls,
        config: RunnerConfig,
        hf_config: Any,
        weights: Checkpoint | dict[str, torch.Tensor],
        info: CheckpointInfo | None = None,
        tokenizer: Any = None,
        shard: Shard = ONE_RANK,
    ) -> "ModelRunner":
        """Fast-path runner from a checkpoint or from HF-named tensors (benchmarks, tests);
        with a `shard`, of this rank's part of them."""
        with on_device(config.torch_device):
            return cls._from_hf_weights(config, hf_config, weights, info, tokenizer, shard)

    @classmethod
    def _from_hf_weights(
        cls,
        config: RunnerConfig,
        hf_config: Any,
        weights: Checkpoint | dict[str, torch.Tensor],
        info: CheckpointInfo | None,
        tokenizer: Any,
        shard: Shard,
    ) -> "ModelRunner":
        from specdec.errors import CheckpointError

        args = ModelArgs.from_hf(hf_config)
        try:
            local = args.sharded(shard.world)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        device, dtype = config.torch_device, config.torch_dtype
        limit = getattr(hf_config, "max_position_embeddings", None) or config.max_seq_len
        if config.max_seq_len > limit:
            raise CheckpointError(
                f"max_seq_len={config.max_seq_len} exceeds the model's "
                f"max_position_embeddings={limit}."
            )
        cos, sin = rope_tables(hf_config, config.max_seq_len)
        try:
            if isinstance(weights, dict):
                get = slicing_getter(weights)
                model = Transformer.from_hf_state(args, get, cos, sin, device, dtype, shard)
            else:
                with tensor_reader(weights, device) as read:
                    model = Transformer.from_hf_state(args, read, cos, sin, device, dtype, shard)
        except KeyError as exc:
            raise CheckpointError(f"The checkpoint has no tensor named {exc.args[0]!r}.") from exc
        cache: Cache
        if config.paged:
            cache = PagedCache(
                local.num_layers, config.max_slots, config.max_seq_len, config.num_kv_blocks,
                config.kv_block_size, local.num_kv_heads, local.head_dim, dtype, device,
                config.prefix_caching,
            )  # fmt: skip
        else:
            cache = SlotCache(
                local.num_layers,
                config.max_slots,
                config.max_seq_len,
                local.num_kv_heads,
                local.head_dim,
                dtype,
                device,
            )
        if config.compile_pointwise:
            model.compile_pointwise()
        backend = FastBackend(model, cache)
        info = info or CheckpointInfo(
            str(hf_config.architectures[0] if hf_config.architectures else hf_config.model_type),
            0,
            0,
            config.max_seq_len,
            config.dtype,
            True,
            "",
        )
        info = _with_vocab(info, backend.vocab_size)
        return cls(config, backend, cache, info, tokenizer)

    @classmethod
    def _load_fallback(
        cls, config: RunnerConfig, ckpt: Checkpoint, info: CheckpointInfo
    ) -> "ModelRunner":
        from transformers import AutoModelForCausalLM

        from specdec.errors import CheckpointError

        if config.paged:
            raise CheckpointError(
                f"A paged KV cache (kv_block_size={config.kv_block_size}) needs the fast path, "
                f"which {ckpt.architecture} has not: use kv_block_size=0 (fixed slots)."
            )
        log.warning(
            "No fast path for %s: running transformers' own model (correct, slower).",
            ckpt.architecture,
        )
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(ckpt.path), local_files_only=True, dtype=config.torch_dtype
        )
        model = model.to(config.torch_device).eval()
        backend = HFBackend(model, config.max_slots)
        cache = SlotCache(
            0,
            config.max_slots,
            config.max_seq_len,
            1,
            1,
            config.torch_dtype,
            config.torch_device,
        )
        return cls(config, backend, cache, _with_vocab(info, backend.vocab_size), ckpt.tokenizer)

    def add_request(self, request_id: str) -> None:
        """Reserves a KV slot; CacheFullError if none is free, ValueError on a duplicate id."""
        self._cache.add(request_id)

    def release(self, request_id: str) -> None:
        self._cache.release(request_id)

    def cached_length(self, request_id: str) -> int:
        return self._cache.length(request_id)

    def take_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """With prefix caching, a request that holds nothing yet takes the cached blocks its
        `token_ids` begin with (never the last token, whose logits a prefill needs) and
        returns how many tokens it now holds; 0 otherwise. What `forward` does for an item
        that starts a request, for a prompt prefilled over several forwards (chunks), whose
        first chunk alone would find only its own part."""
        if self._cache.page is None or self._cache.length(request_id) != 0:
            return 0
        return self._cache.match_prefix(request_id, list(token_ids), len(token_ids) - 1)

    def truncate(self, request_id: str, length: int) -> None:
        """Rolls back to `length` tokens (0 <= length <= cached_length), e.g. after a rejection."""
        self._cache.truncate(request_id, length)

    @property
    def free_slots(self) -> int:
        return self._cache.num_free

    @property
    def free_kv_blocks(self) -> int | None:
        """Blocks a paged cache can still give (free and cached ones); None for slots."""
        return self._cache.pool.available if isinstance(self._cache, PagedCache) else None

    def kv_blocks_needed(self, request_id: str, new_tokens: int) -> int:
        """Blocks a step of `new_tokens` for the request takes from `free_kv_blocks` (0 for
        slots)."""
        if not isinstance(self._cache, PagedCache):
            return 0
        return self._cache.pool.needed(request_id, self._cache.length(request_id), new_tokens)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV tensors this runner holds: every layer's slots or blocks, the
        scratch included (this rank's share on several ranks)."""
        return sum(t.numel() * t.element_size() for t in self._cache.layers)

    @property
    def prefix_cache_stats(self) -> CacheStats | None:
        """Tokens the prefix cache was asked for and found (a paged cache's; else None)."""
        return self._cache.prefix_stats

    @property
    def uses_graphs(self) -> bool:
        """Whether steps of a captured batch size replay CUDA graphs (on CUDA, with sizes)."""
        return self._graphs is not None

    @property
    def graphs_captured(self) -> int:
        """How many CUDA graphs the steps have captured so far (0 without graphs)."""
        return self._graphs.captured if self._graphs is not None else 0

    @property
    def can_fork(self) -> bool:
        """Whether `fork` and `swap` work: the fast path's KV lives in the slot cache (the
        transformers fallback keeps its own)."""
        return isinstance(self._backend, FastBackend)

    @_on_own_device
    def fork(self, branches: list[tuple[str, str, int]]) -> None:
        """Each (source, branch, length): `branch` (added) takes `source`'s first `length`
        cached positions."""
        if not self.can_fork:
            raise NotImplementedError("fork needs the fast path (the transformers fallback).")
        self._cache.fork(branches)

    def swap(self, a: str, b: str) -> None:
        """Requests `a` and `b` exchange their caches."""
        if not self.can_fork:
            raise NotImplementedError("swap needs the fast path (the transformers fallback).")
        self._cache.swap(a, b)

    @_on_own_device
    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One ragged pass; float32 logits [sum(num_logits), vocab] in item order.

        Prompts longer than `prefill_chunk` go in several passes of at most that many tokens
        per request. Nothing changes if any item is invalid or would overflow its slot (or,
        paged, the free blocks). With a paged cache and prefix caching, a request that holds
        nothing yet first takes the cached blocks its tokens begin with, and only the rest is
        computed (never the tokens whose logits are asked for)."""
        starts, tokens, hosts = self._check_items(items)
        rids = [it.request_id for it in items]
        keep = [it.num_logits for it in items]
        before = list(starts)
        try:
            for i, it in enumerate(items):
                host = hosts[i]
                if starts[i] == 0 and host is not None and self._cache.page is not None:
                    hit = self._cache.match_prefix(it.request_id, host, len(host) - it.num_logits)
                    tokens[i], hosts[i], starts[i] = tokens[i][hit:], host[hit:], hit
            self._cache.check_fits(rids, starts, [t.numel() for t in tokens])
            return self._forward_rounds(rids, starts, tokens, hosts, keep)
        except BaseException:
            self._roll_back(rids, before)
            raise

    def _roll_back(self, request_ids: Sequence[str], lengths: Sequence[int]) -> None:
        """Each request back to its length before a call that failed: what the call wrote or
        took (prefix hits, blocks) is dropped."""
        for rid, length in zip(request_ids, lengths, strict=True):
            self._cache.truncate(rid, length)

    def _forward_rounds(
        self,
        rids: list[str],
        starts: list[int],
        tokens: list[torch.Tensor],
        hosts: list[list[int] | None],
        keep: list[int],
    ) -> torch.Tensor:
        rows: list[list[torch.Tensor]] = [[] for _ in rids]
        chunk = self.config.prefill_chunk
        rounds = max((t.numel() + chunk - 1) // chunk for t in tokens) if tokens else 0
        for r in range(rounds):
            idx = [i for i, t in enumerate(tokens) if t.numel() > r * chunk]
            parts = [tokens[i][r * chunk : (r + 1) * chunk] for i in idx]
            want = [
                max(0, min(p.numel(), keep[i] - (tokens[i].numel() - r * chunk - p.numel())))
                for i, p in zip(idx, parts, strict=True)
            ]
            at = [starts[i] + r * chunk for i in idx]
            where = self._cache.prepare([rids[i] for i in idx], at, [p.numel() for p in parts])
            logits = self._backend.run(where, at, parts, want)  # type: ignore[arg-type]
            for i, a, p in zip(idx, at, parts, strict=True):
                host = hosts[i]
                ids = host[r * chunk : r * chunk + p.numel()] if host is not None else None
                self._cache.commit(rids[i], a, p.numel(), ids)
            for i, piece in zip(idx, logits.split(want), strict=True):
                rows[i].append(piece)
        flat = [x for r in rows for x in r]
        return torch.cat(flat) if flat else torch.empty(0, self.vocab_size, device=self._device)

    def _check_items(
        self,
        items: Sequence[ForwardItem],
    ) -> tuple[list[int], list[torch.Tensor], list[list[int] | None]]:
        """Each item's cached length, its tokens on the device, and their ids on the host
        where they came from there (None where they came on the device)."""
        if len({it.request_id for it in items}) != len(items):
            raise InvalidInputError("Each request may appear at most once in a forward.")
        starts, tokens, hosts = [], [], []
        for it in items:
            ids = torch.as_tensor(it.token_ids, dtype=torch.long).reshape(-1)
            self._check_tokens(ids, it.request_id)
            if not 0 <= it.num_logits <= ids.numel():
                raise InvalidInputError(
                    f"num_logits must be in [0, {ids.numel()}] for request {it.request_id!r}, "
                    f"got {it.num_logits}."
                )
            self._cache.check_room(it.request_id, ids.numel())
            starts.append(self._cache.length(it.request_id))
            paged = self._cache.page is not None
            hosts.append(ids.tolist() if paged and ids.device.type == "cpu" else None)
            tokens.append(ids.to(self._device))
        return starts, tokens, hosts

    def _check_tokens(self, ids: torch.Tensor, request_id: str) -> None:
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size):
            raise InvalidInputError(
                f"token ids of request {request_id!r} must be in [0, {self.vocab_size})."
            )

    @_on_own_device
    @torch.inference_mode()
    def graph_step(
        self,
        request_ids: Sequence[str],
        token_ids: torch.Tensor,
        head: Head | None = None,
        head_inputs: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Appends token_ids [B, n] (same n for all) and returns what the step produced.

        Without `head`: float32 logits [B, n, V]. With `head`: the tuple
        `head(logits [B, n, V] float32, *head_inputs)` returns, each tensor with batch dim first;
        every head input is [B, ...] too. On CUDA with B <= a captured batch size the step, head
        included, replays a CUDA graph and the results are views of static buffers, valid until
        the next graph_step of the same shape; the head must then be capturable (no host syncs,
        randomness only from its inputs). Otherwise the step runs eagerly.
        """
        logits, outs = self._step(request_ids, token_ids, head, head_inputs, None, None)
        return outs if head is not None else logits

    def _step(
        self,
        request_ids: Sequence[str],
        token_ids: torch.Tensor,  # [B, n]
        head: Head | None,
        head_inputs: Sequence[torch.Tensor],
        kept: Sequence[int] | None,  # real tokens of each row (the rest is padding); None: n
        host_rows: Sequence[Sequence[int]] | None,  # the rows' ids where known on the host
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        b, n = token_ids.shape
        for rid in request_ids:
            self._cache.check_room(rid, n)
        if token_ids.device.type == "cpu":  # on a GPU the check would cost a host sync per step
            self._check_tokens(token_ids, ",".join(request_ids))
            if host_rows is None and self._cache.page is not None:
                host_rows = token_ids.tolist()
        if len(set(request_ids)) != b:
            raise InvalidInputError(
                "graph_step needs one distinct request id per row of token_ids."
            )
        lengths = [self._cache.length(r) for r in request_ids]
        counts = [n] * b if kept is None else list(kept)
        # a paged cache gives each row blocks for its real tokens; its padding goes past them,
        # into its last block's unused positions or the scratch block its table ends with
        self._cache.check_fits(request_ids, lengths, counts)
        bs = self._graphs.padded_size(b) if self._graphs is not None else None
        try:
            return self._step_prepared(
                request_ids, token_ids, head, head_inputs, lengths, counts, host_rows, bs
            )
        except BaseException:
            self._roll_back(request_ids, lengths)
            raise

    def _step_prepared(
        self,
        request_ids: Sequence[str],
        token_ids: torch.Tensor,
        head: Head | None,
        head_inputs: Sequence[torch.Tensor],
        lengths: list[int],
        counts: list[int],
        host_rows: Sequence[Sequence[int]] | None,
        bs: int | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        n = token_ids.shape[1]
        # every row's n positions, padding too; a graph's tables are as wide as it captured
        cover = self.config.max_seq_len if bs is not None else max(lengths) + n
        where = self._cache.prepare(request_ids, lengths, counts, cover)
        if self._cache.page is None:
            slots_starts = self._to_device([where, lengths])  # type: ignore[list-item, arg-type]
            slots, starts = slots_starts[0], slots_starts[1]  # one copy for both
        else:
            slots, starts = self._to_device(where), self._to_device(lengths)
        tokens = token_ids.to(self._device, torch.long, non_blocking=True)
        if self._graphs is not None and bs is not None:
            logits, outs = self._graphs.run(bs, tokens, starts, slots, head, head_inputs)
            self.graph_steps += 1
        else:
            logits = self._backend.step(tokens, starts, slots, max(lengths) + n)
            outs = tuple(head(logits, *head_inputs)) if head is not None else ()
            self.eager_steps += self._graphs is not None
        known = host_rows is not None and self._cache.page is not None  # fixed slots: unused
        for i, rid in enumerate(request_ids):
            ids = list(host_rows[i][: counts[i]]) if known else None  # type: ignore[index]
            self._cache.commit(rid, lengths[i], counts[i], ids)
        return logits, outs

    @_on_own_device
    @torch.inference_mode()
    def ragged_step(
        self,
        request_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        head: Head | None = None,
        head_inputs: Sequence[torch.Tensor] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Appends token_ids[b] (1 <= len_b) to request b in one pass: a verify of k_b + 1
        tokens with k_b differing per request (0 included), or the draft's catch-up.

        Returns float32 logits [B, n, V] with n = max len_b (row b's positions >= len_b are
        padding: their values are meaningless) and the head's outputs (see `graph_step`).
        On CUDA, when a captured batch size fits and every request has room for n tokens, the
        step replays the CUDA graph of shape (padded batch, n): padding tokens write K/V past
        the request's length, which nothing reads (a later step overwrites a position before
        any query can see it). Otherwise it runs eagerly, counted in `eager_steps`.

        Example: lengths [3, 1] → tokens [[a0, a1, a2], [b0, 0, 0]]; logits[1, 0] scores b0.
        """
        if len(token_ids) != len(request_ids) or any(len(t) == 0 for t in token_ids):
            raise InvalidInputError("ragged_step needs one non-empty token list per request.")
        n = max(len(t) for t in token_ids)
        if self._graph_fits(request_ids, n):
            padded = [[*t, *([0] * (n - len(t)))] for t in token_ids]
            self._check_flat([x for t in token_ids for x in t])
            kept = [len(t) for t in token_ids]
            tokens = self._to_device(padded)
            return self._step(request_ids, tokens, head, head_inputs, kept, token_ids)
        self.eager_steps += self._graphs is not None
        items = [ForwardItem(r, t, len(t)) for r, t in zip(request_ids, token_ids, strict=True)]
        rows = self.forward(items)  # [sum len_b, V]
        b = len(request_ids)
        logits = rows.new_zeros(b, n, rows.shape[1])
        index = [i * n + j for i, t in enumerate(token_ids) for j in range(len(t))]
        logits.view(b * n, -1)[self._to_device(index)] = rows
        outs = tuple(head(logits, *head_inputs)) if head is not None else ()
        return logits, outs

    def _graph_fits(self, request_ids: Sequence[str], n: int) -> bool:
        if self._graphs is None or self._graphs.padded_size(len(request_ids)) is None:
            return False
        if n > self.config.cuda_graph_max_tokens:
            return False
        limit = self.config.max_seq_len - n
        return all(self._cache.length(r) <= limit for r in request_ids)

    def _check_flat(self, ids: list[int]) -> None:
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise InvalidInputError(f"token ids must be in [0, {self.vocab_size}).")

    @property
    def device(self) -> torch.device:
        return self._device

    def release_graphs(self) -> None:
        """Destroys the captured CUDA graphs (`StepGraphs.release`): before a tensor-parallel
        group ends, whose communicators the graphs' collectives hold."""
        if self._graphs is not None:
            self._graphs.release()

    def close(self) -> None:
        """Frees what the runner holds outside this process (the other ranks of a
        tensor-parallel model); nothing on one rank."""

    def own_device(self) -> None:
        """Makes the runner's GPU this process's current CUDA device (a service's process holds
        one runner): the kernels the engines launch outside the runner (the samplers') then
        run there too."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    @_on_own_device
    def synchronize(self) -> None:
        """Waits for the work queued on the runner's device (nothing to wait for on a CPU)."""
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    @_on_own_device
    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """CPU copies of device tensors with one host synchronisation for all of them
        (non-blocking copies into one pinned buffer, one wait, then copies out): the step's one
        sync. The buffer is the runner's, grown to the largest read and kept: a pinned
        allocation of a new size (cudaHostAlloc) can hold a step for milliseconds."""
        if self._device.type != "cuda":
            return list(tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        starts = [0]
        for n in sizes:  # 64-byte aligned, so that each view may take any dtype
            starts.append(starts[-1] + -(-n // 64) * 64)
        with self._staging_lock:
            if self._staging is None or self._staging.numel() < starts[-1]:
                size = max(starts[-1], 2 * (0 if self._staging is None else self._staging.numel()))
                self._staging = torch.empty(max(size, 1 << 16), dtype=torch.uint8, pin_memory=True)
            views = [
                self._staging[a : a + n].view(t.dtype).view(t.shape)
                for a, n, t in zip(starts[:-1], sizes, tensors, strict=True)
            ]
            for v, t in zip(views, tensors, strict=True):
                v.copy_(t, non_blocking=True)
            torch.cuda.current_stream(self._device).synchronize()
            return [v.clone() for v in views]

    @_on_own_device
    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the runner's device without a host sync (pinned, non-blocking)."""
        if self._device.type != "cuda" or tensor.device.type != "cpu":
            return tensor.to(self._device)
        return tensor.pin_memory().to(self._device, non_blocking=True)

    def _to_device(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        """int64 [len(values)] on the device without a host sync: a plain torch.tensor(...,
        device=cuda) copies from pageable memory and waits for the stream, so the host could
        not prepare the next step while the GPU runs this one."""
        return self.upload(torch.tensor(values, dtype=torch.long))


def _with_vocab(info: CheckpointInfo, vocab: int) -> CheckpointInfo:
    from dataclasses import replace

    return replace(info, vocab_size=vocab)
