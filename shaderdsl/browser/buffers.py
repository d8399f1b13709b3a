"""Buffers of the browser device: a GPUBuffer in the page, named by an id.

The Python object keeps the numpy shape and dtype (for the shared checks in
``shaderdsl.checks``) and the browser generation it was made in: after the
browser is restarted (a hung kernel) the page's buffers are gone, and a
Buffer of an older generation reads as released, saying why.
"""
from __future__ import annotations

import base64
import itertools

import numpy as np

from ..devicebuffer import DeviceBuffer
from .page import Host

_ids = itertools.count(1)


CHUNK = 8 << 20  # bytes per call: the DevTools pipe slows down on messages much bigger


def encode(arr: np.ndarray, size: int) -> list[tuple[int, str]]:
    """(offset, base64) pieces of the array's raw bytes, zero-padded to
    ``size``, at most CHUNK bytes each: exact for every bit pattern (NaN
    payloads, infinities, -0.0)."""
    data = memoryview(arr.tobytes().ljust(size, b"\0"))
    return [(off, base64.b64encode(data[off:off + CHUNK]).decode("ascii"))
            for off in range(0, size, CHUNK)]


def decode(pieces: list[str], dtype: np.dtype, shape: tuple, count: int) -> np.ndarray:
    """A fresh, writable array from the page's base64 pieces."""
    raw = bytearray().join(base64.b64decode(p) for p in pieces)
    return np.frombuffer(raw, dtype, count=count).reshape(shape)


class Buffer(DeviceBuffer):
    """A GPUBuffer in the browser page with the numpy shape/dtype it was made for."""

    __slots__ = ("device", "shape", "dtype", "nbytes", "size", "id", "usage_kind", "name",
                 "padded", "host", "generation", "freed", "__weakref__")

    def __init__(self, device, shape: tuple, dtype: np.dtype, usage_kind: str, padded: int,
                 name: str | None = None):
        self._describe(device, shape, dtype, usage_kind, name, _ids)
        self.padded = padded
        self.host: Host = device.host
        self.generation = self.host.generation
        self.freed = False

    @property
    def lost(self) -> bool:
        """The browser was restarted since this buffer was made: its contents are gone."""
        return self.generation != self.host.generation

    @property
    def released(self) -> bool:
        return self.freed or self.lost

    @property
    def bound_bytes(self) -> int:
        return self.padded

    def _state(self) -> str:
        return " released" if self.freed else (
            " released (lost when the browser restarted)" if self.lost else "")
