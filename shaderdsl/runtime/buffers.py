"""GPU buffers and the host-side checks made before any byte moves.

A ``Buffer`` remembers the numpy shape and dtype it was made for, so a write
or a dispatch with the wrong kind of data is refused with a clear message
instead of silently reinterpreting bytes.
"""
from __future__ import annotations

import itertools

import numpy as np
import wgpu

from ..errors import BindingError

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32),
                    np.dtype(np.uint32))

STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
# COPY_SRC too, so a uniform can be read back and copied like any buffer.
UNIFORM_USAGE = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC

# Ids are never reused (unlike id()), so a cache keyed on them cannot confuse
# a released buffer with a new one allocated at the same address.
_ids = itertools.count(1)


def describe(dtype: np.dtype, shape: tuple) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def check_dtype(dtype, what: str = "buffer") -> np.dtype:
    """The numpy dtype as a np.dtype, or BindingError if WGSL cannot hold it."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise BindingError(f"{what}: {dtype!r} is not a numpy dtype") from e
    if dt not in SUPPORTED_DTYPES:
        raise BindingError(
            f"{what}: dtype {dt.str} ({dt.name}) is not supported; use native-endian "
            f"float32, float16, int32 or uint32 (convert with arr.astype(np.float32) etc.)")
    return dt


def host_array(array, what: str = "buffer") -> np.ndarray:
    """A C-contiguous array of a supported dtype; never converts dtypes silently."""
    if not isinstance(array, np.ndarray):
        raise BindingError(f"{what}: expected a numpy array, got {type(array).__name__}")
    check_dtype(array.dtype, what)
    return np.ascontiguousarray(array)


def uniform_array(value) -> np.ndarray:
    """Host array for a uniform: numpy arrays/scalars keep their dtype,
    Python float -> float32, Python int -> uint32 (counts and sizes)."""
    if isinstance(value, np.ndarray):
        return host_array(value, "uniform")
    if isinstance(value, np.generic):
        return host_array(np.asarray(value), "uniform")
    if isinstance(value, bool):
        raise BindingError("uniform: bool is not host-shareable; pass np.uint32(0/1)")
    if isinstance(value, float):
        return np.asarray(value, np.float32)
    if isinstance(value, int):
        if not 0 <= value < 2**32:
            raise BindingError(f"uniform: Python int {value} does not fit u32; pass an "
                               f"np.int32 for a signed uniform")
        return np.asarray(value, np.uint32)
    raise BindingError(f"uniform: expected a numpy array or scalar, got {type(value).__name__}")


def padded_size(nbytes: int, multiple: int = 4) -> int:
    """WebGPU wants buffer and copy sizes in multiples of 4 (16 for uniforms)."""
    return max(multiple, -(-nbytes // multiple) * multiple)


def padded_bytes(arr: np.ndarray, size: int) -> memoryview:
    """The array's bytes, zero-padded to ``size`` when shorter."""
    data = memoryview(arr).cast("B")
    if len(data) == size:
        return data
    out = bytearray(size)
    out[: len(data)] = data
    return memoryview(out)


class Buffer:
    """A device buffer with the numpy shape/dtype it was made for."""

    __slots__ = ("device", "wgpu_buffer", "shape", "dtype", "nbytes", "size", "id",
                 "usage_kind", "name", "__weakref__")

    def __init__(self, device, wgpu_buffer, shape: tuple, dtype: np.dtype, usage_kind: str,
                 name: str | None = None):
        self.device = device
        self.wgpu_buffer = wgpu_buffer
        self.shape = tuple(shape)
        self.dtype = dtype
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * dtype.itemsize
        self.id = next(_ids)
        self.usage_kind = usage_kind
        self.name = name

    @property
    def released(self) -> bool:
        return self.wgpu_buffer is None

    def read(self) -> np.ndarray:
        return self.device.read(self)

    def write(self, array) -> None:
        self.device.write(self, array)

    def release(self) -> None:
        """Free the GPU memory now rather than at garbage collection."""
        self.device.release(self)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        state = " released" if self.released else ""
        return f"<Buffer{label} #{self.id} {self.usage_kind} {describe(self.dtype, self.shape)}{state}>"
