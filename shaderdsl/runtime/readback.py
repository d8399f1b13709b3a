"""Waiting for a buffer map with the least latency the wgpu build allows.

``map_sync`` in wgpu-py's wgpu-native backend submits an empty command
buffer before every read map (a workaround for wgpu-native#305, needed only
when no submit has happened since the buffer was last used) and waits on a
polling thread: two thread hand-offs. Dawn's waits block in the driver.
Both cost the operating system's wake-up latency on top of the GPU's work.

``map_read`` is called right after the copy into ``staging`` was submitted,
so it maps without the workaround ("READ_NOSYNC", which both builds take)
and polls the device from the calling thread without blocking until the map
is done (a busy wait: one core spins for the microseconds to milliseconds
the GPU still needs). Both are private to wgpu-py 0.32 and wgpudawn; where a
build lacks ``_poll`` it falls back to ``map_sync``.
Measurements: docs/optimisation-notes.md, note 25.
"""
from __future__ import annotations

import wgpu


def map_read(wgpu_device, staging, size: int) -> None:
    """Map ``staging`` (the copy into it already submitted) for reading."""
    poll = getattr(wgpu_device, "_poll", None)  # both builds: process finished work, no wait
    if poll is None:
        staging.map_sync(wgpu.MapMode.READ, 0, size)
        return
    promise = staging.map_async("READ_NOSYNC", 0, size)
    while getattr(promise, "_state", "done") == "pending":  # until the callback has run
        poll()
    promise.sync_wait()  # resolves it (and raises if the map failed)
