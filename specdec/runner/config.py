"""Configuration and plain data types of the model runner."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.limits import check_range
from specdec.tensor_parallel import MAX_TENSOR_PARALLEL

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What to load and how much KV memory to reserve.

    `max_slots` requests of up to `max_seq_len` tokens each fit at once (see `kv_cache`).
    `cuda_graph_batch_sizes` are the batch sizes `graph_step` captures on CUDA (lazily, once
    per (batch size, tokens per request, head)); an empty tuple means always eager.
    """

    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    max_slots: int = 8
    max_seq_len: int = 2048
    prefill_chunk: int = 512
    memory_limit_bytes: int | None = None
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    # longest step (tokens per request) `ragged_step` replays as a graph: a verify of up to 16
    # drafts; longer steps (a draft catching up after a pause) run eagerly
    cuda_graph_max_tokens: int = 17
    compile_pointwise: bool = False  # torch.compile the pointwise ops instead of `fused` kernels
    # ranks of one node the model is split over (`parallel`): on CUDA N GPUs from `device`'s
    # index on (cuda:1: 1 .. N), on the CPU N processes; 1 is no split
    tensor_parallel: int = 1
    # the KV cache: 0, fixed slots (each of the max_slots requests holds max_seq_len positions);
    # N > 0, paged in blocks of N positions (`kv_cache.PagedCache`): max_slots requests at
    # once share kv_blocks blocks (0: as many as the slots would hold), full blocks cached
    # under their token prefix when prefix_caching
    kv_block_size: int = 0
    kv_blocks: int = 0
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if not 1 <= self.max_slots <= 4096:
            raise ValueError(f"max_slots must be in [1, 4096], got {self.max_slots}.")
        if not 1 <= self.max_seq_len <= 1 << 20:
            raise ValueError(f"max_seq_len must be in [1, 1048576], got {self.max_seq_len}.")
        if not 1 <= self.prefill_chunk <= 1 << 20:
            raise ValueError(f"prefill_chunk must be in [1, 1048576], got {self.prefill_chunk}.")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(
                f"memory_limit_bytes must be a positive number of bytes or None, "
                f"got {self.memory_limit_bytes}."
            )
        if not 1 <= self.cuda_graph_max_tokens <= 128:
            raise ValueError(
                f"cuda_graph_max_tokens must be in [1, 128], got {self.cuda_graph_max_tokens}."
            )
        check_range(self.tensor_parallel, "tensor_parallel", 1, MAX_TENSOR_PARALLEL)
        check_range(self.kv_block_size, "kv_block_size", 0, 4096)
        check_range(self.kv_blocks, "kv_blocks", 0, 1 << 24)
        if self.kv_blocks and not self.kv_block_size:
            raise ValueError("kv_blocks sizes a paged KV cache: set kv_block_size too.")
        for size in self.cuda_graph_batch_sizes:
            if not 1 <= size <= self.max_slots:
                raise ValueError(
                    f"cuda_graph_batch_sizes entries must be in [1, max_slots={self.max_slots}], "
                    f"got {size}."
                )
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device must be a torch device string, got {self.device!r}.") from exc

    @property
    def paged(self) -> bool:
        return self.kv_block_size > 0

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of a paged cache: kv_blocks, or what max_slots slots of max_seq_len hold."""
        if self.kv_blocks:
            return self.kv_blocks
        return self.max_slots * -(-self.max_seq_len // max(1, self.kv_block_size))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """The device with its index: see `resolve_device`."""
        return resolve_device(self.device)


def resolve_device(spec: str | torch.device) -> torch.device:
    """`spec` as a device with an index where it is a GPU: "cuda" alone is the process's
    current CUDA device. A Ray actor is handed its GPU through CUDA_VISIBLE_DEVICES and told
    "cuda"; `torch.cuda.set_device` and the CUDA graphs' pools need the index.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True, slots=True)
class ForwardItem:
    """New tokens for one request, appended after its cached length.

    Logits come back for the last `num_logits` of `token_ids`: 1 for prefill or decode,
    k + 1 to verify k draft tokens, 0 for a prefill chunk whose logits nobody reads.
    """

    request_id: str
    token_ids: Sequence[int] | torch.Tensor  # [n]
    num_logits: int


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What the services compare at start-up (vocabulary) and report (fast path or not)."""

    architecture: str
    vocab_size: int  # rows of the output head, padding included
    tokenizer_vocab_size: int
    max_seq_len: int
    dtype: str
    fast_path: bool
    tokenizer_hash: str  # sha256 of the tokenizer's vocabulary as sorted JSON; "" if none
