"""The model runner both services share: checkpoint loading, KV slots, ragged forwards,
rollback and CUDA-graph steps. See `runner` for the API and `kv_cache` for the memory layout."""

from specdec.runner.config import CheckpointInfo, ForwardItem, RunnerConfig, resolve_device
from specdec.runner.runner import ModelRunner

__all__ = ["CheckpointInfo", "ForwardItem", "ModelRunner", "RunnerConfig", "resolve_device"]
