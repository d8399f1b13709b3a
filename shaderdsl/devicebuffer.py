"""The buffer base every device's Buffer subclasses (GPU runtime, interpreter,
browser): what the host checks (``shaderdsl.checks``) know of a buffer on
some device. Nothing here touches a device.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


def describe(dtype: np.dtype, shape: tuple) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def padded_size(nbytes: int, multiple: int = 4) -> int:
    """WebGPU's buffer and copy sizes: multiples of 4 (16 for uniforms), never 0."""
    return max(multiple, -(-nbytes // multiple) * multiple)


class BufferDevice(Protocol):
    """What a buffer asks of the device it lives on (every device's HostDevice has it)."""

    def read(self, buf) -> np.ndarray: ...

    def write(self, buf, array) -> None: ...

    def release(self, buf) -> None: ...


class DeviceBuffer:
    """What the checks know of a buffer on some device: the numpy shape and
    dtype it was made for, its kind ("storage" or "uniform") and whether it
    has been released. Each device subclasses it."""

    __slots__ = ()
    device: BufferDevice
    shape: tuple
    dtype: np.dtype
    size: int
    nbytes: int
    id: int
    usage_kind: str
    name: str | None

    def _describe(self, device, shape, dtype, usage_kind: str, name, ids) -> None:
        """The fields every device's buffer sets: device, shape, dtype, sizes,
        kind, name, and the next id from the device module's counter ``ids``."""
        self.device, self.shape, self.dtype = device, tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.id, self.usage_kind, self.name = next(ids), usage_kind, name

    @property
    def released(self) -> bool:
        raise NotImplementedError

    @property
    def bound_bytes(self) -> int:
        """Bytes a binding of this buffer covers (its padded size on the device)."""
        return self.nbytes

    def read(self) -> np.ndarray:
        return self.device.read(self)

    def write(self, array) -> None:
        self.device.write(self, array)

    def release(self) -> None:
        """Free the buffer's memory now rather than at garbage collection."""
        self.device.release(self)

    def _state(self) -> str:
        return " released" if self.released else ""

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return (f"<Buffer{label} #{self.id} {self.usage_kind} "
                f"{describe(self.dtype, self.shape)}{self._state()}>")
