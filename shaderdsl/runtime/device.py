"""The Device: buffers, dispatch, copies, reads on one wgpu device.

``get_device()`` picks the best adapter (``shaderdsl.runtime.adapters``),
asks for every feature the DSL can use and the adapter's maximum limits, and
caches the result so every part of a program shares one device and one
pipeline cache.
"""
from __future__ import annotations

import os
import weakref

import numpy as np
import wgpu

from .. import checks
from ..checks import check_dtype, host_array, uniform_array
from ..devicebuffer import DeviceBuffer
from ..errors import BindingError, NoAdapterError
from ..hostdevice import HostDevice
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
)
from .batch import Batch, Recorder
from .buffers import STORAGE_USAGE, UNIFORM_USAGE, Buffer, padded_bytes, padded_size
from .pipelines import PipelineCache
from .readback import map_read
from .ring import BINDING_BYTES, UniformRing
from .wgpu_build import WGPU_BUILD

_devices: dict = {}


def get_device(backend: str | None = None, adapter: str | None = None, *,
               features=None) -> "Device":
    """The shared Device for (backend, adapter name substring, extra features).

    ``backend`` defaults to env SHADERDSL_BACKEND, ``adapter`` to
    SHADERDSL_ADAPTER; ``features`` are required on top of the ones requested
    whenever present (WANTED_FEATURES), and steer the adapter choice.
    """
    backend = norm_backend(backend if backend is not None else os.environ.get("SHADERDSL_BACKEND"))
    adapter = adapter if adapter is not None else (os.environ.get("SHADERDSL_ADAPTER") or None)
    feats = frozenset(features or ())
    key = (backend, adapter.lower() if adapter else None, feats)
    dev = _devices.get(key)
    if dev is None:
        chosen = pick(all_adapters(), backend, adapter, feats)
        ident = (chosen.info["device"], chosen.info["backend_type"])
        # One device per adapter where possible: reuse one that has the features.
        dev = next((d for d in _devices.values()
                    if (d.name, d.backend) == ident and feats <= d.features), None)
        _devices[key] = dev = dev or Device(chosen, feats)
    return dev


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
        self.chunk_id = None


