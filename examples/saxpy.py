"""SAXPY, ``y = a * x + y``: the smallest useful kernel.

What it shows:

* storage buffers: ``declare_input_buffer`` (read only) and
  ``declare_output_buffer`` (read_write), indexed like Python lists;
* one invocation per element, found with ``m.global_id().x``;
* the bounds guard: the grid is a whole number of workgroups, so the last
  workgroup has invocations past the end of the data when ``n`` is not a
  multiple of the workgroup size; ``with m.if_(i < n):`` keeps them out;
* two ways to pass the scalar ``a``: a pipeline-overridable constant
  (``m.override``, set per dispatch, no buffer) or a uniform buffer
  (``m.declare_uniform``, one small buffer, rewritable without a new pipeline).

Run ``python -m examples.saxpy`` to see the WGSL and the error against numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32

WORKGROUP_SIZE = 64


def saxpy(m, n=None, a_from="override"):
    """``y[i] = a * x[i] + y[i]`` for every ``i < n``.

    n:      the element count as a Python int, baked into the WGSL as a
            literal (one pipeline per n); None reads it from the buffer with
            ``arrayLength(&y)`` (one pipeline for every n).
    a_from: "override" (``override a: f32``) or "uniform" (``var<uniform> a: f32``).
    """
    x = m.declare_input_buffer("x", f32)
    y = m.declare_output_buffer("y", f32)
    if a_from == "override":
        a = m.override("a", f32, 1.0)          # default 1.0; dispatch(..., overrides={"a": 2.5})
    elif a_from == "uniform":
        a = m.declare_uniform("a", f32)        # bound like a buffer: {"a": device.uniform(2.5)}
    else:
        raise ValueError(f"a_from must be 'override' or 'uniform', got {a_from!r}")

    i = m.let(m.global_id().x, "i")            # `let i = global_id.x;`
    count = B.array_length(y) if n is None else n
    with m.if_(i < count):                     # the guard for the ragged last workgroup
        y[i] = a * x[i] + y[i]


def run(device, a: float, x, y, *, a_from: str = "override", bake_n: bool = False,
        workgroup_size: int = WORKGROUP_SIZE) -> np.ndarray:
    """``a * x + y`` on ``device``, in float32; returns the new y."""
    x = np.ascontiguousarray(x, np.float32).ravel()
    y = np.ascontiguousarray(y, np.float32).ravel()
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"x and y need one non-zero length, got {x.shape} and {y.shape}")
    kernel = sd.compile(saxpy, workgroup_size, n=x.size if bake_n else None, a_from=a_from)

    bindings = {"x": device.buffer(x), "y": device.buffer(y)}
    overrides = None
    if a_from == "uniform":
        bindings["a"] = device.uniform(np.float32(a))
    else:
        overrides = {"a": float(np.float32(a))}
    # ceil(n / workgroup_size) workgroups along x
    device.dispatch_1d(kernel, bindings, x.size, overrides=overrides)
    return device.read(bindings["y"])


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    rng = np.random.default_rng(0)
    n, a = 1000, 2.5  # 1000 is not a multiple of 64: the guard matters
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    want = a * x.astype(np.float64) + y.astype(np.float64)
    for a_from in ("override", "uniform"):
        print(sd.compile(saxpy, WORKGROUP_SIZE, n=n, a_from=a_from).wgsl)
        got = run(device, a, x, y, a_from=a_from, bake_n=True)
        print(f"a from {a_from}: max |error| = {np.abs(got - want).max():.3g}\n")


if __name__ == "__main__":
    main()
