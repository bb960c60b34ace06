"""float32 / int32 arrays as packed little-endian bytes (the wire format of `specdec.v1`).

A row of V = 128,256 float32 probabilities is 0.5 MB; as `bytes` it is one copy each way,
where a `repeated float` field would box every element.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

_WIRE = {torch.float32: np.dtype("<f4"), torch.int32: np.dtype("<i4")}
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def pack(tensor: torch.Tensor) -> bytes:
    """Row-major little-endian bytes of a float32 or int32 tensor (any shape, any device)."""
    wire = _WIRE.get(tensor.dtype)
    if wire is None:
        raise ValueError(f"only float32 and int32 tensors are packed, got {tensor.dtype}.")
    array = tensor.numpy(force=True)  # detached, on the CPU; tobytes() writes row-major
    return array.astype(wire, copy=False).tobytes()


def unpack(data: bytes, dtype: torch.dtype, shape: tuple[int, ...], field: str) -> torch.Tensor:
    """Tensor of `shape` from packed bytes; ValueError naming `field` if the size is wrong."""
    wire = _WIRE.get(dtype)
    if wire is None:
        raise ValueError(f"only float32 and int32 tensors are unpacked, got {dtype}.")
    expected = math.prod(shape) * wire.itemsize
    if len(data) != expected:
        dims = " x ".join(str(d) for d in shape) or "scalar"
        raise ValueError(
            f"{field} has {len(data)} bytes; expected {expected} "
            f"({dims} little-endian {wire.name})."
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # one copy into a writable buffer; numpy's reshape costs ~1 us less than torch's view
    array = np.frombuffer(bytearray(data), dtype=wire).reshape(shape)
    if not _LITTLE_ENDIAN_HOST:
        array = array.astype(wire.newbyteorder("="))
    return torch.from_numpy(array)
