"""The Device: buffers, dispatch, copies, reads on one wgpu device.

``get_device()`` picks the best adapter (``shaderdsl.runtime.adapters``),
asks for every feature the DSL can use and the adapter's maximum limits, and
caches the result so every part of a program shares one device and one
pipeline cache. A device destroyed or lost is refused (DeviceLostError) and
``get_device()`` then opens a fresh one.
"""
from __future__ import annotations

import os
import re
import threading
import weakref

import numpy as np
import wgpu

from .. import checks
from ..errors import DeviceLostError, NoAdapterError, ShaderDSLError
from ..hostdevice import HostDevice, call_live, locked
from ..types import SUBGROUP_MATRIX_FEATURE
from .adapters import (
    DAWN_NAMES,
    MAX_LIMITS,
    WANTED_FEATURES,
    Limits,
    adapters_with,
    all_adapters,
    matrix_configs,
    norm_backend,
    pick,
    unopened,
)
from .batch import Batch, Recorder
from .buffers import STORAGE_USAGE, UNIFORM_USAGE, Buffer, padded_bytes
from .pipelines import PipelineCache
from .readback import map_read
from .ring import BINDING_BYTES, UniformRing
from .wgpu_build import WGPU_BUILD

_devices: dict = {}
_devices_lock = threading.Lock()  # two threads asking at once get one device

# What wgpu-native ("Parent device is lost") and Dawn ("[Device] is lost") say.
_LOST_MESSAGE = re.compile(r"device\b.*\bis lost|device (was )?lost", re.IGNORECASE)


def get_device(backend: str | None = None, adapter: str | None = None, *,
               features=None) -> "Device":
    """The shared Device for (backend, adapter name substring, extra features).

    ``backend`` defaults to env SHADERDSL_BACKEND, ``adapter`` to
    SHADERDSL_ADAPTER; ``features`` are required on top of the ones requested
    whenever present (WANTED_FEATURES), and steer the adapter choice. A
    device that was lost is forgotten here: the next call opens a fresh one.
    """
    backend = norm_backend(backend if backend is not None else os.environ.get("SHADERDSL_BACKEND"))
    adapter = adapter if adapter is not None else (os.environ.get("SHADERDSL_ADAPTER") or None)
    feats = frozenset(features or ())
    key = (backend, adapter.lower() if adapter else None, feats)
    dev = _devices.get(key)
    if dev is not None and not dev.lost:
        return dev
    with _devices_lock:
        for k in [k for k, d in _devices.items() if d.lost]:
            del _devices[k]
        dev = _devices.get(key)
        if dev is None:
            chosen = pick(all_adapters(), backend, adapter, feats)
            ident = (chosen.info["device"], chosen.info["backend_type"])
            # One device per adapter where possible: reuse one that has the features.
            dev = next((d for d in _devices.values()
                        if (d.name, d.backend) == ident and feats <= d.features), None)
            _devices[key] = dev = dev or Device(unopened(chosen), feats)
    return dev


def _lost_reason(wgpu_device, poll: bool) -> str | None:
    """Why the wgpu device cannot be used, or None while it can. Dawn resolves
    its ``lost`` promise when its events are processed (``poll``: now);
    wgpu-native has none, but stops the device's poller when it is destroyed
    (a device lost otherwise is seen at the next call that fails)."""
    promise = getattr(wgpu_device, "_lost_promise", None)
    if promise is not None:
        if poll and getattr(promise, "_state", "pending") == "pending":
            wgpu_device._poll()
        if getattr(promise, "_state", "pending") == "pending":
            return None
        info = getattr(promise, "_value", None)
        return f"{getattr(info, 'reason', 'lost')}: {getattr(info, 'message', '')}".strip(": ")
    if getattr(wgpu_device, "_poller", True) is None:
        return "destroyed"
    return None


