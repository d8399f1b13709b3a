"""Command recording: one encoder and one compute pass per batch, one submit.

Submitting is the expensive part of a dispatch, so a batch records every
dispatch into one compute pass (closing it only for copies) and submits once
at the end, after writing the uniform ring's values (``ring``) in one go.
Timestamps, when asked for and supported, are written by the passes
themselves (``timestampWrites``): the first pass writes the start, every pass
writes the end, so the last one executed leaves the batch's end time.
"""
from __future__ import annotations

import numpy as np
import wgpu

from ..hostdevice import Capture, HostBatch, call_live

_TS_START = {"beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}
_TS_END = {"end_of_pass_write_index": 1}


class Recorder:
    """The open command encoder and compute pass of a device (lazily created)."""

    __slots__ = ("wgpu_device", "queue", "stats", "ring", "live", "encoder", "cpass",
                 "pipeline", "recorded", "query_set", "started", "capture")

    def __init__(self, wgpu_device, stats: dict, ring, live):
        self.wgpu_device = wgpu_device
        self.queue = wgpu_device.queue
        self.stats = stats
        self.ring = ring          # the uniform ring: its values are written before each submit
        self.live = live          # raises DeviceLostError on a lost device
        self.encoder = None
        self.cpass = None
        self.pipeline = None      # last pipeline set on the open pass
        self.recorded = False     # anything not yet submitted?
        self.query_set = None     # set while a timed batch is open
        self.started = False      # has the start timestamp been recorded?
        self.capture: Capture | None = None  # kept while device.capture() is open

    def command_encoder(self):
        """The open command encoder, beginning one if needed."""
        if self.encoder is None:
            self.encoder = self.wgpu_device.create_command_encoder()
        return self.encoder

    def compute_pass(self):
        """The open compute pass, beginning one (and an encoder) if needed."""
        if self.cpass is None:
            encoder = self.command_encoder()
            if self.query_set is None:
                self.cpass = encoder.begin_compute_pass()
            else:
                writes = dict(_TS_END if self.started else _TS_START, query_set=self.query_set)
                self.started = True
                self.cpass = encoder.begin_compute_pass(timestamp_writes=writes)
                self.recorded = True  # its timestamps must be submitted, even if empty
            self.pipeline = None
        return self.cpass

    def dispatch(self, pipeline, bind_group, x: int, y: int, z: int) -> None:
        cpass = self.cpass or self.compute_pass()
        if pipeline is not self.pipeline:
            cpass.set_pipeline(pipeline)
            self.pipeline = pipeline
        cpass.set_bind_group(0, bind_group)
        cpass.dispatch_workgroups(x, y, z)
        self.recorded = True
        if self.capture is not None:
            self.capture.commands.append((pipeline, bind_group, x, y, z))

    def replay(self, commands: list) -> None:
        """Record captured commands again: a dispatch (pipeline, bind group, x,
        y, z) or a copy (None, source, destination, bytes). The loop is the
        dispatch above without its checks, for the many of a captured graph."""
        cpass, current = self.cpass, self.pipeline
        for pipeline, a, b, c, d in commands:
            if pipeline is None:
                self.copy(a, b, c)
                cpass = current = None
                continue
            if cpass is None:
                cpass, current = self.compute_pass(), None
            if pipeline is not current:
                cpass.set_pipeline(pipeline)
                current = pipeline
            cpass.set_bind_group(0, a)
            cpass.dispatch_workgroups(b, c, d)
        self.pipeline = current if self.cpass is not None else None
        self.recorded = self.recorded or bool(commands)

    def dispatch_at(self, pipeline, bind_group, offsets: list, x: int, y: int, z: int) -> None:
        """A dispatch whose uniforms sit at dynamic ``offsets`` (the uniform ring)."""
        cpass = self.cpass or self.compute_pass()
        if pipeline is not self.pipeline:
            cpass.set_pipeline(pipeline)
            self.pipeline = pipeline
        cpass.set_bind_group(0, bind_group, offsets)
        cpass.dispatch_workgroups(x, y, z)
        self.recorded = True
        if self.capture is not None:
            self.capture.refused = self.capture.refused or \
                "a dispatch was given uniform values (they were that call's)"

    def copy(self, src, dst, nbytes: int) -> None:
        self.end_pass()
        self.command_encoder().copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
        self.recorded = True
        if self.capture is not None:
            self.capture.commands.append((None, src, dst, nbytes, None))

    def end_pass(self) -> None:
        if self.cpass is not None:
            self.cpass.end()
            self.cpass = None
            self.pipeline = None

    def flush(self) -> None:
        """Submit whatever is recorded; the next command starts a new encoder.
        Not on a lost device: wgpu-native aborts the process at such a submit."""
        if self.encoder is not None:
            self.live()
        self.end_pass()
        if self.encoder is not None:
            encoder, self.encoder = self.encoder, None
            if self.recorded:
                self.recorded = False
                if self.ring.pending:
                    self.ring.upload(self.queue)
                self.queue.submit([encoder.finish()])
                self.stats["submits"] += 1

    def finish_timed(self, resolve_buffer) -> None:
        """Record the end timestamp after all work, resolve, and submit."""
        if self.cpass is None:  # last command was a copy (or nothing): an empty timed pass
            self.compute_pass()
        self.end_pass()
        self.command_encoder().resolve_query_set(self.query_set, 0, 2, resolve_buffer, 0)
        self.recorded = True
        self.query_set = None
        self.started = False
        self.flush()

    def discard(self, lost: bool = False) -> None:
        """Drop unsubmitted commands: the batch body raised, or the device was
        ``lost`` (then no wgpu call at all: not even the open pass is ended)."""
        if not lost:
            self.end_pass()
        self.cpass = self.pipeline = None
        self.encoder = None
        self.recorded = False
        self.query_set = None
        self.started = False
        if not lost:
            self.ring.reset()


class Batch(HostBatch):
    """Context manager from ``device.batch()``; nested batches join the outer one.

    ``gpu_time_ns`` (timestamps=True, outermost batch, device with
    "timestamp-query") is the GPU time from the start of the first pass to the
    end of the last one, read lazily on first access; otherwise None.
    """

    def __init__(self, device, timestamps: bool = False):
        super().__init__(device, timestamps)
        self._resolve = None
        self._time = None

    def _begin(self) -> None:
        dev = self.device
        dev._recorder.flush()  # nothing should be pending, but keep order if it is
        if self.timestamps and dev.has_feature("timestamp-query"):
            wd = dev.wgpu_device
            dev._recorder.query_set = wd.create_query_set(type="timestamp", count=2)
            self._resolve = wd.create_buffer(
                size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            dev._recorder.compute_pass()  # start stamp before anything, copies included

    def _end(self) -> None:
        if self._resolve is not None:
            self.device._recorder.finish_timed(self._resolve)
        else:
            self.device._recorder.flush()

    def _drop(self) -> None:
        self.device._recorder.discard()
        self._resolve = None

    def flush(self) -> None:
        """Submit what is recorded so far (the batch stays open)."""
        with self.device.lock:
            call_live(self.device, self.device._recorder.flush)

    @property
    def gpu_time_ns(self) -> float | None:
        if self._time is None and self._resolve is not None:
            if self._open:
                raise RuntimeError("gpu_time_ns is known only after the batch exits")
            dev = self.device
            with dev.lock:
                dev._check_submit()  # read_buffer submits a copy
                raw = call_live(dev, dev.wgpu_device.queue.read_buffer, self._resolve)
            start, end = np.frombuffer(raw, np.uint64)[:2].astype(np.int64)
            self._time = float(end - start) * self.device.timestamp_period
            self._resolve = None
        return self._time
