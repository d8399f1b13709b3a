"""Bitonic sort: one kernel, many passes, each with its own (k, j), in one submit.

What it shows:

* per-dispatch values for uniforms (the uniform ring): ``dispatch(k, {"data":
  buf, "k": k, "j": j}, grid)`` gives each pass its own k and j with one
  pipeline; the whole sort is one ``device.batch()`` (one submit);
* the other ways to change a value between dispatches, for comparison
  (``how="bake"``: a kernel per pass; ``how="override"``: a pipeline per
  pass); ``python -m examples.bench_params`` measures all of them.

Run ``python -m examples.bitonic`` to sort and compare with numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import f32, u32

WORKGROUP = 256


def bitonic(m, how: str = "uniform", k: int | None = None, j: int | None = None):
    """One compare-and-swap pass of a bitonic sort over ``data`` (a power of
    two long, at least one workgroup): invocation i pairs with i ^ j, and the
    direction flips with bit k of i. ``how`` says where k and j come from."""
    data = m.declare_output_buffer("data", f32)
    if how == "uniform":
        k, j = m.declare_uniform("k", u32), m.declare_uniform("j", u32)
    elif how == "override":
        k, j = m.override("k", u32), m.override("j", u32)
    elif how != "bake":
        raise ValueError(f"how must be 'bake', 'override' or 'uniform', got {how!r}")
    i = m.let(m.global_id().x, "i")
    partner = m.let(i ^ j, "partner")
    with m.if_(partner > i):
        a = m.let(data[i], "a")
        b = m.let(data[partner], "b")
        up = m.let((i & k) == 0, "up")
        with m.if_(up & (a > b) | ~up & (a < b)):
            data[i] = b
            data[partner] = a


def passes(n: int) -> list[tuple[int, int]]:
    """(k, j) of every pass of a bitonic sort of n (a power of two) values."""
    out, k = [], 2
    while k <= n:
        j = k // 2
        while j:
            out.append((k, j))
            j //= 2
        k *= 2
    return out


def run(device, x) -> np.ndarray:
    """``x`` (float32, any length) sorted ascending: padded with +inf to a power
    of two, sorted in one submit, the padding dropped."""
    x = np.asarray(x, np.float32)
    n = max(WORKGROUP, 1 << max(0, (len(x) - 1).bit_length()))
    data = device.buffer(np.concatenate([x, np.full(n - len(x), np.inf, np.float32)]))
    kernel = sd.compile(bitonic, WORKGROUP)
    with device.batch():
        for k, j in passes(n):
            device.dispatch(kernel, {"data": data, "k": k, "j": j}, n // WORKGROUP)
    return device.read(data)[:len(x)]


def main() -> None:
    from shaderdsl.runtime import get_device
    device = get_device()
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    print("sorted like numpy:", np.array_equal(run(device, x), np.sort(x)),
          f"({len(passes(1 << 17))} passes, one pipeline, one submit)")


if __name__ == "__main__":
    main()