class _KernelEntry:
    """Per-Kernel-object state: names in binding order, pipelines, validated bindings."""

    __slots__ = ("names", "count", "pipelines", "bound", "okeys", "uniforms", "dynamic",
                 "valued")

    def __init__(self, kernel):
        self.names = tuple(b.name for b in kernel.bindings)
        self.count = len(self.names)
        self.pipelines: dict = {}  # overrides key -> pipeline
        self.bound: dict = {}      # (buffer ids, overrides key) -> (pipeline, bind group)
        self.okeys: dict = {}      # tuple(overrides.items()) -> checked overrides key
        # Positions of the uniform bindings, in binding-number order (dynamic offsets' order).
        self.uniforms = tuple(sorted((i for i, b in enumerate(kernel.bindings)
                                      if b.access == "uniform"),
                                     key=lambda i: kernel.bindings[i].index))
        self.dynamic: dict = {}    # overrides key -> pipeline of the dynamic-offset layout
        self.valued: dict = {}     # (ids, None for values; overrides key) -> _Valued


class _Valued:
    """A checked combination dispatched with uniform values: its pipeline, and
    its bind group for the ring buffer ``chunk_id`` (remade when the ring grows)."""

    __slots__ = ("pipeline", "group", "chunk_id")

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.group = None
        self.chunk_id: int | None = None


