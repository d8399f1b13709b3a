"""What the GPU, interpreter and browser devices share: the host API written
once (``HostDevice``) and a batch's bookkeeping (``HostBatch``), on top of the
host checks (``shaderdsl.checks``). Each public method of ``HostDevice``
makes the checks, then calls the device's own part (a hook such as
``_alloc`` or ``_dispatch``); nothing here touches a device.

Threads: each public method runs holding the device's re-entrant ``lock``,
and a batch holds it from its start to its submit, so another thread's
calls wait instead of joining it (docs/errors.md, "Threads").
"""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref

import numpy as np

from . import checks
from .devicebuffer import DeviceBuffer, padded_size
from .errors import BindingError, DeviceLostError, DispatchError

# The counters every device keeps in ``stats``; a device may add its own.
STATS = ("modules", "pipelines", "bind_groups", "dispatches", "copies", "submits")


def _buffer_what(name: str | None) -> str:
    return f"buffer {name!r}" if name else "buffer"


def call_live(device, fn, *args, **kw):
    """``fn(*args, **kw)`` on ``device`` if it is not known to be lost; an
    error the device says means it was lost becomes a DeviceLostError."""
    if device._lost is not None:
        device._check_live()
    try:
        return fn(*args, **kw)
    except Exception as err:
        lost = None if isinstance(err, DeviceLostError) else device._lost_error(err)
        if lost is None:
            raise
        raise lost from err


