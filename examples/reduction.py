"""Sum of a vector: workgroup memory, barriers, and subgroups.

What it shows:

* ``m.shared(f32, n, name)``: a ``var<workgroup>`` array that the invocations
  of one workgroup share;
* ``m.barrier()``: ``workgroupBarrier()``; every invocation must reach it, so
  it stays outside ``if_`` blocks that depend on the invocation;
* a tree reduction unrolled in Python: the ``while`` loop below runs when the
  kernel is built and emits one guarded step and one barrier per level;
* a reduction in passes: each workgroup writes one partial sum, and the same
  kernel then sums the partials until one value is left, all recorded in one
  ``device.batch()`` (one submit);
* the subgroup variant: ``builtins.subgroup_add`` sums a value across a
  subgroup without workgroup memory; it needs the adapter's "subgroup"
  feature, which the kernel then lists in ``kernel.features``.

Run ``python -m examples.reduction`` to see the WGSL and the error against numpy.
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32

WORKGROUP_SIZE = 256
MIN_SUBGROUP_SIZE = 4  # WebGPU guarantees subgroups of at least 4 invocations


def reduce_sum(m):
    """``partials[w] = sum of x[w*W : (w+1)*W]`` for workgroup w of size W (a power of two)."""
    size, *rest = m.workgroup_size
    if size & (size - 1) or rest != [1, 1]:
        raise ValueError(f"reduce_sum needs a 1-D power-of-two workgroup size, got "
                         f"{m.workgroup_size}")
    x = m.declare_input_buffer("x", f32)
    partials = m.declare_output_buffer("partials", f32)
    scratch = m.shared(f32, size, "scratch")

    i = m.let(m.global_id().x, "i")
    lid = m.let(m.local_index(), "lid")
    # Out-of-range invocations contribute 0, but they still take part: each
    # one must reach every barrier below.
    value = m.var(f32, 0.0, "value")
    with m.if_(i < B.array_length(x)):
        m.assign(value, x[i])  # `value = x[i];` (Python's `=` would rebind the name)
    scratch[lid] = value
    m.barrier()

    # Tree: at each level the lower half adds the upper half.
    stride = size // 2
    while stride > 0:                          # a Python loop: unrolled into the WGSL
        with m.if_(lid < stride):
            scratch[lid] += scratch[lid + stride]
        m.barrier()
        stride //= 2

    with m.if_(lid == 0):
        partials[m.workgroup_id().x] = scratch[0]


def reduce_sum_subgroup(m):
    """Same contract as ``reduce_sum``, with one ``subgroupAdd`` instead of most of the tree.

    Every invocation gets its subgroup's sum; one per subgroup stores it, and
    invocation 0 adds those few values. This assumes, as implementations do,
    that a 1-D workgroup's subgroups are runs of consecutive
    ``local_invocation_index`` (WGSL does not promise it).
    """
    size, *rest = m.workgroup_size
    if rest != [1, 1]:
        raise ValueError(f"reduce_sum_subgroup needs a 1-D workgroup size, got {m.workgroup_size}")
    x = m.declare_input_buffer("x", f32)
    partials = m.declare_output_buffer("partials", f32)
    # One slot per subgroup: at most size / 4 of them.
    per_subgroup = m.shared(f32, max(1, size // MIN_SUBGROUP_SIZE), "per_subgroup")

    i = m.let(m.global_id().x, "i")
    lid = m.let(m.local_index(), "lid")
    value = m.var(f32, 0.0, "value")
    with m.if_(i < B.array_length(x)):
        m.assign(value, x[i])
    # Called by every invocation (uniform control flow), so all lanes take part.
    total = m.let(B.subgroup_add(value), "subgroup_total")
    sg_size = m.let(m.subgroup_size(), "sg_size")
    with m.if_(m.subgroup_invocation_id() == 0):
        per_subgroup[lid // sg_size] = total  # this subgroup's slot
    m.barrier()

    with m.if_(lid == 0):
        acc = m.var(f32, 0.0, "acc")
        with m.loop((size + sg_size - 1) // sg_size, name="s") as s:   # one per subgroup
            acc += per_subgroup[s]
        partials[m.workgroup_id().x] = acc


def kernel_for(device, subgroups=None, workgroup_size=WORKGROUP_SIZE) -> sd.Kernel:
    """The reduction kernel: the subgroup one when asked, or (None) when the device can."""
    if subgroups is None:
        subgroups = device.has_feature("subgroup")
    return sd.compile(reduce_sum_subgroup if subgroups else reduce_sum, workgroup_size)


def run(device, x, *, subgroups=None, workgroup_size: int = WORKGROUP_SIZE) -> float:
    """``x.sum()`` in float32 on ``device``: passes of the kernel until one value is left.

    All passes are recorded in one batch (one submit); WebGPU runs dispatches
    of one queue in order, so each pass sees the previous pass's partials.
    """
    x = np.ascontiguousarray(x, np.float32).ravel()
    if x.size == 0:
        return 0.0
    kernel = kernel_for(device, subgroups, workgroup_size)
    buffers = [device.buffer(x)]
    with device.batch():
        while buffers[-1].size > 1:
            groups = -(-buffers[-1].size // workgroup_size)
            # NaN-filled, so a partial the kernel failed to write shows up in the result.
            out = device.buffer(np.full(groups, np.nan, np.float32))
            device.dispatch(kernel, {"x": buffers[-1], "partials": out}, groups)
            buffers.append(out)
    return float(device.read(buffers[-1])[0])


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.0, 1.0, 100_003).astype(np.float32)  # 3 passes of 256, ragged
    want = x.astype(np.float64).sum()
    variants = [False] + ([True] if device.has_feature("subgroup") else [])
    for subgroups in variants:
        kernel = kernel_for(device, subgroups)
        print(kernel.wgsl)
        got = run(device, x, subgroups=subgroups)
        print(f"{kernel.name}: sum = {got:.6f}, numpy = {want:.6f}, |error| = {abs(got - want):.3g}"
              f" (sum |x| = {np.abs(x).sum():.1f})\n")
    if not device.has_feature("subgroup"):
        print("(no 'subgroup' feature on this adapter: the subgroup variant was skipped)")


if __name__ == "__main__":
    main()
