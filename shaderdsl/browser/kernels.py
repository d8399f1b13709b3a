"""What the browser device needs from a Kernel beyond the shared checks: its
compile errors as WGSLCompileError, its override constants in the form the
page takes, and a plain uniform value packed as the GPU device packs it."""
from __future__ import annotations

import base64

import numpy as np

from ..errors import WGSLCompileError


def page_key(kernel) -> str:
    """The page's name for a Kernel's module and layout: its cache key (WGSL and
    entry point) and its binding table (two Kernels may share WGSL, not layout)."""
    return kernel.cache_key + ":" + ",".join(f"{b.index}{b.access}" for b in kernel.bindings)


def compile_error(kernel, err) -> WGSLCompileError:
    """WGSLCompileError from the page's report (Tint's messages, by WGSL line)."""
    from ..runtime.pipelines import excerpt  # only on this error path: it imports wgpu

    errors: list[dict] = err.detail.get("errors") or [{"message": str(err).split(": ", 1)[-1]}]
    first = errors[0]
    line, column = first.get("line") or None, first.get("column") or None
    # Dawn adds " - While validating ..." lines: keep them, on one line, as the GPU device does.
    message = "; ".join(part.strip(" -") for e in errors for part in e["message"].splitlines()
                        if part.strip(" -"))
    if err.kind == "pipeline" and "overridable constant" in message:
        message += " (pass overrides={...})"
    return WGSLCompileError(
        message, kernel_name=kernel.name, wgsl_line=line,
        python_line=kernel.python_line(line, "tint") if line else None,
        excerpt=excerpt(kernel.wgsl_for("tint"), line, column) if line else "")


def constants(okey: tuple) -> dict:
    """Checked overrides as WebGPU's ``constants`` (numbers; bools as 0/1)."""
    return {name: float(value) if isinstance(value, bool) else value for name, value in okey}


def page_value(value: np.ndarray) -> str:
    """A plain uniform value (checked: ``checks.uniform_value``) as the page
    takes it: base64 of its 16 bytes, as the GPU device packs it."""
    return base64.b64encode(value.tobytes().ljust(16, b"\0")).decode("ascii")
