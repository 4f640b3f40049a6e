"""Fragmentation: tensors (several keys per call) to float32 blocks of k values (the job's width: ``wire.K`` or
``wire.WIDE_K``) and back.

Each key starts on a block boundary and its last block is padded with zeros, so a block
never mixes two tensors (each keeps its own exponents) and block ``i`` of a call maps
to one key. Accepted values: numpy arrays of float32, float16, float64 (converted to
float32 for the wire), bfloat16 given as a numpy ``uint16`` bit pattern (or an
``ml_dtypes.bfloat16`` array), and torch tensors (torch is imported only when one is
passed). Results come back with each input's shape, dtype and (torch) device.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netagg import wire

K = wire.K
_FLOAT_KINDS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)}


@dataclass(frozen=True, slots=True)
class Segment:
    """Where one key's values live in a call's blocks, and how to give them back."""

    key: int
    first_block: int
    num_blocks: int
    size: int
    shape: tuple[int, ...]
    #: numpy dtype of the result, or the string "bfloat16" for uint16 bit patterns.
    dtype: Any
    #: None for numpy; for torch, (torch dtype, device).
    torch: tuple[Any, Any] | None = None


@dataclass(frozen=True, slots=True)
class Layout:
    """The segments of one call, in key order as given."""

    segments: tuple[Segment, ...]
    num_blocks: int
    #: Values per block (the job's packet width).
    width: int = K

    @property
    def keys(self) -> list[int]:
        return [s.key for s in self.segments]

    @property
    def sizes(self) -> list[int]:
        return [s.size for s in self.segments]


def blocks_for(size: int, k: int = K) -> int:
    """Blocks of ``k`` values needed for ``size`` values."""
    return -(-size // k)


def _is_torch(value: object) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and "torch" in sys.modules


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) to float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    nan = np.isnan(values)
    out = (rounded >> 16).astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _to_numpy(value: Any) -> tuple[np.ndarray, Any, tuple[Any, Any] | None]:
    """(array whose dtype is float32/float16/float64/uint16-as-bf16, result dtype, torch info)."""
    if _is_torch(value):
        import torch

        tensor = value.detach()
        info = (tensor.dtype, tensor.device)
        tensor = tensor.cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16", info
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"gradients must be floating point, got torch {tensor.dtype}")
        return tensor.numpy(), np.dtype(tensor.numpy().dtype), info
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":  # ml_dtypes
        return array.view(np.uint16), array.dtype, None
    if array.dtype == np.uint16:
        return array, "bfloat16", None
    if array.dtype not in _FLOAT_KINDS:
        raise TypeError(
            f"gradients must be float32, float16, float64 or bfloat16 (as uint16), got {array.dtype}"
        )
    return array, array.dtype, None


def pack(keys: Sequence[int], values: Sequence[Any], k: int = K) -> tuple[Layout, np.ndarray]:
    """Flatten ``values`` into a new ``(num_blocks, k)`` float32 array, one segment per key."""
    wire.width_code(k)
    keys = [check_key(k) for k in keys]
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in one call: {keys}")
    arrays, segments, first = [], [], 0
    for key, value in zip(keys, values, strict=True):
        array, dtype, torch_info = _to_numpy(value)
        count = blocks_for(array.size, k)
        segments.append(Segment(key, first, count, array.size, tuple(array.shape), dtype, torch_info))
        arrays.append(array)
        first += count
    blocks = np.empty((first, k), np.float32)
    flat = blocks.reshape(-1)
    for segment, array in zip(segments, arrays, strict=True):
        start = segment.first_block * k
        end = start + segment.size
        if array.dtype == np.uint16:  # bfloat16 bit patterns
            flat[start:end] = bfloat16_to_float32(array.reshape(-1))
        else:
            flat[start:end] = array.reshape(-1)
        flat[end:(segment.first_block + segment.num_blocks) * k] = 0.0
    return Layout(tuple(segments), first, k), blocks


def unpack(layout: Layout, flat_values: np.ndarray) -> list[Any]:
    """Split float32 values of ``layout``'s blocks back into arrays (or tensors) per key."""
    flat = flat_values.reshape(-1)
    k = layout.width
    if flat.size != layout.num_blocks * k:
        raise ValueError(f"expected {layout.num_blocks * k} values, got {flat.size}")
    return [_restore(segment, flat[segment.first_block * k:segment.first_block * k + segment.size])
            for segment in layout.segments]


def _restore(segment: Segment, values: np.ndarray) -> Any:
    if isinstance(segment.dtype, str) or segment.dtype.name == "bfloat16":
        array = float32_to_bfloat16(values).reshape(segment.shape)
        if not isinstance(segment.dtype, str):  # ml_dtypes.bfloat16
            array = array.view(segment.dtype)
    else:
        array = values.astype(segment.dtype).reshape(segment.shape)
    if segment.torch is None:
        return array
    import torch

    dtype, device = segment.torch
    if dtype == torch.bfloat16:
        tensor = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device)


def check_key(key: Any) -> int:
    """A key as an int; TypeError for anything but an integer (bools included)."""
    if isinstance(key, bool) or not isinstance(key, int | np.integer):
        raise TypeError(f"keys must be integers, got {key!r}")
    return int(key)
