"""What the GPU, interpreter and browser devices share: the host API written
once (``HostDevice``) and a batch's bookkeeping (``HostBatch``), on top of the
host checks (``shaderdsl.checks``). Each device adds its own buffers,
dispatch and submission; nothing here touches a device.
"""
from __future__ import annotations

import operator

from .checks import copy_size, live_buffer
from .devicebuffer import DeviceBuffer
from .errors import DispatchError


class HostDevice:
    """What the GPU, interpreter and browser devices share of the host API and
    its checks; each has ``features``, ``stats``, ``_depth`` (open batches),
    ``empty``, ``dispatch``, and ``_copy`` and ``_release`` for the device's own
    part of copy() and release()."""

    subgroup_matrix_configs: tuple = ()  # MatrixConfig shapes; none without the feature

    def has_feature(self, name: str) -> bool:
        return name in self.features

    def zeros(self, shape, dtype, *, name: str | None = None):
        return self.empty(shape, dtype, name=name)

    def _own(self, buf, what: str) -> None:
        live_buffer(buf, self, what, kind=None)

    def copy(self, src, dst, nbytes: int | None = None) -> None:
        """Copy the first ``nbytes`` (default all of src) of src into dst."""
        self._own(src, "copy source")
        self._own(dst, "copy destination")
        nbytes = copy_size(src, dst, nbytes)
        if nbytes:
            self.stats["copies"] += 1
            self._copy(src, dst, nbytes)

    def release(self, buf) -> None:
        """Free ``buf`` now (after the work recorded so far); using it afterwards
        raises BindingError. Releasing it twice does nothing."""
        if isinstance(buf, DeviceBuffer) and buf.released:
            return
        self._own(buf, "release")
        self._release(buf)

    def dispatch_1d(self, kernel, bindings, n: int, **kw) -> None:
        """Dispatch enough workgroups along x to cover ``n`` invocations."""
        try:
            n = operator.index(n)
        except TypeError:
            raise DispatchError(f"kernel {kernel.name!r}: n must be an int, got {n!r}") from None
        if n < 1:
            raise DispatchError(f"kernel {kernel.name!r}: dispatch_1d needs n >= 1, got {n}")
        self.dispatch(kernel, bindings, -(-n // kernel.workgroup_size[0]), **kw)

    @property
    def in_batch(self) -> bool:
        return self._depth > 0


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
        self._outer = dev._depth == 0
        if self._outer:
            self._begin()
        self._open = True
        dev._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.device._depth -= 1
        self._open = False
        if not self._outer:
            return
        if exc_type is not None:
            self._drop()
        else:
            self._end()

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError
