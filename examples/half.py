"""Half-precision storage: ``y = W @ x`` with W stored as f16, summed in f32.

Storing weights as f16 halves the bytes a memory-bound kernel reads; summing
in f32 keeps the rounding error of a long dot product small. What it shows:

* ``f16``/``vec4h`` element types: using one adds ``enable f16;`` to the WGSL
  and "shader-f16" to ``kernel.features``; the runtime refuses such a kernel,
  with a message naming the adapters that have the feature, on a device
  without it (check first with ``device.has_feature("shader-f16")``);
* f16 buffers are filled from numpy ``float16`` arrays;
* conversions are explicit: ``vec4f(w)`` widens four halves to f32 before
  they are multiplied (the DSL refuses ``f16 * f32``);
* vector loads: with ``cols % 4 == 0`` a row is read as ``vec4<f16>``
  (8 bytes per load) and multiplied with ``dot``; otherwise one f16 at a time.

Run ``python -m examples.half`` to see the WGSL and the error against numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f16, f32, vec4f, vec4h

WORKGROUP_SIZE = 64
FEATURE = "shader-f16"


def gemv_f16(m, rows: int, cols: int):
    """``y[r] = sum_c f32(W[r, c]) * x[c]``, one invocation per row; W is f16, x and y f32."""
    width = 4 if cols % 4 == 0 else 1
    n = cols // width                                    # loads per row
    W = m.declare_input_buffer("W", vec4h if width == 4 else f16, rows * n)
    x = m.declare_input_buffer("x", vec4f if width == 4 else f32, n)
    y = m.declare_output_buffer("y", f32, rows)

    r = m.let(m.global_id().x, "r")
    with m.if_(r < rows):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(n, name="c") as c:
            if width == 4:
                acc += B.dot(vec4f(W[r * n + c]), x[c])  # 4 halves -> vec4<f32>, then dot
            else:
                acc += f32(W[r * n + c]) * x[c]
        y[r] = acc


def run(device, w, x) -> np.ndarray:
    """``w @ x`` with ``w`` rounded to float16 and f32 sums; returns float32."""
    if not device.has_feature(FEATURE):
        raise sd.FeatureError(f"device {device.name!r} lacks {FEATURE!r}")
    w = np.ascontiguousarray(w, np.float16)
    x = np.ascontiguousarray(x, np.float32).ravel()
    if w.ndim != 2 or w.shape[1] != x.size:
        raise ValueError(f"cannot multiply {w.shape} by {x.shape}")
    rows, cols = w.shape
    kernel = sd.compile(gemv_f16, WORKGROUP_SIZE, rows=rows, cols=cols)
    y = device.buffer(np.full(rows, np.nan, np.float32))  # NaN: unwritten rows show
    device.dispatch_1d(kernel, {"W": device.buffer(w), "x": device.buffer(x), "y": y}, rows)
    return device.read(y)


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    rows = 300
    for cols in (256, 250):  # vec4h loads, then scalar f16 loads
        print(sd.compile(gemv_f16, WORKGROUP_SIZE, rows=rows, cols=cols).wgsl)
    if not device.has_feature(FEATURE):
        print(f"this adapter lacks {FEATURE!r}: not run")
        return
    rng = np.random.default_rng(0)
    for cols in (256, 250):
        w = rng.standard_normal((rows, cols)).astype(np.float16)
        x = rng.standard_normal(cols).astype(np.float32)
        got = run(device, w, x)
        want = w.astype(np.float64) @ x.astype(np.float64)
        scale = np.abs(w.astype(np.float64)) @ np.abs(x.astype(np.float64))
        print(f"{rows}x{cols}: max |error| = {np.abs(got - want).max():.3g}, "
              f"max |error| / (|W| @ |x|) = {(np.abs(got - want) / scale).max():.3g}")


if __name__ == "__main__":
    main()
