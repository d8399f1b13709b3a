"""Buffers of the interpreter's Device: numpy memory on the host.

A Buffer keeps the bytes a GPU buffer of the same shape would have, padded
the same way (to 4 bytes, uniforms to 16: ``HostDevice`` sizes it), so
``arrayLength``, copies and size checks see what they see on a GPU. The
checks themselves are the GPU runtime's (``shaderdsl.checks``), through the
DeviceBuffer interface.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..devicebuffer import DeviceBuffer

_ids = itertools.count(1)


class Buffer(DeviceBuffer):
    """Host memory with the numpy shape/dtype it was made for; ``array`` is a
    live view of the contents."""

    __slots__ = ("device", "memory", "shape", "dtype", "nbytes", "size", "id", "usage_kind",
                 "name", "freed", "__weakref__")

    def __init__(self, device, shape: tuple, dtype: np.dtype, usage_kind: str, padded: int,
                 name: str | None = None):
        self._describe(device, shape, dtype, usage_kind, name, _ids)
        self.memory = np.zeros(padded, np.uint8)
        self.freed = False

    def free(self) -> None:
        """Drop the memory (``device.release``)."""
        self.memory = np.zeros(0, np.uint8)
        self.freed = True

    @property
    def released(self) -> bool:
        return self.freed

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