class Device(HostDevice):
    """One wgpu device with its caches, the open batch and counters in ``stats``."""

    _captures_itself = True  # its recorder keeps (pipeline, bind group, grid) of a capture

    def __init__(self, adapter, extra_features=frozenset()):
        super().__init__("ring_buffers", "ring_writes")
        self.wgpu_adapter = adapter
        info = adapter.info
        self.name: str = info["device"]
        self.backend: str = info["backend_type"]
        self.adapter_type: str = info["adapter_type"]
        # Dawn spells the subgroup feature "subgroups"; kernels say "subgroup".
        native = {DAWN_NAMES.get(f, f): f for f in adapter.features}
        wanted = sorted({native[f] for f in set(WANTED_FEATURES) | set(extra_features)
                         if f in native})
        alimits = adapter.limits
        limits = {k: alimits[k] for k in MAX_LIMITS if k in alimits}
        try:
            self.wgpu_device = adapter.request_device_sync(
                label=f"shaderdsl:{self.name}", required_features=wanted, required_limits=limits)
        except Exception as e:  # wgpu raises plain errors here ("Parent device is lost")
            raise NoAdapterError(f"adapter {self.name!r} ({self.backend}) is listed but cannot "
                                 f"open a device: {e}. Pick another with SHADERDSL_BACKEND / "
                                 f"SHADERDSL_ADAPTER (python -m shaderdsl adapters lists them)") \
                from e
        self.queue = self.wgpu_device.queue
        self.features: frozenset = frozenset(DAWN_NAMES.get(f, f)
                                             for f in self.wgpu_device.features)
        # the shapes of subgroup matrices kernels may use (none without the feature)
        self.subgroup_matrix_configs = matrix_configs(adapter) \
            if SUBGROUP_MATRIX_FEATURE in self.features else ()
        self.limits: Limits = Limits(self.wgpu_device.limits)
        self.timestamp_period: float = _timestamp_period(self.queue)
        self._cache = PipelineCache(self.wgpu_device, self.stats, owner=self)
        self.uniform_ring = UniformRing(
            self.wgpu_device, self.stats, self.limits["min-uniform-buffer-offset-alignment"],
            self._cache.forget_buffer, self.limits["max-buffer-size"])
        self._recorder = Recorder(self.wgpu_device, self.stats, self.uniform_ring,
                                  self._check_submit)
        self._max_wg = self.limits["max-compute-workgroups-per-dimension"]
        self._sync_buffer = None
        self._staging = None  # MAP_READ buffer reused by read()

    def __repr__(self) -> str:
        return f"<Device {self.name!r} {self.backend} {self.adapter_type}>"

    @staticmethod
    def adapters_with(feature: str) -> list[str]:
        """Adapters on this machine that have ``feature`` (named in FeatureError)."""
        return adapters_with(feature)

    # -- a lost device -----------------------------------------------------

    @property
    def lost(self) -> bool:
        """Whether the wgpu device was destroyed or lost (nothing runs on it again)."""
        if self._lost is None:
            with self.lock:  # (Dawn's events are processed by one thread at a time)
                self._lost = _lost_reason(self.wgpu_device, poll=True)
        return self._lost is not None

    def destroy(self) -> None:
        """Destroy the wgpu device now: its memory is freed, every later call
        raises DeviceLostError and ``get_device()`` opens a fresh device."""
        with self.lock:
            self._recorder.discard(lost=True)
            self._lost = self._lost or "destroyed by Device.destroy()"
            self.wgpu_device.destroy()

    def _check_live(self) -> None:
        """Raise once the device is known to be lost (every call asks: cheap)."""
        if self._lost is not None:
            self._recorder.discard(lost=True)
            raise DeviceLostError(f"{self!r} was lost ({self._lost}): nothing more runs on it, "
                                  f"and its buffers, weights and plans are gone. Get a fresh "
                                  f"device with shaderdsl.runtime.get_device() and make them "
                                  f"again on it")

    def _check_submit(self) -> None:
        """Look for a loss before a submit: wgpu-native aborts the process at a
        submit on a lost device (Dawn does not: its events are not processed
        for this, so a submit costs no more)."""
        if self._lost is None:
            self._lost = _lost_reason(self.wgpu_device, poll=False)
        self._check_live()

    def _lost_error(self, err: Exception) -> DeviceLostError | None:
        if isinstance(err, ShaderDSLError) or not (self.lost or _LOST_MESSAGE.search(str(err))):
            return None
        self._lost = self._lost or str(err).strip().splitlines()[-1].strip()
        try:
            self._check_live()
        except DeviceLostError as lost:
            return lost
        return None

    # -- the device's part of the host API (HostDevice checks first) -------

    def _alloc(self, shape, dtype, kind: str, name, data, size: int) -> Buffer:
        usage = UNIFORM_USAGE if kind == "uniform" else STORAGE_USAGE
        if data is None:
            wbuf = self.wgpu_device.create_buffer(label=name or "", size=size, usage=usage)
        else:
            wbuf = self.wgpu_device.create_buffer_with_data(
                label=name or "", data=padded_bytes(data, size), usage=usage)
        buf = Buffer(self, wbuf, shape, dtype, kind, name)
        weakref.finalize(buf, self._cache.forget_buffer, buf.id)
        return buf

    def _write(self, buf: Buffer, array) -> None:
        arr = np.ascontiguousarray(array)
        self._recorder.flush()  # queue writes jump ahead of unsubmitted commands
        self.queue.write_buffer(buf._wgpu_buffer, 0, padded_bytes(arr, buf._wgpu_buffer.size))

    def _read(self, buf: Buffer) -> np.ndarray:
        """Submits recorded work and waits. The copy into a reused staging
        buffer joins the commands recorded so far, so ``record; read`` inside
        a batch costs one submit and one wait (``readback.map_read``: no extra
        submit, no polling thread)."""
        size = buf._wgpu_buffer.size
        self._recorder.copy(buf._wgpu_buffer, self._staging_for(size), size)
        self._recorder.flush()
        raw = self._map_staging(size)
        return np.frombuffer(raw, buf.dtype, count=buf.size).reshape(buf.shape)

    def _staging_for(self, size: int):
        """The reused MAP_READ buffer, grown to hold ``size`` bytes."""
        if self._staging is None or self._staging.size < size:
            self._staging = self.wgpu_device.create_buffer(
                size=max(size, 4096), usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        return self._staging

    def _map_staging(self, size: int) -> memoryview:
        """A copy of the staging buffer's first ``size`` bytes (its copy submitted)."""
        staging = self._staging_for(size)
        map_read(self.wgpu_device, staging, size)
        try:
            return staging.read_mapped(0, size)
        finally:
            staging.unmap()

    def _release(self, buf: Buffer) -> None:
        """Destroy ``buf`` and drop every cached bind group that holds it (on
        a lost device, only forget it: nothing is submitted there again)."""
        if not self.lost:
            call_live(self, self._recorder.flush)  # recorded commands may still use it
        self._cache.forget_buffer(buf.id)
        wbuf, buf._wgpu_buffer = buf._wgpu_buffer, None
        if not self.lost:
            wbuf.destroy()

    def clear_pipeline_cache(self) -> int:
        """Drop every compiled module, pipeline and bind group, and each
        kernel's entry holding them (a kernel dispatched later is checked and
        compiled again); the number of pipelines dropped. On a lost device it
        only lets them go (nothing recorded can run there any more)."""
        with self.lock:
            if not self.lost:
                self._recorder.flush()  # recorded commands may still use them
            self._kernels.clear()
            return self._cache.clear()

    def _copy(self, src: Buffer, dst: Buffer, nbytes: int) -> None:
        self._recorder.copy(src._wgpu_buffer, dst._wgpu_buffer, nbytes)
        if self._capture is not None:
            self._capture.buffers += [src, dst]
        if not self._depth:
            self._recorder.flush()

    # -- dispatch --------------------------------------------------------

    @locked
    def dispatch(self, kernel, bindings, workgroups, *, overrides=None) -> None:
        """Run ``kernel`` over ``workgroups`` (``HostDevice.dispatch``); a plain
        value given to a uniform binding goes into the uniform ring, so every
        dispatch of a batch sees its own value with one pipeline.

        A (kernel, buffers, overrides) combination dispatched before was
        checked then: it is looked up with its bind group (a few dict
        lookups); anything else goes through HostDevice.dispatch's checks.
        """
        entry = self._kernels.get(id(kernel))
        grid = _plain_grid(workgroups, self._max_wg)
        if entry is None or grid is None:
            return super().dispatch(kernel, bindings, workgroups, overrides=overrides)
        okey = self._okey(entry, kernel, overrides)
        try:
            if type(bindings) is dict:
                if len(bindings) != entry.count:
                    raise KeyError
                ids = tuple([bindings[n].id for n in entry.names])
            else:
                ids = tuple([b.id for b in bindings])
            pipeline, group = entry.bound[ids, okey]
        except (KeyError, AttributeError, TypeError):
            if not (entry.valued and self._dispatch_valued(entry, kernel, bindings, grid, okey)):
                super().dispatch(kernel, bindings, workgroups, overrides=overrides)
            return
        self.stats["dispatches"] += 1
        self._recorder.dispatch(pipeline, group, *grid)
        if self._capture is not None:
            self._capture.buffers.extend(bindings.values() if type(bindings) is dict
                                         else bindings)
        if not self._depth:
            self._recorder.flush()

    def _dispatch_valued(self, entry, kernel, bindings, grid, okey) -> bool:
        """A dispatch with uniform values whose Buffers were checked before:
        record it (True); False if they were not."""
        buffers = checks.order_buffers(kernel, bindings)
        values = checks.uniform_values(kernel, buffers)
        try:
            ids = tuple([None if i in values else b.id for i, b in enumerate(buffers)])
            hit = entry.valued[ids, okey]
        except (KeyError, AttributeError):
            return False
        self._record_valued(hit, kernel, entry, buffers, values, grid)
        return True

    def _dispatch(self, kernel, entry, buffers, values, grid, okey) -> None:
        """A checked combination not seen yet: make its pipeline and bind group,
        remember them, record the dispatch."""
        if self._capture is not None:
            self._capture.buffers.extend(b for b in buffers if isinstance(b, Buffer))
        if values:
            hit = _Valued(self._dynamic_pipeline(entry, kernel, okey))
            ids = tuple([None if i in values else b.id for i, b in enumerate(buffers)])
            kept = [b for i, b in enumerate(buffers) if i not in values]
            self._cache.remember(entry.valued, (ids, okey), hit, kept)
            self._record_valued(hit, kernel, entry, buffers, values, grid)
            return
        pipeline = self._pipeline(entry, kernel, okey)
        group = self._cache.bind_group(kernel, buffers)
        key = (tuple(b.id for b in buffers), okey)
        self._cache.remember(entry.bound, key, (pipeline, group), buffers)
        self.stats["dispatches"] += 1
        self._recorder.dispatch(pipeline, group, *grid)
        if not self._depth:
            self._recorder.flush()

    def _record_valued(self, hit, kernel, entry, buffers, values, grid) -> None:
        """Pack the uniform values into the ring, bind it (a new bind group when
        the ring grew) and record the dispatch at the values' offsets."""
        ring = self.uniform_ring
        placed = iter(ring.place([v.tobytes() for v in values.values()]))
        chunk = ring.chunk
        if hit.chunk_id != chunk.id:
            resources = [(chunk, BINDING_BYTES) if i in values else (b, b._wgpu_buffer.size)
                         for i, b in enumerate(buffers)]
            hit.group = self._cache.dynamic_group(kernel, resources)
            hit.chunk_id = chunk.id
        offsets = [next(placed) if i in values else 0 for i in entry.uniforms]
        self.stats["dispatches"] += 1
        self._recorder.dispatch_at(hit.pipeline, hit.group, offsets, *grid)
        if not self._depth:
            self._recorder.flush()

    def _new_entry(self, kernel) -> _KernelEntry:
        """First sight of a Kernel object: compile its module."""
        self._cache.module(kernel)
        return _KernelEntry(kernel)

    def _prepare(self, kernel, entry, okey: tuple, uniform_values: bool) -> None:
        if uniform_values:
            self._dynamic_pipeline(entry, kernel, okey)
        else:
            self._pipeline(entry, kernel, okey)

    def _okey(self, entry, kernel, overrides) -> tuple:
        """``checks.overrides_key``, remembered per overrides given."""
        try:
            raw = tuple(overrides.items()) if overrides else ()
            okey = entry.okeys.get(raw)
        except (AttributeError, TypeError):
            raw = okey = None
        if okey is None:
            okey = checks.overrides_key(kernel, overrides)
            if raw is not None:
                entry.okeys[raw] = okey
        return okey

    def _pipeline(self, entry, kernel, okey):
        pipeline = entry.pipelines.get(okey)
        if pipeline is None:
            pipeline = entry.pipelines[okey] = self._cache.pipeline(kernel, okey)
        return pipeline

    def _dynamic_pipeline(self, entry, kernel, okey):
        """The pipeline of the dynamic-offset layout (uniforms given values)."""
        pipeline = entry.dynamic.get(okey)
        if pipeline is None:
            pipeline = entry.dynamic[okey] = self._cache.pipeline(kernel, okey, dynamic=True)
        return pipeline

    # -- captures ----------------------------------------------------------

    def _begin_capture(self, capture) -> None:
        self._recorder.capture = capture

    def _end_capture(self) -> None:
        self._recorder.capture = None

    def _replay(self, capture) -> None:
        self._recorder.replay(capture.commands)
        self.stats["dispatches"] += sum(1 for c in capture.commands if c[0] is not None)
        self.stats["copies"] += sum(1 for c in capture.commands if c[0] is None)
        if not self._depth:
            self._recorder.flush()

    # -- batching and waiting --------------------------------------------

    def batch(self, timestamps: bool = False) -> Batch:
        """``with device.batch():`` records every dispatch/copy into one submit."""
        return Batch(self, timestamps)

    @locked
    def sync(self) -> None:
        """Submit anything recorded and wait until the GPU has finished all of it.

        (``queue.on_submitted_work_done_sync`` is broken in wgpu-py 0.32.0; a
        tiny read waits just as well, since the queue runs in order. Its copy
        goes out in a submit of its own, not counted in ``stats``.)
        """
        self._recorder.flush()
        self._check_submit()
        if self._sync_buffer is None:
            self._sync_buffer = self.wgpu_device.create_buffer(
                size=4, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
        encoder = self.wgpu_device.create_command_encoder()
        encoder.copy_buffer_to_buffer(self._sync_buffer, 0, self._staging_for(4), 0, 4)
        self.queue.submit([encoder.finish()])
        self._map_staging(4)


def _plain_grid(workgroups, max_wg: int) -> tuple | None:
    """(x, y, z) of an int or a 3-tuple of ints, each in 1..max_wg; None for
    anything else (``checks.workgroups`` then normalises it or says why not)."""
    if type(workgroups) is int:
        return (workgroups, 1, 1) if 0 < workgroups <= max_wg else None
    if type(workgroups) is tuple and len(workgroups) == 3:
        x, y, z = workgroups
        if type(x) is type(y) is type(z) is int and 0 < x <= max_wg and 0 < y <= max_wg and \
                0 < z <= max_wg:
            return workgroups
    return None


def _timestamp_period(queue) -> float:
    """Nanoseconds per timestamp tick; wgpu-py has no wrapper, so ask wgpu-native.
    Dawn already reports nanoseconds (and calling into it here breaks its
    event handling: buffer maps never complete)."""
    if WGPU_BUILD == "dawn":
        return 1.0
    try:
        from wgpu.backends.wgpu_native._ffi import lib

        # cffi's functions of wgpu-native's header: not in wgpu-py's stubs
        period = float(getattr(lib, "wgpuQueueGetTimestampPeriod")(queue._internal))
    except Exception:
        return 1.0
    return period if period > 0 else 1.0
