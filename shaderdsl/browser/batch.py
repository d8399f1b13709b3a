"""``device.batch()`` for the browser device: the dispatches and copies
recorded inside go to the page in one call and one submit at the end (or at
a read, write or release inside, which sends what is recorded first).

With ``timestamps=True`` on an adapter with timestamp-query, the page's
compute passes write a timestamp query (the first pass the start, every pass
the end), resolved when the batch ends: ``gpu_time_ns``, as on the GPU device.
"""
from __future__ import annotations

from ..hostdevice import HostBatch


class Batch(HostBatch):
    """Context manager from ``device.batch()``; nested batches join the outer one."""

    def __init__(self, device, timestamps: bool = False):
        super().__init__(device, timestamps)
        self.gpu_time_ns: float | None = None
        self._timed = False

    def _begin(self) -> None:
        dev = self.device
        dev._send()
        self._timed = self.timestamps and dev.has_feature("timestamp-query")
        if self._timed:
            dev._ops.append({"op": "timer_begin"})

    def _drop(self) -> None:
        """Drop what was not sent; stop a timer that was."""
        dev = self.device
        sent = self._timed and not any(op["op"] == "timer_begin" for op in dev._ops)
        dev._ops = [{"op": "timer_drop"}] if sent else []

    def _end(self) -> None:
        dev = self.device
        if self._timed:
            dev._ops.append({"op": "timer_end"})
        out = dev._send()
        if self._timed:
            self.gpu_time_ns = out.get("time_ns")

    def flush(self) -> None:
        """Send what is recorded so far (the batch stays open)."""
        with self.device.lock:
            self.device._send()
