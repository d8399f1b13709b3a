"""wgpu buffers that remember the numpy shape and dtype they were made for.

So a write or a dispatch with the wrong kind of data is refused with a clear
message (``shaderdsl.checks``) instead of silently reinterpreting bytes.
"""
from __future__ import annotations

import itertools

import numpy as np
import wgpu

from ..devicebuffer import DeviceBuffer

STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
# COPY_SRC too, so a uniform can be read back and copied like any buffer.
UNIFORM_USAGE = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC

# Ids are never reused (unlike id()), so a cache keyed on them cannot confuse
# a released buffer with a new one allocated at the same address.
_ids = itertools.count(1)


def next_id() -> int:
    """A fresh buffer id (the uniform ring's buffers take theirs from here too)."""
    return next(_ids)


def padded_bytes(arr: np.ndarray, size: int) -> memoryview:
    """The array's bytes, zero-padded to ``size`` when shorter."""
    data = arr.data.cast("B")  # (arr is C-contiguous: the host checks make it so)
    if len(data) == size:
        return data
    out = bytearray(size)
    out[: len(data)] = data
    return memoryview(out)


class Buffer(DeviceBuffer):
    """A wgpu buffer with the numpy shape/dtype it was made for. The wgpu
    handle is private: destroyed behind the device's back, it aborted the
    process at the next submit; ``release()`` frees it safely."""

    __slots__ = ("device", "_wgpu_buffer", "shape", "dtype", "nbytes", "size", "id",
                 "usage_kind", "name", "__weakref__")

    def __init__(self, device, wgpu_buffer, shape: tuple, dtype: np.dtype, usage_kind: str,
                 name: str | None = None):
        self._describe(device, shape, dtype, usage_kind, name, _ids)
        self._wgpu_buffer = wgpu_buffer

    @property
    def released(self) -> bool:
        return self._wgpu_buffer is None

    @property
    def bound_bytes(self) -> int:
        return self._wgpu_buffer.size
