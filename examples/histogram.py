"""Histogram of u32 values with atomics: ``hist[v % nbins] += 1`` for every value v.

What it shows:

* an atomic buffer: ``m.declare_output_buffer("hist", atomic(u32), nbins)``;
  its elements are only touched through ``builtins.atomic_*`` calls, which
  are statements (the builder emits them where they are called) returning
  the old value as a ``let``;
* the usual first step of a fast histogram: each workgroup counts into a
  private histogram in workgroup memory (``m.shared(atomic(u32), nbins)``),
  where atomics are cheap, and then adds only its non-zero bins to the global
  one. The private histogram is cleared first: WGSL promises zeroed
  workgroup memory, but wgpu-native (0.32, on lavapipe and llvmpipe GL) does
  not deliver it, so a workgroup can see the counts a previous one left;
* ``m.loop(start, end, step)``: a strided loop that lets a workgroup of any
  size walk every bin.

Run ``python -m examples.histogram`` to see the WGSL and the check against numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import atomic, u32
from shaderdsl import builtins as B

WORKGROUP_SIZE = 128


def histogram(m, nbins: int, private: bool = False):
    """Count ``values[i] % nbins`` into ``hist``, which the caller zero-fills.

    private: count in workgroup memory first, then merge (needs nbins * 4
    bytes of workgroup memory; 16 KiB is the portable limit).
    """
    values = m.declare_input_buffer("values", u32)
    hist = m.declare_output_buffer("hist", atomic(u32), nbins)
    i = m.let(m.global_id().x, "i")
    in_range = m.let(i < B.array_length(values), "in_range")

    if not private:
        with m.if_(in_range):
            B.atomic_add(hist[values[i] % nbins], 1)
        return

    local = m.shared(atomic(u32), nbins, "local_hist")
    threads = m.workgroup_size[0] * m.workgroup_size[1] * m.workgroup_size[2]
    with m.loop(m.local_index(), nbins, threads, name="z") as z:   # clear: bins z, z+threads, ...
        B.atomic_store(local[z], 0)
    m.barrier()                                  # cleared before anyone counts

    with m.if_(in_range):
        B.atomic_add(local[values[i] % nbins], 1)
    m.barrier()                                  # all counts in before merging

    with m.loop(m.local_index(), nbins, threads, name="b") as b:
        count = B.atomic_load(local[b])
        with m.if_(count > 0):                   # skip empty bins: fewer global atomics
            B.atomic_add(hist[b], count)


def run(device, values, nbins: int, *, private: bool = False,
        workgroup_size: int = WORKGROUP_SIZE) -> np.ndarray:
    """``np.bincount(values % nbins, minlength=nbins)`` as uint32, on ``device``."""
    values = np.ascontiguousarray(values, np.uint32).ravel()
    if values.size == 0:
        return np.zeros(nbins, np.uint32)
    kernel = sd.compile(histogram, workgroup_size, nbins=nbins, private=private)
    hist = device.zeros(nbins, np.uint32)        # atomics accumulate: must start at 0
    device.dispatch_1d(kernel, {"values": device.buffer(values), "hist": hist}, values.size)
    return device.read(hist)


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    rng = np.random.default_rng(0)
    nbins = 100
    values = rng.integers(0, 2**32, 100_001, dtype=np.uint32)
    want = np.bincount(values % nbins, minlength=nbins)
    for private in (False, True):
        kernel = sd.compile(histogram, WORKGROUP_SIZE, nbins=nbins, private=private)
        print(kernel.wgsl)
        got = run(device, values, nbins, private=private)
        print(f"private={private}: {values.size} values, {nbins} bins, "
              f"bins differing from numpy: {int((got != want).sum())}, "
              f"total counted: {int(got.sum())}\n")


if __name__ == "__main__":
    main()
