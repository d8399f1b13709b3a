"""What the web exports share: a device that records what a plan dispatches,
the steps an ES module replays, and the JavaScript and HTML files shipped
in ``lora/apps/web_assets`` (package data, read at export).

The forward (lora.apps.web) and the training step (lora.apps.web_train) are
both recorded, not rewritten: the Python plan runs on a :class:`Recorder`,
and its list of dispatches and copies is what the module's JavaScript
encodes, kernel for kernel and grid for grid.
"""
from __future__ import annotations

import contextlib
from importlib import resources

from shaderdsl.export import RUNTIME_DTS, RUNTIME_JS
from shaderdsl.hostdevice import Capture
from shaderdsl.interp import Device as InterpDevice


class Recorder(InterpDevice):
    """An interpreter device whose dispatches and copies are listed, not run.
    ``features``: those the recorded plan may use (default: every one the
    interpreter has; the page then asks the adapter for what its kernels need)."""

    def __init__(self, features=None):
        super().__init__(features=features)
        self.ops: list = []

    def dispatch(self, kernel, bindings, workgroups, *, overrides=None) -> None:
        self.ops.append(("dispatch", kernel, list(bindings), workgroups))

    def _copy(self, src, dst, nbytes: int) -> None:
        self.ops.append(("copy", src, dst, nbytes))

    @contextlib.contextmanager
    def capture(self):
        """A capture that refuses its replay: a plan that captures its first run and
        replays it after (lora.CausalLM's step) records its dispatches here every time."""
        held = Capture()
        held.refused = "a Recorder lists each dispatch as it is made"
        yield held


def module_steps(ops: list, name_of) -> tuple[list, list]:
    """(kernels, steps) of recorded ``ops``: each distinct Kernel once; a
    dispatch as its kernel's index, its grid and the name (``name_of(buffer)``)
    of the buffer at each binding; a copy as [source, destination, bytes]."""
    kernels, steps = [], []
    for op in ops:
        if op[0] == "copy":
            steps.append({"copy": [name_of(op[1]), name_of(op[2]), op[3]]})
            continue
        _, kernel, bufs, grid = op
        if any(b.access == "uniform" for b in kernel.bindings):  # the modules make storage only
            raise ValueError(f"kernel {kernel.name!r} takes a uniform; the web exports make "
                             f"storage buffers only")
        if kernel not in kernels:
            kernels.append(kernel)
        steps.append({"kernel": kernels.index(kernel),
                      "grid": list(grid) if isinstance(grid, tuple) else [grid, 1, 1],
                      "buffers": {b.name: name_of(buf) for b, buf in zip(kernel.bindings, bufs)}})
    return kernels, steps


def asset(name: str) -> str:
    """The text of ``lora/apps/web_assets/<name>``."""
    return resources.files("lora.apps").joinpath("web_assets", name).read_text()


def module_code(*names: str) -> str:
    """The code ending an exported module: the runtime, what the LoRA modules
    share (web_assets/common.mjs: prepare, readBack, halfBits) and each of
    ``names``' own (web_assets files, in order)."""
    return "\n".join([RUNTIME_JS, asset("common.mjs"), *map(asset, names)])


def module_types(name: str) -> str:
    """The declarations of ``module_code(name)``'s module (``name``: its .d.ts)."""
    return f"{RUNTIME_DTS}\n{asset('common.d.ts')}\n{asset(name)}"
