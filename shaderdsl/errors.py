"""The exceptions of shaderdsl, one class per kind of mistake.

Codegen errors name the Python file:line that built the offending expression;
runtime errors are raised before any GPU buffer is written.
"""
from __future__ import annotations

from typing import TypeGuard

import numpy as np


def is_positive_int(value) -> TypeGuard[int | np.integer]:
    """An int >= 1 (a numpy integer too, never a bool): the one test behind every
    "must be a positive int" error (sizes, lengths, counts, grids)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) \
        and bool(value >= 1)


class ShaderDSLError(Exception):
    """Base of every error this library raises on purpose."""


class ShaderTypeError(ShaderDSLError, TypeError):
    """An expression mixes WGSL types that do not combine (f32 + u32)."""


class ShaderNameError(ShaderDSLError, ValueError):
    """A name is a WGSL reserved word, not an identifier, or already taken."""


class ShaderScopeError(ShaderDSLError):
    """A statement or expression used where it cannot go: ``else_`` without
    ``if_``, ``break_`` outside a loop, a local or expression used after the
    block that made it has ended, or an expression whose variables changed
    after it was built."""


class KernelBuildError(ShaderDSLError):
    """The kernel function raised while building; wraps the original error."""


class UniformityError(ShaderDSLError):
    """A barrier, subgroup operation or call of a function with one, in control
    flow that varies between invocations (WGSL's uniformity rules: Tint
    refuses the kernel, naga does not)."""


class BindingError(ShaderDSLError, ValueError):
    """A buffer does not fit its binding: wrong dtype, shape, size or name."""


class AliasingError(BindingError):
    """One buffer bound twice in a dispatch where at least one use writes it."""


class FeatureError(ShaderDSLError):
    """The kernel needs an adapter feature (shader-f16, subgroup) the device lacks."""


class NoAdapterError(ShaderDSLError, RuntimeError):
    """No WebGPU adapter matches the request."""


class DeviceLostError(ShaderDSLError, RuntimeError):
    """The GPU device was destroyed or lost: nothing more can run on it, and
    its buffers, weights and plans are gone. ``shaderdsl.runtime.get_device()``
    gives a fresh device to make them again on."""


class DispatchError(ShaderDSLError, ValueError):
    """Workgroup counts are invalid or over the device's limits."""


class WGSLCompileError(ShaderDSLError):
    """The WGSL compiler rejected a kernel.

    ``wgsl_line`` is the 1-based line the compiler blamed (or None),
    ``python_line`` the 'file:line' of the DSL call that emitted it (or None),
    ``excerpt`` the WGSL lines around it.
    """

    def __init__(self, message: str, *, kernel_name: str = "", wgsl_line: int | None = None,
                 python_line: str | None = None, excerpt: str = ""):
        self.kernel_name = kernel_name
        self.wgsl_line = wgsl_line
        self.python_line = python_line
        self.excerpt = excerpt
        parts = [f"WGSL compile error in kernel {kernel_name!r}: {message}"]
        if python_line:
            parts.append(f"built by Python at {python_line}")
        if excerpt:
            parts.append(excerpt)
        super().__init__("\n".join(parts))


class InterpreterError(ShaderDSLError):
    """The interpreter met something it cannot give a meaning to (barrier
    divergence, a runaway loop, missing bindings)."""


class OutOfBoundsError(InterpreterError, IndexError):
    """An index outside a buffer, workgroup array, array var or vector.

    A GPU clamps or drops such an access (WebGPU's robustness rules); the
    interpreter stops and says which index, where and in which invocation.
    """


class RaceError(InterpreterError):
    """Two invocations of one workgroup touched one element of workgroup
    memory, at least one writing, with no workgroupBarrier() between them.

    A GPU gives whatever its interleaving gives; the interpreter, which runs
    one invocation at a time, names the array, the element and both lines.
    """


class UninitializedReadError(InterpreterError):
    """A read of a workgroup-memory element no invocation of the workgroup
    has written in this dispatch: garbage on GPUs that do not zero it."""


class BrowserError(ShaderDSLError, RuntimeError):
    """The headless browser behind ``shaderdsl.browser`` is missing, would not
    start, crashed, or its WebGPU refused something the host checks let through."""


class BrowserTimeoutError(BrowserError, TimeoutError):
    """A call into the browser did not answer in time (a kernel that never
    ends hangs the page); the browser was restarted and its buffers are lost."""
