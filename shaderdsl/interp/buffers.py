"""Buffers of the interpreter's Device: numpy memory on the host.

A Buffer keeps the bytes a GPU buffer of the same shape would have, padded
the same way (to 4 bytes, uniforms to 16), so ``arrayLength``, copies and
size checks see what they see on a GPU. The checks themselves are the GPU
runtime's (``shaderdsl.checks``), through the DeviceBuffer interface.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..devicebuffer import DeviceBuffer

_ids = itertools.count(1)


def padded_size(nbytes: int, multiple: int = 4) -> int:
    """WebGPU's buffer sizes: multiples of 4 (16 for uniforms), at least one."""
    return max(multiple, -(-nbytes // multiple) * multiple)


class Buffer(DeviceBuffer):
    """Host memory with the numpy shape/dtype it was made for; ``array`` is a
    live view of the contents."""

    __slots__ = ("device", "memory", "shape", "dtype", "nbytes", "size", "id", "usage_kind",
                 "name", "__weakref__")

    def __init__(self, device, array: np.ndarray, usage_kind: str, name: str | None = None):
        self._describe(device, array.shape, array.dtype, usage_kind, name, _ids)
        self.memory = np.zeros(padded_size(self.nbytes, 16 if usage_kind == "uniform" else 4),
                               np.uint8)
        self.memory[:self.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    @property
    def released(self) -> bool:
        return self.memory is None

    @property
    def bound_bytes(self) -> int:
        return self.memory.size

    @property
    def array(self) -> np.ndarray:
        """The contents as a view shaped like the buffer (writes go through)."""
        return self.memory[:self.nbytes].view(self.dtype).reshape(self.shape)

    def elements(self) -> np.ndarray:
        """All of the (padded) memory as a flat array of the dtype: what a binding sees."""
        return self.memory.view(self.dtype)
