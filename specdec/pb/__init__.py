"""Generated protobuf and gRPC modules of the `specdec.v1` protocol (see `proto/`).

    from specdec.pb import common_pb2, target_pb2_grpc

Regenerate with `python -m specdec.pb.generate`; CI runs it with `--check`. The modules are
imported lazily so that the generator runs even when they are missing or broken.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.pb.specdec.v1 import (
        common_pb2,
        draft_pb2,
        draft_pb2_grpc,
        generate_pb2,
        generate_pb2_grpc,
        target_pb2,
        target_pb2_grpc,
    )

__all__ = [
    "common_pb2",
    "draft_pb2",
    "draft_pb2_grpc",
    "generate_pb2",
    "generate_pb2_grpc",
    "target_pb2",
    "target_pb2_grpc",
]


def __getattr__(name: str) -> ModuleType:
    if name not in __all__:
        raise AttributeError(f"module 'specdec.pb' has no attribute {name!r}")
    return importlib.import_module(f"specdec.pb.specdec.v1.{name}")
