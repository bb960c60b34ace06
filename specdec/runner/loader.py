"""Checks and opens a local Hugging Face checkpoint; nothing is ever downloaded.

Every problem a user can cause (no directory, broken config or weights, an architecture
transformers does not know, a dtype the device cannot multiply in, too little memory) becomes a
CheckpointError whose message is a whole sentence naming the problem.
"""

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import CheckpointError
from specdec.runner.config import RunnerConfig
from specdec.runner.model import FAST_MODEL_TYPES, STATIC_ROPE_TYPES, rope_type


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    files: tuple[Path, ...]
    num_params: int
    architecture: str
    fast_path: bool


def tokenizer_hash(tokenizer: Any) -> str:
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    if not path.is_dir():
        raise CheckpointError(f"The model directory {str(path)!r} does not exist.")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"The model directory {str(path)!r} has no config.json.")
    try:
        json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(cfg_file)!r} is not valid JSON ({exc}).") from exc
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"The checkpoint in {str(path)!r} has an architecture that transformers does not "
            f"support ({exc})."
        ) from exc


EMBEDDING = "model.embed_tokens.weight"  # replicated on every tensor-parallel rank


def _count_params(files: tuple[Path, ...]) -> tuple[int, int]:
    """(all parameters, the embedding's) of the checkpoint's files."""
    from safetensors import safe_open

    total = embedding = 0
    for f in files:
        try:
            with f.open("rb"):  # unreadable (permissions, gone) is not corrupt
                pass
        except OSError as exc:
            raise CheckpointError(
                f"The weights file {str(f)!r} cannot be read ({exc.strerror or exc})."
            ) from exc
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    shape = handle.get_slice(name).get_shape()
                    total += int(torch.Size(shape).numel())
                    if name == EMBEDDING:
                        embedding = int(torch.Size(shape).numel())
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise CheckpointError(f"The weights file {str(f)!r} is corrupt ({exc}).") from exc
    return total, embedding


def _check_dtype(device: torch.device, dtype: torch.dtype, name: str) -> None:
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise CheckpointError(f"The device {device} cannot run {name} matmuls.")
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        ok = bool(torch.isfinite(a @ a).all())
    except RuntimeError as exc:
        raise CheckpointError(f"The device {device} cannot run {name} matmuls ({exc}).") from exc
    if not ok:
        raise CheckpointError(f"The device {device} gives wrong {name} matmul results.")


def _memory_available(device: torch.device, limit: int | None) -> int:
    if limit is not None:
        return limit
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _architecture(cfg: Any) -> tuple[str, bool]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    fast = (
        cfg.model_type in FAST_MODEL_TYPES
        and rope_type(cfg) in STATIC_ROPE_TYPES
        and getattr(cfg, "hidden_act", "silu") == "silu"
    )
    if not fast and type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CheckpointError(
            f"The architecture {arch} (model_type {cfg.model_type!r}) is not a causal language "
            f"model that transformers can run."
        )
    return arch, fast


def _check_tensor_parallel(cfg: Any, fast: bool, arch: str, world: int) -> None:
    """CheckpointError unless `world` ranks can split this model (before any weight is read)."""
    from specdec.runner.model import ModelArgs, check_tensor_parallel

    if not fast:
        raise CheckpointError(
            f"Tensor parallelism runs the Llama, Mistral, Qwen2 and Qwen3 families only; "
            f"{arch} (model_type {cfg.model_type!r}) runs on one device."
        )
    try:
        check_tensor_parallel(ModelArgs.from_hf(cfg), world)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


def check_tensor_parallel_checkpoint(config: RunnerConfig) -> None:
    """CheckpointError unless `config.tensor_parallel` ranks can split the checkpoint: read from
    its config.json alone, before any weight."""
    cfg = _read_config(Path(config.model_path))
    arch, fast = _architecture(cfg)
    _check_tensor_parallel(cfg, fast, arch, config.tensor_parallel)


def open_checkpoint(config: RunnerConfig, kv_bytes: Callable[[Any], int]) -> Checkpoint:
    """Validates the directory, dtype and memory; `kv_bytes(hf_config)` sizes the KV cache."""
    from transformers import AutoTokenizer

    path = Path(config.model_path)
    cfg = _read_config(path)
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"The model directory {str(path)!r} has no *.safetensors files.")
    arch, fast = _architecture(cfg)
    if config.tensor_parallel > 1:
        _check_tensor_parallel(cfg, fast, arch, config.tensor_parallel)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"The tokenizer in {str(path)!r} cannot be loaded ({exc}).") from exc
    device = config.torch_device
    _check_dtype(device, config.torch_dtype, config.dtype)
    num_params, embedding = _count_params(files)
    # a rank holds its N-th of the weights but the whole embedding (the norms are few), and its
    # N-th of the KV heads, which kv_bytes counts
    world = config.tensor_parallel
    held = (num_params - embedding) // world + embedding if world > 1 else num_params
    need = held * config.torch_dtype.itemsize + kv_bytes(cfg)
    have = _memory_available(device, config.memory_limit_bytes)
    if need > have:
        raise CheckpointError(
            f"The checkpoint in {str(path)!r} needs {need / 2**30:.2f} GiB in {config.dtype} "
            f"(weights plus KV cache) but only {have / 2**30:.2f} GiB is available."
        )
    return Checkpoint(path, cfg, tokenizer, files, num_params, arch, fast)


@contextmanager
def tensor_reader(ckpt: Checkpoint, device: torch.device) -> Iterator[Callable[[str], Any]]:
    """Yields a `model.Getter` reading tensors onto `device`: get(name), or get(name, (dim,
    start, stop)) for a slice of it (a tensor-parallel rank's part); None for a name no file
    holds."""
    from safetensors import safe_open

    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for f in ckpt.files:
            handle = stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
            where |= dict.fromkeys(handle.keys(), handle)

        def get(name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor | None:
            handle = where.get(name)
            if handle is None:
                return None
            try:
                if part is None:
                    return handle.get_tensor(name)
                dim, start, stop = part  # only these rows or columns are read
                view = handle.get_slice(name)
                return view[start:stop] if dim == 0 else view[:, start:stop]
            except Exception as exc:
                raise CheckpointError(f"The tensor {name!r} cannot be read ({exc}).") from exc

        yield get