class Device(HostDevice):
    """One wgpu device with its caches, the open batch and counters in ``stats``."""

    def __init__(self, adapter, extra_features=frozenset()):
        self.wgpu_adapter = adapter
        info = adapter.info
        self.name: str = info["device"]
        self.backend: str = info["backend_type"]
        self.adapter_type: str = info["adapter_type"]
        # Dawn spells the subgroup feature "subgroups"; kernels say "subgroup".
        native = {DAWN_NAMES.get(f, f): f for f in adapter.features}
        wanted = sorted({native[f] for f in set(WANTED_FEATURES) | set(extra_features) if f in native})
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
        self.features: frozenset = frozenset(DAWN_NAMES.get(f, f) for f in self.wgpu_device.features)
        # the shapes of subgroup matrices kernels may use (none without the feature)
        self.subgroup_matrix_configs = matrix_configs(adapter) \
            if SUBGROUP_MATRIX_FEATURE in self.features else ()
        self.limits: Limits = Limits(self.wgpu_device.limits)
        self.timestamp_period: float = _timestamp_period(self.queue)
        self.stats = {"modules": 0, "pipelines": 0, "bind_groups": 0, "dispatches": 0,
                      "copies": 0, "submits": 0, "ring_buffers": 0, "ring_writes": 0}
        self._cache = PipelineCache(self.wgpu_device, self.stats)
        self.uniform_ring = UniformRing(
            self.wgpu_device, self.stats, self.limits["min-uniform-buffer-offset-alignment"],
            self._cache.forget_buffer, self.limits["max-buffer-size"])
        self._recorder = Recorder(self.wgpu_device, self.stats, self.uniform_ring)
        self._depth = 0
        self._kernels: dict[int, _KernelEntry] = {}
        self._max_wg = self.limits["max-compute-workgroups-per-dimension"]
        self._sync_buffer = None
        self._staging = None  # MAP_READ buffer reused by read()
        self._pinned: list = []

    def __repr__(self) -> str:
        return f"<Device {self.name!r} {self.backend} {self.adapter_type}>"

    @staticmethod
    def adapters_with(feature: str) -> list[str]:
        """Adapters on this machine that have ``feature`` (named in FeatureError)."""
        return adapters_with(feature)

    # -- buffers ---------------------------------------------------------

    def _new_buffer(self, size: int, usage, data=None, label: str = ""):
        cap = self.limits.get("max-buffer-size")
        if cap is not None and size > cap:
            raise BindingError(f"buffer of {size} bytes is over max-buffer-size = {cap} "
                               f"on {self.name!r}")
        if data is None:
            return self.wgpu_device.create_buffer(label=label, size=size, usage=usage)
        return self.wgpu_device.create_buffer_with_data(label=label, data=data, usage=usage)

    def _wrap(self, wbuf, shape, dtype, kind, name) -> Buffer:
        buf = Buffer(self, wbuf, shape, dtype, kind, name)
        weakref.finalize(buf, self._cache.forget_buffer, buf.id)
        return buf

    def buffer(self, array, *, name: str | None = None) -> Buffer:
        """A storage buffer holding a copy of ``array`` (float32/float16/int32/uint32)."""
        arr = host_array(array, f"buffer {name!r}" if name else "buffer")
        size = padded_size(arr.nbytes)
        wbuf = self._new_buffer(size, STORAGE_USAGE, padded_bytes(arr, size), name or "")
        return self._wrap(wbuf, arr.shape, arr.dtype, "storage", name)

    def empty(self, shape, dtype, *, name: str | None = None) -> Buffer:
        """A storage buffer of ``shape``/``dtype`` (WebGPU zero-fills it anyway)."""
        dt = check_dtype(dtype, f"buffer {name!r}" if name else "buffer")
        shape = checks.buffer_shape(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        wbuf = self._new_buffer(padded_size(nbytes), STORAGE_USAGE, label=name or "")
        return self._wrap(wbuf, shape, dt, "storage", name)

    def uniform(self, value, *, name: str | None = None) -> Buffer:
        """A uniform buffer from an array or scalar, padded to 16 bytes.

        Python float -> float32, Python int -> uint32; pass numpy scalars for others.
        """
        arr = uniform_array(value)
        size = padded_size(arr.nbytes, 16)
        wbuf = self._new_buffer(size, UNIFORM_USAGE, padded_bytes(arr, size), name or "")
        return self._wrap(wbuf, arr.shape, arr.dtype, "uniform", name)

    def write(self, buf: Buffer, array) -> None:
        """Overwrite ``buf``; dtype and shape must match it exactly."""
        self._own(buf, "write")
        array = checks.write_array(buf, array)
        arr = np.ascontiguousarray(array)
        self._recorder.flush()  # queue writes jump ahead of unsubmitted commands
        self.queue.write_buffer(buf.wgpu_buffer, 0, padded_bytes(arr, buf.wgpu_buffer.size))

    def read(self, buf: Buffer) -> np.ndarray:
        """A new array with ``buf``'s contents; submits recorded work and waits.

        The copy into a reused staging buffer joins the commands recorded so
        far, so ``record; read`` inside a batch costs one submit and one wait
        (``readback.map_read``: no extra submit, no polling thread).
        """
        self._own(buf, "read")
        size = buf.wgpu_buffer.size
        self._recorder.copy(buf.wgpu_buffer, self._staging_for(size), size)
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
        map_read(self.wgpu_device, self._staging, size)
        try:
            return self._staging.read_mapped(0, size)
        finally:
            self._staging.unmap()

    def _release(self, buf: Buffer) -> None:
        """Destroy ``buf`` and drop every cached bind group that holds it."""
        self._recorder.flush()  # recorded commands may still use it
        self._cache.forget_buffer(buf.id)
        wbuf, buf.wgpu_buffer = buf.wgpu_buffer, None
        wbuf.destroy()

    def _copy(self, src: Buffer, dst: Buffer, nbytes: int) -> None:
        self._recorder.copy(src.wgpu_buffer, dst.wgpu_buffer, nbytes)
        if not self._depth:
            self._recorder.flush()

    # -- dispatch --------------------------------------------------------

    def dispatch(self, kernel, bindings, workgroups, *, overrides=None) -> None:
        """Run ``kernel`` over ``workgroups`` (int or up to 3 ints).

        ``bindings``: dict name -> Buffer, or a sequence in binding order. A
        uniform binding may take a plain value instead (a number, numpy scalar
        or small vector, as for ``uniform``): it goes into the uniform ring, so
        every dispatch of a batch sees its own value with one pipeline.
        Everything is validated before any command is recorded; the result of
        validating a (kernel, buffers, overrides) combination is cached with
        its bind group, so a repeat costs a few dict lookups.
        """
        entry = self._kernels.get(id(kernel))
        if entry is None:
            entry = self._entry(kernel)
        if type(workgroups) is int and 0 < workgroups <= self._max_wg:
            x = workgroups
            y = z = 1
        elif type(workgroups) is tuple and len(workgroups) == 3 and \
                0 < workgroups[0] <= self._max_wg and 0 < workgroups[1] <= self._max_wg and \
                0 < workgroups[2] <= self._max_wg and type(workgroups[0]) is type(workgroups[1]) \
                is type(workgroups[2]) is int:
            x, y, z = workgroups
        else:
            x, y, z = checks.workgroups(kernel, workgroups, self._max_wg)
        okey = self._okey(entry, kernel, overrides) if overrides else ()
        try:
            if type(bindings) is dict:
                if len(bindings) != entry.count:
                    raise KeyError
                ids = tuple([bindings[n].id for n in entry.names])
            else:
                ids = tuple([b.id for b in bindings])
            pipeline, group = entry.bound[ids, okey]
        except (KeyError, AttributeError, TypeError):
            return self._dispatch_slow(entry, kernel, bindings, okey, x, y, z)
        self.stats["dispatches"] += 1
        self._recorder.dispatch(pipeline, group, x, y, z)
        if not self._depth:
            self._recorder.flush()

    def prepare(self, kernel, *, overrides=None, uniform_values: bool = False) -> None:
        """Compile ``kernel``'s module and pipeline now (raises WGSLCompileError),
        so the first dispatch costs no compile; also a plain validity check.
        ``uniform_values``: the pipeline for dispatches that give uniforms values."""
        entry = self._kernels.get(id(kernel)) or self._entry(kernel)
        okey = self._okey(entry, kernel, overrides) if overrides else \
            checks.overrides_key(kernel, None)
        if uniform_values:
            self._dynamic_pipeline(entry, kernel, okey)
        elif okey not in entry.pipelines:
            entry.pipelines[okey] = self._cache.pipeline(kernel, okey)

    def _entry(self, kernel) -> _KernelEntry:
        """First sight of a Kernel object: check features/limits, compile the module."""
        checks.check_kernel(kernel, self)
        self._cache.module(kernel)
        entry = _KernelEntry(kernel)
        key = id(kernel)
        try:  # forget the entry with the kernel, so a reused id() cannot hit it
            weakref.finalize(kernel, self._kernels.pop, key, None)
        except TypeError:  # not weak-referenceable: keep it alive so its id stays its own
            self._pinned.append(kernel)
        self._kernels[key] = entry
        return entry

    def _okey(self, entry, kernel, overrides) -> tuple:
        try:
            raw = tuple(overrides.items())
            okey = entry.okeys.get(raw)
        except (AttributeError, TypeError):
            raw = okey = None
        if okey is None:
            okey = checks.overrides_key(kernel, overrides)
            if raw is not None:
                entry.okeys[raw] = okey
        return okey

    def _dispatch_slow(self, entry, kernel, bindings, okey, x, y, z) -> None:
        """A combination not seen yet, or uniform values: check, then record."""
        if not okey:
            checks.overrides_key(kernel, None)  # one without a default needs a value
        buffers = checks.order_buffers(kernel, bindings)
        if any(not isinstance(buffers[i], DeviceBuffer) for i in entry.uniforms):
            pipeline, group, offsets = self._bind_values(entry, kernel, buffers, okey)
            self.stats["dispatches"] += 1
            self._recorder.dispatch_at(pipeline, group, offsets, x, y, z)
        else:
            pipeline, group = self._bind(entry, kernel, buffers, okey)
            self.stats["dispatches"] += 1
            self._recorder.dispatch(pipeline, group, x, y, z)
        if not self._depth:
            self._recorder.flush()

    def _bind(self, entry, kernel, buffers, okey):
        """Slow path: validate the buffers, then get pipeline and bind group."""
        checks.check_bound(kernel, buffers, self)
        pipeline = entry.pipelines.get(okey)
        if pipeline is None:
            pipeline = entry.pipelines[okey] = self._cache.pipeline(kernel, okey)
        group = self._cache.bind_group(kernel, buffers)
        key = (tuple(b.id for b in buffers), okey)
        self._cache.remember(entry.bound, key, (pipeline, group), buffers)
        return pipeline, group

    def _bind_values(self, entry, kernel, buffers, okey):
        """Pack the uniform values into the ring (every check first), then the
        pipeline and bind group of the dynamic-offset layout, and the offsets."""
        values = {}
        for i in entry.uniforms:
            obj = buffers[i]
            if not isinstance(obj, DeviceBuffer):
                values[i] = checks.uniform_value(kernel, kernel.bindings[i], obj).tobytes()
        try:
            ids = tuple([None if i in values else b.id for i, b in enumerate(buffers)])
            hit = entry.valued[ids, okey]
        except (KeyError, AttributeError):
            hit = self._check_valued(entry, kernel, buffers, okey, values)
        ring = self.uniform_ring
        placed = iter(ring.place(list(values.values())))
        chunk = ring.chunk
        if hit.chunk_id != chunk.id:
            resources = [(chunk, BINDING_BYTES) if i in values else (b, b.wgpu_buffer.size)
                         for i, b in enumerate(buffers)]
            hit.group = self._cache.dynamic_group(kernel, resources)
            hit.chunk_id = chunk.id
        offsets = [next(placed) if i in values else 0 for i in entry.uniforms]
        return hit.pipeline, hit.group, offsets

    def _check_valued(self, entry, kernel, buffers, okey, values) -> _Valued:
        """Check the Buffers of a dispatch with uniform values; cache the result."""
        checks.check_bound(kernel, buffers, self, values)
        kept = [i for i in range(len(buffers)) if i not in values]
        hit = _Valued(self._dynamic_pipeline(entry, kernel, okey))
        ids = tuple([None if i in values else b.id for i, b in enumerate(buffers)])
        self._cache.remember(entry.valued, (ids, okey), hit, [buffers[i] for i in kept])
        return hit

    def _dynamic_pipeline(self, entry, kernel, okey):
        pipeline = entry.dynamic.get(okey)
        if pipeline is None:
            pipeline = entry.dynamic[okey] = self._cache.pipeline(kernel, okey, dynamic=True)
        return pipeline

    # -- batching and waiting --------------------------------------------

    def batch(self, timestamps: bool = False) -> Batch:
        """``with device.batch():`` records every dispatch/copy into one submit."""
        return Batch(self, timestamps)

    def sync(self) -> None:
        """Submit anything recorded and wait until the GPU has finished all of it.

        (``queue.on_submitted_work_done_sync`` is broken in wgpu-py 0.32.0; a
        tiny read waits just as well, since the queue runs in order. Its copy
        goes out in a submit of its own, not counted in ``stats``.)
        """
        self._recorder.flush()
        if self._sync_buffer is None:
            self._sync_buffer = self.wgpu_device.create_buffer(
                size=4, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
        encoder = self.wgpu_device.create_command_encoder()
        encoder.copy_buffer_to_buffer(self._sync_buffer, 0, self._staging_for(4), 0, 4)
        self.queue.submit([encoder.finish()])
        self._map_staging(4)


def _timestamp_period(queue) -> float:
    """Nanoseconds per timestamp tick; wgpu-py has no wrapper, so ask wgpu-native.
    Dawn already reports nanoseconds (and calling into it here breaks its
    event handling: buffer maps never complete)."""
    if WGPU_BUILD == "dawn":
        return 1.0
    try:
        from wgpu.backends.wgpu_native._ffi import lib

        period = float(lib.wgpuQueueGetTimestampPeriod(queue._internal))
    except Exception:
        return 1.0
    return period if period > 0 else 1.0
