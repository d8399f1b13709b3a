"""The browser device: the host API of ``shaderdsl.runtime.Device``, run by
WebGPU in a headless Chromium (Chromium's own Dawn and Tint).

Host code written for the GPU (buffers, dispatch, batch, read) runs
unchanged. Bad input is refused by the shared checks (``shaderdsl.checks``)
before anything reaches the page, with the GPU device's exceptions and
messages. Dispatches and copies
are recorded as operations and sent to the page in one call per submit (at
once outside a batch, at the batch's end or at a read inside one); the page
plays them into one command encoder. Every call has a deadline
(``timeout``, seconds): a call that misses it (a kernel that never ends
hangs the page) restarts the browser and raises BrowserTimeoutError.
"""
from __future__ import annotations

import os
import re
import weakref
from typing import NoReturn

import numpy as np

from ..errors import BrowserError, BrowserTimeoutError
from ..hostdevice import HostDevice, locked
from .batch import Batch
from .buffers import CHUNK, Buffer, decode, encode
from .kernels import compile_error, constants, page_key, page_value
from .page import Host, PageError

ENV_TIMEOUT = "SHADERDSL_BROWSER_TIMEOUT"
# The page's feature names that kernels spell otherwise.
FEATURE_NAMES = {"subgroups": "subgroup"}


def kebab(name: str) -> str:
    """WebGPU's camelCase limit names in the runtime's spelling (max-buffer-size)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name).lower()


class Device(HostDevice):
    """WebGPU in one headless Chromium (see the module docstring).

    ``binary``: the browser (default: $SHADERDSL_CHROMIUM or chromium on
    PATH); ``timeout``: seconds every call may take (default
    $SHADERDSL_BROWSER_TIMEOUT or 60). Prefer ``shaderdsl.browser.get_device()``,
    which shares one browser per process and shuts it down at exit.
    """

    def __init__(self, binary: str | None = None, *, timeout: float | None = None):
        super().__init__("calls", "bytes_up", "bytes_down", "restarts")
        self.timeout = float(timeout or os.environ.get(ENV_TIMEOUT) or 60.0)
        self._ops: list = []           # recorded, not yet sent to the page
        self._pending: list = []       # kernels sent since the last completed wait
        self._garbage: list = []       # ids of Buffers collected by Python: freed at next send
        self._modules: set = set()     # page keys whose module and layout the page has
        self.host = Host(binary, timeout=max(self.timeout, 30.0))
        self._adopt()

    def _adopt(self) -> None:
        """Name, features and limits from the page's adapter and device."""
        info = self.host.info
        a = info["info"]
        product = self.host.chromium.version
        self.name: str = (a.get("description") or " ".join(
            v for v in (a.get("vendor"), a.get("architecture")) if v) or "WebGPU") + f" ({product})"
        self.backend: str = "browser"
        self.adapter_type: str = "fallback" if a.get("fallback") else "GPU"
        self.adapter_info: dict = a
        self.user_agent: str = info.get("user_agent", "")
        self.features: frozenset = frozenset(FEATURE_NAMES.get(f, f) for f in info["features"])
        self.limits: dict = {kebab(k): v for k, v in info["limits"].items()}
        self.launch_seconds: float = self.host.launch_seconds

    @property
    def generation(self) -> int:
        return self.host.generation

    def __repr__(self) -> str:
        return f"<browser.Device {self.name!r} {self.adapter_type}>"

    def adapters_with(self, feature: str) -> list[str]:
        """Named in FeatureError: the wgpu adapters with ``feature`` (listed once
        per process by the GPU runtime), and this browser's if it has it."""
        try:
            from ..runtime.adapters import adapters_with
            found = adapters_with(feature)
        except Exception:  # no wgpu adapter at all: only the browser is named
            found = []
        return found + ([f"{self.name} (browser)"] if feature in self.features else [])

    # -- calls into the page ---------------------------------------------

    def _call(self, name: str, *args, sent: int = 0):
        """One call into the page, with the deadline; a timeout restarts the browser."""
        self.stats["calls"] += 1
        self.stats["bytes_up"] += sent
        try:
            return self.host.call(name, *args, timeout=self.timeout)
        except BrowserTimeoutError:
            self._restart(f"the page did not answer {name}() within {self.timeout:g} s")
        except PageError as e:
            if e.kind != "lost":
                raise
            self._restart(f"the page's GPUDevice was lost: {e}", BrowserError)
        except BrowserError as e:
            if self.host.browser is None or self.host.browser.alive:
                raise
            self._restart(f"{e}".rstrip(), BrowserError)

    def _restart(self, why: str, error: type[BrowserError] = BrowserTimeoutError) -> NoReturn:
        """Start a fresh browser and raise ``error`` naming what was running."""
        running = sorted(set(self._pending))
        self._ops, self._pending, self._garbage = [], [], []
        self._kernels.clear()
        self._modules.clear()
        self.stats["restarts"] += 1
        self.host.restart()
        self._adopt()
        what = f" (kernels running: {', '.join(running)})" if running else ""
        hint = " A kernel that never ends hangs the page." if error is BrowserTimeoutError else ""
        raise error(f"{why}{what}.{hint} The browser was restarted and the buffers made before "
                    f"are lost (device.timeout = {self.timeout:g} s)")

    def _send(self, wait: bool = False) -> dict:
        """Play the recorded operations in the page; the results of their reads."""
        # Collected Buffers go last: work recorded before may still use them.
        ops = self._ops + [{"op": "release", "id": i} for i in self._garbage]
        self._garbage, self._ops = [], []
        if not ops and not wait:
            return {}
        sent = sum(len(op.get("data", "")) for op in ops)
        out = self._call("run", ops, wait, sent=sent)
        self.stats["submits"] += out.pop("submits", 0)
        self.stats["bind_groups"] += out.pop("bind_groups", 0)
        if wait or any(op["op"] == "read" for op in ops):
            self._pending = []
        return out

    def close(self) -> None:
        """Shut the browser down (the device cannot be used afterwards)."""
        self.host.close()

    # -- the device's part of the host API (HostDevice checks first) -------

    def _alloc(self, shape, dtype, kind: str, name, data, size: int) -> Buffer:
        buf = Buffer(self, shape, dtype, kind, size, name)
        pieces = [] if data is None else encode(data, size)
        first = pieces[0][1] if len(pieces) == 1 else None
        self._call("create", buf.id, size, kind, first, sent=len(first or ""))
        weakref.finalize(buf, self._collect, buf.id, self.generation)
        if len(pieces) > 1:
            self._upload(buf, pieces)
        return buf

    def _upload(self, buf: Buffer, pieces: list) -> None:
        """Write ``buf`` a piece per call (after the work recorded before)."""
        for offset, data in pieces:
            self._ops.append({"op": "write", "id": buf.id, "offset": offset, "data": data})
            self._send()

    def _collect(self, buffer_id: int, generation: int) -> None:
        """A Buffer was garbage-collected: free its GPUBuffer with the next call."""
        if generation == self.generation:
            self._garbage.append(buffer_id)

    def _write(self, buf: Buffer, array) -> None:
        """What is recorded is sent first: the write lands after it."""
        self._upload(buf, encode(array, buf.padded))

    def _read(self, buf: Buffer) -> np.ndarray:
        self._ops.append({"op": "read", "id": buf.id, "size": buf.padded})
        first = self._send()[str(buf.id)]
        pieces = [first] if isinstance(first, str) else [
            self._call("take", buf.id, off, min(CHUNK, buf.padded - off))
            for off in range(0, buf.padded, CHUNK)]
        self.stats["bytes_down"] += sum(map(len, pieces))
        return decode(pieces, buf.dtype, buf.shape, buf.size)

    def _release(self, buf: Buffer) -> None:
        buf.freed = True
        self._ops.append({"op": "release", "id": buf.id})
        self._send()

    def _copy(self, src: Buffer, dst: Buffer, nbytes: int) -> None:
        self._ops.append({"op": "copy", "src": src.id, "dst": dst.id, "n": nbytes})
        if not self._depth:
            self._send()

    def _dispatch(self, kernel, entry, buffers, values, grid, okey) -> None:
        """Record the dispatch: [binding, buffer id] per binding ([binding,
        None, base64] for a plain uniform value)."""
        pkey = self._pipeline(kernel, entry, okey)
        binds = [[b.index, None, page_value(values[i])] if i in values else
                 [b.index, buffers[i].id] for i, b in enumerate(kernel.bindings)]
        self.stats["dispatches"] += 1
        self._ops.append({"op": "dispatch", "key": page_key(kernel), "okey": pkey,
                          "binds": binds, "grid": list(grid)})
        self._pending.append(kernel.name)
        if not self._depth:
            self._send()

    def _prepare(self, kernel, entry, okey: tuple, uniform_values: bool) -> None:
        """The pipeline in the page (``uniform_values`` changes nothing here)."""
        self._pipeline(kernel, entry, okey)

    def _new_entry(self, kernel) -> set:
        """First sight of a Kernel (in this browser): compile its module; the
        entry is the set of its pipelines' keys the page has."""
        key = page_key(kernel)
        if key not in self._modules:
            spec = {"key": key, "name": kernel.name, "entry": kernel.entry_point,
                    "wgsl": kernel.wgsl_for("tint"),
                    "layout": [[b.index, b.access] for b in kernel.bindings]}
            try:
                self._call("kernel", spec)
            except PageError as e:
                raise compile_error(kernel, e) from None
            self._modules.add(key)
            self.stats["modules"] += 1
        return set()

    def _pipeline(self, kernel, pipelines: set, okey: tuple) -> str:
        """The page's pipeline for (kernel, overrides), made on first use."""
        pkey = repr(okey)
        if pkey not in pipelines:
            try:
                self._call("pipeline", page_key(kernel), pkey, constants(okey))
            except PageError as e:
                raise compile_error(kernel, e) from None
            pipelines.add(pkey)
            self.stats["pipelines"] += 1
        return pkey

    # -- batching and waiting --------------------------------------------

    def batch(self, timestamps: bool = False) -> Batch:
        """``with device.batch():`` sends every dispatch/copy in it as one submit."""
        return Batch(self, timestamps)

    @locked
    def sync(self) -> None:
        """Send anything recorded and wait until the page's GPU has finished it."""
        self._send(wait=True)

