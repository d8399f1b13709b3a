"""Row softmax and LayerNorm: shaped buffers and workgroup collectives.

What it shows:

* ``m.declare_input_buffer("x", f32, (rows, cols))`` and ``x[r, c]``: the
  strides appear in the WGSL (``x[workgroup_id.x * 100u + c]``) and the
  interpreter checks each axis;
* ``shaderdsl.collectives.reduce``: a workgroup-wide max or sum, barriers
  inside, every invocation gets the result (no hand-written tree);
* one workgroup per row, its invocations striding over the columns, so any
  row length works.

Run ``python -m examples.rows`` to see the WGSL and the error against numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32

WORKGROUP_SIZE = 64


def _row_loop(m, cols):
    """``with _row_loop(m, cols) as c``: this invocation's columns of the row."""
    return m.loop(m.local_index(), cols, m.workgroup_size[0])


def softmax(m, rows, cols):
    """``y[r] = exp(x[r] - max x[r]) / sum exp(x[r] - max x[r])``, one workgroup per row."""
    x = m.declare_input_buffer("x", f32, (rows, cols))
    y = m.declare_output_buffer("y", f32, (rows, cols))
    r = m.let(m.workgroup_id().x, "r")
    big = m.var(f32, -3.4028234663852886e38, "big")
    with _row_loop(m, cols) as c:
        m.assign(big, B.max(big, x[r, c]))
    row_max = sd.collectives.reduce(m, big, "max", names=["row_max"])
    total = m.var(f32, 0.0, "total")
    with _row_loop(m, cols) as c:
        total += B.exp(x[r, c] - row_max)
    row_sum = sd.collectives.reduce(m, total, "sum", names=["row_sum"])
    with _row_loop(m, cols) as c:
        y[r, c] = B.exp(x[r, c] - row_max) / row_sum


def layer_norm(m, rows, cols, eps=1e-5):
    """``y[r] = (x[r] - mean) / sqrt(var + eps) * gamma + beta``, two passes over the row."""
    x = m.declare_input_buffer("x", f32, (rows, cols))
    gamma = m.declare_input_buffer("gamma", f32, cols)
    beta = m.declare_input_buffer("beta", f32, cols)
    y = m.declare_output_buffer("y", f32, (rows, cols))
    r = m.let(m.workgroup_id().x, "r")
    total = m.var(f32, 0.0, "total")
    with _row_loop(m, cols) as c:
        total += x[r, c]
    mean = m.let(sd.collectives.reduce(m, total) / float(cols), "mean")
    squares = m.var(f32, 0.0, "squares")
    with _row_loop(m, cols) as c:
        d = m.let(x[r, c] - mean, "d")
        squares += d * d
    inv_std = m.let(B.inverse_sqrt(sd.collectives.reduce(m, squares) / float(cols) + eps),
                    "inv_std")
    with _row_loop(m, cols) as c:
        y[r, c] = (x[r, c] - mean) * inv_std * gamma[c] + beta[c]


def run(device, kernel_fn, x, **inputs):
    """Run ``kernel_fn`` over the rows of ``x`` [rows, cols]; the output is NaN-poisoned first."""
    rows, cols = x.shape
    k = sd.compile(kernel_fn, WORKGROUP_SIZE, rows=rows, cols=cols)
    bufs = {"x": device.buffer(x), "y": device.buffer(np.full_like(x, np.nan))}
    bufs.update({name: device.buffer(v) for name, v in inputs.items()})
    device.dispatch(k, bufs, rows)
    return device.read(bufs["y"])


def softmax_reference(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def layer_norm_reference(x, gamma, beta, eps=1e-5):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=1, keepdims=True) + eps) * gamma + beta


def main() -> None:
    from shaderdsl.runtime import get_device
    device = get_device()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    print(sd.compile(softmax, WORKGROUP_SIZE, rows=3, cols=100).wgsl)
    got = run(device, softmax, x)
    print("softmax max abs error vs float64:", np.abs(got - softmax_reference(x)).max())
    gamma, beta = (rng.standard_normal(100).astype(np.float32) for _ in range(2))
    got = run(device, layer_norm, x, gamma=gamma, beta=beta)
    print("layer_norm max abs error vs float64:",
          np.abs(got - layer_norm_reference(x, gamma, beta)).max())


if __name__ == "__main__":
    main()
