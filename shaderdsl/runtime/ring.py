"""The uniform ring: plain values given to uniform bindings, one per dispatch.

``queue.write_buffer`` lands before the whole submit, so rewriting one uniform
buffer between the dispatches of a batch would give every dispatch the last
value. Instead each dispatch's value gets its own slot in a ring buffer, at an
offset aligned to ``min-uniform-buffer-offset-alignment``, bound with a
dynamic offset (one bind group, one pipeline, whatever the values). The used
part of the ring is written once, just before the submit that reads it.
"""
from __future__ import annotations

import wgpu

from .buffers import next_id

RING_USAGE = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
INITIAL_SLOTS = 64
MAX_CHUNK_BYTES = 1 << 24   # a batch needing more gets several buffers, not one huge one
BINDING_BYTES = 16          # every uniform (a scalar or a vector) fits 16 bytes


class Chunk:
    """One GPU buffer of the ring and its host copy. ``id`` comes from the
    buffers' counter, so the bind-group cache can forget it like a Buffer."""

    __slots__ = ("id", "_wgpu_buffer", "host", "used", "seen")

    def __init__(self, wgpu_device, size: int):
        self.id = next_id()
        self._wgpu_buffer = wgpu_device.create_buffer(label="shaderdsl uniform ring", size=size,
                                                     usage=RING_USAGE)
        self.host = bytearray(size)
        self.used = 0
        self.seen: dict = {}  # bytes -> offset: equal values in one submit share a slot

    @property
    def size(self) -> int:
        return len(self.host)


class UniformRing:
    """The values of the dispatches recorded since the last submit.

    Offsets start again at 0 after each submit: a write issued after a submit
    is ordered after it on the queue, so the next batch may reuse the slots.
    A batch that outgrows the buffer continues in a new, larger one (work
    already recorded keeps pointing at the old); after the submit the ring is
    one buffer of the combined size, so the next such batch needs no growth.
    """

    def __init__(self, wgpu_device, stats: dict, alignment: int, forget, max_bytes: int):
        self.wgpu_device = wgpu_device
        self.stats = stats
        self.stride = max(alignment, BINDING_BYTES)  # a slot per value
        self.forget = forget       # called with a chunk id when its buffer is dropped
        cap = min(MAX_CHUNK_BYTES, max_bytes)
        self.max_chunk = max(self.stride, cap - cap % self.stride)
        self.full: list[Chunk] = []  # chunks filled earlier in this submit
        self.chunk = self._new(INITIAL_SLOTS * self.stride)

    @property
    def slots(self) -> int:
        """Values the ring holds before it needs another buffer."""
        return self.chunk.size // self.stride

    @property
    def pending(self) -> int:
        """Bytes of values waiting for the next submit."""
        return self.chunk.used + sum(c.used for c in self.full)

    def _new(self, size: int) -> Chunk:
        self.stats["ring_buffers"] += 1
        return Chunk(self.wgpu_device, min(size, self.max_chunk))

    def place(self, values: list[bytes]) -> list[int]:
        """Offsets of ``values``, all in ``self.chunk`` (bind it after this call)."""
        need = len(values) * self.stride
        chunk = self.chunk
        if chunk.used + need > chunk.size:
            self.full.append(chunk)
            chunk = self.chunk = self._new(max(2 * chunk.size, need))
        offsets = []
        for data in values:
            off = chunk.seen.get(data)
            if off is None:
                off = chunk.seen[data] = chunk.used
                chunk.host[off:off + len(data)] = data
                chunk.used = off + self.stride
            offsets.append(off)
        return offsets

    def upload(self, queue) -> None:
        """Write the used part of every chunk; called right before the submit."""
        for chunk in (*self.full, self.chunk):
            if chunk.used:
                queue.write_buffer(chunk._wgpu_buffer, 0, memoryview(chunk.host)[:chunk.used])
                self.stats["ring_writes"] += 1
        self.reset()

    def reset(self) -> None:
        """Start again at offset 0; merge the chunks of an outgrown ring into one."""
        if self.full:
            size = sum(c.size for c in self.full) + self.chunk.size
            for chunk in (*self.full, self.chunk):
                self.forget(chunk.id)
            self.full = []
            self.chunk = self._new(size)
        else:
            self.chunk.used = 0
            self.chunk.seen.clear()