def locked(method):
    """A device's ``method``, run holding its lock on a device not known to be
    lost: ``call_live`` written out, since it wraps every dispatch (one call
    fewer saves 0.1 us of the 3 us a cached dispatch takes on lavapipe)."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        with self.lock:
            if self._lost is not None:
                self._check_live()
            try:
                return method(self, *args, **kw)
            except Exception as err:
                lost = None if isinstance(err, DeviceLostError) else self._lost_error(err)
                if lost is None:
                    raise
                raise lost from err
    return run


class Capture:
    """What a device recorded while ``device.capture()`` was open, in order:
    ``device.replay(capture)`` records it again as it was (the same kernels,
    buffers, grids and copies), skipping each call's checks and lookups: a
    graph of many dispatches recorded once and replayed for every step, as a
    CUDA graph is. The capture holds its buffers (a released one refuses the
    replay). A dispatch given uniform values cannot be replayed (its values
    were that call's): the capture says so when it is replayed."""

    def __init__(self):
        self.commands: list = []   # the device's own form of each command
        self.buffers: list = []    # every buffer a command uses, held
        self.refused: str | None = None  # why it cannot be replayed, if it cannot

    def __len__(self) -> int:
        return len(self.commands)


class HostDevice:
    """The host API of every device: ``buffer``, ``empty``, ``zeros``,
    ``uniform``, ``write``, ``read``, ``copy``, ``release``, ``dispatch``,
    ``dispatch_1d``, ``prepare``, each checked here once. A device sets
    ``name``, ``backend``, ``features`` and ``limits``, and writes its part:
    ``_alloc`` (a Buffer), ``_write``, ``_read``, ``_copy``, ``_release``,
    ``_new_entry`` (its state for a kernel first seen), ``_prepare``,
    ``_dispatch``, and ``batch`` and ``sync``; a device that can be lost
    also ``_check_live`` and ``_lost_error``."""

    name: str
    backend: str
    features: frozenset
    limits: dict
    subgroup_matrix_configs: tuple = ()  # MatrixConfig shapes; none without the feature
    _captures_itself = False  # a device whose recorder keeps its own form of a capture

    def __init__(self, *extra_stats: str):
        self.stats: dict = dict.fromkeys(STATS + extra_stats, 0)
        self._depth = 0               # open batches
        self._kernels: dict = {}      # id(kernel) -> the device's entry (_new_entry)
        self._pinned: list = []       # kernels that cannot be weakly referenced
        self.lock = threading.RLock()  # held by every call and by an open batch
        self._batch_thread: int | None = None  # the thread whose batch is open
        self._lost: str | None = None  # why the device was lost, once that is known
        self._capture: Capture | None = None  # open while device.capture() is

    def has_feature(self, name: str) -> bool:
        return name in self.features

    @property
    def in_batch(self) -> bool:
        """Whether the calling thread has a batch open on this device."""
        return self._depth > 0 and self._batch_thread == threading.get_ident()

    # -- buffers ---------------------------------------------------------

    def buffer(self, array, *, name: str | None = None):
        """A storage buffer holding a copy of ``array`` (float32/float16/int32/uint32)."""
        arr = checks.host_array(array, _buffer_what(name))
        return self._new(arr.shape, arr.dtype, "storage", name, arr)

    def empty(self, shape, dtype, *, name: str | None = None):
        """A storage buffer of ``shape``/``dtype``, zero-filled (as WebGPU's are)."""
        dt = checks.check_dtype(dtype, _buffer_what(name))
        return self._new(checks.buffer_shape(shape), dt, "storage", name, None)

    def zeros(self, shape, dtype, *, name: str | None = None):
        return self.empty(shape, dtype, name=name)

    def uniform(self, value, *, name: str | None = None):
        """A uniform buffer from an array or scalar, padded to 16 bytes
        (Python float -> float32, int -> uint32; numpy keeps its dtype)."""
        arr = checks.uniform_array(value)
        return self._new(arr.shape, arr.dtype, "uniform", name, arr)

    @locked
    def _new(self, shape: tuple, dtype: np.dtype, kind: str, name, data):
        """A Buffer of WebGPU's size for it (a multiple of 4, of 16 for a
        uniform), within max-buffer-size; ``data``: its contents (None: zeros)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = padded_size(nbytes, 16 if kind == "uniform" else 4)
        cap = self.limits.get("max-buffer-size")
        if cap is not None and size > cap:
            raise BindingError(f"buffer of {size} bytes is over max-buffer-size = {cap} "
                               f"on {self.name!r}")
        return self._alloc(shape, dtype, kind, name, data, size)

    def _own(self, buf, what: str) -> None:
        checks.live_buffer(buf, self, what, kind=None)

    @locked
    def write(self, buf, array) -> None:
        """Overwrite ``buf``; dtype and shape must match it exactly. Lands after
        the work recorded before it."""
        self._own(buf, "write")
        self._write(buf, checks.write_array(buf, array))

    @locked
    def read(self, buf) -> np.ndarray:
        """A new array with ``buf``'s contents, after the work recorded so far."""
        self._own(buf, "read")
        return self._read(buf)

    @locked
    def copy(self, src, dst, nbytes: int | None = None) -> None:
        """Copy the first ``nbytes`` (default all of src) of src into dst."""
        self._own(src, "copy source")
        self._own(dst, "copy destination")
        nbytes = checks.copy_size(src, dst, nbytes)
        if nbytes:
            self.stats["copies"] += 1
            self._copy(src, dst, nbytes)
            if self._capture is not None and not self._captures_itself:
                self._captured(("copy", src, dst, nbytes), [src, dst], None)

    def release(self, buf) -> None:
        """Free ``buf`` now (after the work recorded so far); using it afterwards
        raises BindingError. Releasing it twice does nothing, nor does releasing
        it on a lost device (cleaning up after a loss is no error)."""
        if isinstance(buf, DeviceBuffer) and buf.released:
            return
        with self.lock:
            self._own(buf, "release")
            self._release(buf)

    # -- kernels ---------------------------------------------------------

    @locked
    def dispatch(self, kernel, bindings, workgroups, *, overrides=None) -> None:
        """Run ``kernel`` over ``workgroups`` (int or up to 3 ints).

        ``bindings``: dict name -> Buffer, or a sequence in binding order; a
        uniform binding may take a plain value instead (a number, numpy scalar
        or small vector, as for ``uniform``), for this dispatch only.
        Everything is checked before anything is recorded: the kernel
        (features, limits), the grid, the overrides, then the bindings.
        """
        entry = self._entry(kernel)
        grid = checks.workgroups(kernel, workgroups, self.limits[checks.MAX_WORKGROUPS])
        okey = checks.overrides_key(kernel, overrides)
        buffers = checks.order_buffers(kernel, bindings)
        values = checks.uniform_values(kernel, buffers)
        checks.check_bound(kernel, buffers, self, values)
        self._dispatch(kernel, entry, buffers, values, grid, okey)
        if self._capture is not None and not self._captures_itself:
            self._captured(("dispatch", kernel, buffers, values, grid, okey), buffers,
                           values and f"kernel {kernel.name!r} was given uniform values")

    def dispatch_1d(self, kernel, bindings, n: int, **kw) -> None:
        """Dispatch enough workgroups along x to cover ``n`` invocations."""
        try:
            n = operator.index(n)
        except TypeError:
            raise DispatchError(f"kernel {kernel.name!r}: n must be an int, got {n!r}") from None
        if n < 1:
            raise DispatchError(f"kernel {kernel.name!r}: dispatch_1d needs n >= 1, got {n}")
        self.dispatch(kernel, bindings, -(-n // kernel.workgroup_size[0]), **kw)

    @locked
    def prepare(self, kernel, *, overrides=None, uniform_values: bool = False) -> None:
        """Check ``kernel`` and its overrides and build now what its first
        dispatch would (a GPU's module and pipeline: WGSLCompileError here);
        ``uniform_values``: what dispatches giving uniforms plain values use."""
        entry = self._entry(kernel)
        self._prepare(kernel, entry, checks.overrides_key(kernel, overrides), uniform_values)

    @contextlib.contextmanager
    def capture(self):
        """``with device.capture() as graph:`` the dispatches and copies
        recorded in the block are recorded as ever and also kept in ``graph``
        (a :class:`Capture`) for :meth:`replay`. Holds the device's lock."""
        with self.lock:
            if self._capture is not None:
                raise RuntimeError("capture: a capture is open already on this device")
            self._capture = Capture()
            self._begin_capture(self._capture)
            try:
                yield self._capture
            finally:
                self._end_capture()
                self._capture = None

    @locked
    def replay(self, capture: Capture) -> None:
        """Record ``capture``'s commands again, in order (joining the open
        batch, or in one submit); refused (BindingError) before anything is
        recorded where a buffer it holds was released since, or a dispatch
        was given uniform values."""
        if not isinstance(capture, Capture):
            raise TypeError(f"replay: expected a Capture (device.capture()), got "
                            f"{type(capture).__name__}")
        if capture.refused:
            raise BindingError(f"replay: the capture cannot be replayed: {capture.refused}")
        gone = next((b for b in capture.buffers if b.released), None)
        if gone is not None:
            raise BindingError(f"replay: {gone!r}, which the capture uses, was released")
        self._replay(capture)

    def _captured(self, command: tuple, buffers, refused) -> None:
        """Keep ``command`` (the generic form: re-dispatched by _replay) in the open capture."""
        capture = self._capture
        assert capture is not None
        capture.commands.append(command)
        capture.buffers.extend(b for b in buffers if isinstance(b, DeviceBuffer))
        capture.refused = capture.refused or refused or None

    def _begin_capture(self, capture: Capture) -> None:
        """A device that captures its own form of each command starts here."""

    def _end_capture(self) -> None:
        """... and stops here."""

    def _replay(self, capture: Capture) -> None:
        """Record the generic commands again (a device with its own form replays that)."""
        for command in capture.commands:
            if command[0] == "copy":
                self.stats["copies"] += 1
                self._copy(*command[1:])
            else:
                _, kernel, buffers, values, grid, okey = command
                self._dispatch(kernel, self._entry(kernel), buffers, values, grid, okey)

    def _entry(self, kernel):
        """The device's state for ``kernel`` (``_new_entry``), made at first sight
        after its features and limits are checked, and forgotten with the
        kernel, so a reused id() cannot hit it."""
        key = id(kernel)
        entry = self._kernels.get(key)
        if entry is None:
            checks.check_kernel(kernel, self)
            entry = self._new_entry(kernel)
            try:
                weakref.finalize(kernel, self._kernels.pop, key, None)
            except TypeError:  # not weak-referenceable: keep it alive so its id stays its own
                self._pinned.append(kernel)
            self._kernels[key] = entry
        return entry

    # -- each device's own part --------------------------------------------

    def _check_live(self) -> None:
        """Raise DeviceLostError: ``_lost`` says why (a device that cannot be lost never does)."""

    def _lost_error(self, err: Exception) -> DeviceLostError | None:
        """The DeviceLostError ``err`` means (the device was lost), else None."""
        return None

    def _alloc(self, shape: tuple, dtype: np.dtype, kind: str, name, data, size: int):
        """A Buffer of ``size`` bytes holding ``data`` (None: zeros)."""
        raise NotImplementedError

    def _write(self, buf, array: np.ndarray) -> None:
        raise NotImplementedError

    def _read(self, buf) -> np.ndarray:
        raise NotImplementedError

    def _copy(self, src, dst, nbytes: int) -> None:
        raise NotImplementedError

    def _release(self, buf) -> None:
        raise NotImplementedError

    def _new_entry(self, kernel):
        raise NotImplementedError

    def _prepare(self, kernel, entry, okey: tuple, uniform_values: bool) -> None:
        raise NotImplementedError

    def _dispatch(self, kernel, entry, buffers: list, values: dict, grid: tuple,
                  okey: tuple) -> None:
        """Record the checked dispatch: ``buffers`` in binding order, ``values``
        position -> array of the uniforms given plain values, ``grid`` (x, y, z),
        ``okey`` the checked overrides; counts it in ``stats["dispatches"]``."""
        raise NotImplementedError

    def batch(self, timestamps: bool = False):
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class HostBatch:
    """Context manager from ``device.batch()``; nested batches join the outer one.

    The bookkeeping every device's batch shares: the device's count of open
    batches (``_depth``), whether this batch is the outermost (only that one
    submits) and whether it is open. A device's batch says what happens when
    the outermost batch opens (``_begin``), ends (``_end``) or ends with an
    exception (``_drop``: the work recorded in it is dropped), and what
    ``flush()`` sends.
    """

    def __init__(self, device, timestamps: bool = False):
        self.device = device
        self.timestamps = timestamps
        self._outer = False
        self._open = False

    def __enter__(self):
        dev = self.device
        dev.lock.acquire()  # held until __exit__: no other thread's call joins the batch
        try:
            self._outer = dev._depth == 0
            if self._outer:
                dev._batch_thread = threading.get_ident()
                call_live(dev, self._begin)
        except BaseException:
            dev.lock.release()
            raise
        self._open = True
        dev._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        dev = self.device
        try:
            dev._depth -= 1
            self._open = False
            if self._outer:
                dev._batch_thread = None
                if exc_type is not None:
                    self._drop()
                else:
                    call_live(dev, self._end)
        finally:
            dev.lock.release()

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError
