"""Prefix sum over many workgroups: ``shaderdsl.collectives.scan`` in three passes.

What it shows:

* ``collectives.scan``: each invocation gets the sum of the values of the
  invocations before it (inclusive here), barriers inside; with
  ``subgroups=True`` the subgroup operations do most of the work;
* the classic multi-block scan: (1) every workgroup scans its block and
  writes its total, (2) the totals are scanned the same way (recursively,
  while there is more than one block), (3) every block adds the sum of the
  blocks before it; all passes recorded in one ``device.batch()`` (one submit).

Run ``python -m examples.scan`` to compare with numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import i32

WORKGROUP_SIZE = 256


def scan_blocks(m, subgroups=False):
    """``y[i]`` = inclusive sum of ``x`` within i's block; ``totals[w]`` = block w's sum."""
    x = m.declare_input_buffer("x", i32)
    y = m.declare_output_buffer("y", i32)
    totals = m.declare_output_buffer("totals", i32)
    n = m.let(sd.builtins.array_length(x), "n")
    i = m.let(m.global_id().x, "i")
    value = m.var(i32, 0, "value")
    with m.if_(i < n):
        m.assign(value, x[i])
    prefix = sd.collectives.scan(m, value, subgroups=subgroups, name="prefix")
    with m.if_(i < n):
        y[i] = prefix
    with m.if_(m.local_index() == m.workgroup_size[0] - 1):
        totals[m.workgroup_id().x] = prefix


def add_offsets(m):
    """``y[i] += scanned_totals[w - 1]`` for every block w after the first."""
    y = m.declare_output_buffer("y", i32)
    scanned = m.declare_input_buffer("scanned", i32)
    i, w = m.global_id().x, m.workgroup_id().x
    with m.if_((w > 0) & (i < sd.builtins.array_length(y))):
        y[i] += scanned[w - 1]


def _record(device, kernels, xb, n):
    """Record the passes for ``n`` values in ``xb``; returns the buffer of the scan."""
    blocks = -(-n // WORKGROUP_SIZE)
    y, totals = device.empty(n, np.int32), device.empty(blocks, np.int32)
    device.dispatch(kernels[0], {"x": xb, "y": y, "totals": totals}, blocks)
    if blocks > 1:
        scanned = _record(device, kernels, totals, blocks)
        device.dispatch(kernels[1], {"y": y, "scanned": scanned}, blocks)
    return y


def run(device, x, subgroups=False):
    """Inclusive prefix sum of the int32 array ``x`` (sums wrap like int32)."""
    kernels = (sd.compile(scan_blocks, WORKGROUP_SIZE, subgroups=subgroups),
               sd.compile(add_offsets, WORKGROUP_SIZE))
    with device.batch():
        y = _record(device, kernels, device.buffer(np.asarray(x, np.int32)), len(x))
    return device.read(y)


def main() -> None:
    from shaderdsl.runtime import get_device
    device = get_device()
    x = np.random.default_rng(0).integers(-1000, 1000, 100_000).astype(np.int32)
    got = run(device, x)
    print("matches numpy:", np.array_equal(got, np.cumsum(x, dtype=np.int64).astype(np.int32)))


if __name__ == "__main__":
    main()
