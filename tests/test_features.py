"""Optional adapter features and batched dispatch, on the GPU.

f16 and subgroup kernels run where the adapter has the feature and are
skipped, with the reason, where it does not. Batching is checked two ways:
the same dispatches recorded in one ``device.batch()`` and issued one by one
give identical bytes, and a multi-pass pipeline in one batch stays in order
across a read and a write in the middle.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import DTypeLike

import shaderdsl as sd
from examples import reduction, saxpy
from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32, vec4h

U = 2.0 ** -24
SETTINGS = settings(max_examples=20, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def nonzero(rng, shape, dtype: DTypeLike = np.float32):
    mag = rng.uniform(0.1, 1.0, shape)
    return np.where(rng.random(shape) < 0.5, -mag, mag).astype(dtype)


def need(device, feature):
    if not device.has_feature(feature):
        pytest.skip(f"adapter lacks {feature}")
    return device


@pytest.fixture(scope="module")
def f16_device(device):
    return need(device, "shader-f16")


@pytest.fixture(scope="module")
def subgroup_device(device):
    return need(device, "subgroup")


def device_lacking(device, feature):
    """A device without ``feature``: the test device, or another adapter's; else skip."""
    if not device.has_feature(feature):
        return device
    from shaderdsl.runtime import get_device, list_adapters

    unusable = []
    for a in list_adapters():
        if feature not in a["features"]:
            try:
                return get_device(backend=a["backend"], adapter=a["name"])
            except sd.NoAdapterError as e:  # listed, but no device opens (the H200's OpenGL)
                unusable.append(str(e))
    pytest.skip(f"no usable adapter lacks {feature}: nothing to refuse the kernel"
                + (f" ({'; '.join(unusable)})" if unusable else ""))


# ---------------------------------------------------------------- shader-f16

def negate_double(m, n, width):
    """dst[i] = -(src[i] * 2h): exact in f16 for |src| < 2**14, so bit-comparable."""
    t = vec4h if width == 4 else f16
    src = m.declare_input_buffer("src", t, n // width)
    dst = m.declare_output_buffer("dst", t, n // width)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n // width):
        dst[i] = -(src[i] * 2.0)


def narrow(m, n):
    """dst[i] = f16(src[i]): f32 -> f16 conversion."""
    src = m.declare_input_buffer("src", f32, n)
    dst = m.declare_output_buffer("dst", f16, n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        dst[i] = f16(src[i])


def test_f16_kernels_declare_the_feature():
    k = sd.compile(negate_double, 64, n=8, width=4)
    assert k.features == {"shader-f16"}
    assert k.wgsl.splitlines()[1] == "enable f16;"
    assert "dst[i] = -(src[i] * 2.0h);" in k.wgsl


@SETTINGS
@given(n=st.one_of(st.sampled_from([1, 3, 4, 63, 64, 65, 257]), st.integers(1, 3000)),
       seed=seeds, vector=st.booleans())
def test_f16_storage_round_trip_is_exact(f16_device, n, seed, vector):
    width = 4 if vector and n % 4 == 0 else 1
    kernel = sd.compile(negate_double, 64, n=n, width=width)
    src = nonzero(np.random.default_rng(seed), n, np.float16)
    dst = f16_device.buffer(np.full(n, np.nan, np.float16))  # odd n: the buffer is padded
    f16_device.dispatch_1d(kernel, {"src": f16_device.buffer(src), "dst": dst}, n // width)
    got = f16_device.read(dst)
    assert got.dtype == np.float16 and got.shape == (n,)
    np.testing.assert_array_equal(got.view(np.uint16), (-(src * np.float16(2))).view(np.uint16))


@SETTINGS
@given(n=st.integers(1, 2000), seed=seeds)
def test_f32_to_f16_conversion_rounds_to_a_neighbour(f16_device, n, seed):
    rng = np.random.default_rng(seed)
    src = (nonzero(rng, n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    dst = f16_device.buffer(np.full(n, np.nan, np.float16))
    f16_device.dispatch_1d(sd.compile(narrow, 64, n=n), {"src": f16_device.buffer(src), "dst": dst},
                           n)
    got = f16_device.read(dst).astype(np.float64)
    # WGSL allows either neighbour of an inexact value: within one f16 step of it
    step = np.spacing(np.abs(src.astype(np.float16))).astype(np.float64)
    assert np.all(np.abs(got - src.astype(np.float64)) <= step)


def test_f16_kernel_is_refused_without_the_feature(device):
    dev = device_lacking(device, "shader-f16")
    kernel = sd.compile(negate_double, 64, n=4, width=4)
    src = dev.buffer(np.ones(4, np.float16))
    with pytest.raises(sd.FeatureError, match="shader-f16"):
        dev.dispatch(kernel, {"src": src, "dst": dev.zeros(4, np.float16)}, 1)


# ---------------------------------------------------------------- subgroup

def subgroup_layout(m):
    """Per invocation: subgroup size, lane id, and the subgroupAdd of (lane's local index + 1)."""
    out = m.declare_output_buffer("out", u32)
    lid = m.let(m.local_index(), "lid")
    base = m.let(m.workgroup_id().x * m.workgroup_size[0] * 3, "base")
    total = m.let(B.subgroup_add(lid + 1), "total")
    out[base + 3 * lid] = m.subgroup_size()
    out[base + 3 * lid + 1] = m.subgroup_invocation_id()
    out[base + 3 * lid + 2] = total


@pytest.mark.parametrize("workgroup", [64, 256])
def test_subgroups_are_runs_of_consecutive_invocations(subgroup_device, workgroup):
    """What the subgroup reduction assumes, and an exact integer subgroupAdd."""
    dev = subgroup_device
    kernel = sd.compile(subgroup_layout, workgroup)
    out = dev.buffer(np.full(2 * workgroup * 3, 0xFFFFFFFF, np.uint32))
    dev.dispatch(kernel, {"out": out}, 2)
    got = dev.read(out).reshape(2, workgroup, 3)
    size = int(got[0, 0, 0])
    assert (got[..., 0] == size).all()
    assert 4 <= size <= 128 and size & (size - 1) == 0
    lid = np.arange(workgroup)
    assert (got[..., 1] == lid % size).all()
    sums = (lid + 1).reshape(-1, size).sum(axis=1).repeat(size) if workgroup % size == 0 else None
    if sums is not None:
        assert (got[..., 2] == sums).all()


@SETTINGS
@given(n=st.one_of(st.sampled_from([1, 3, 4, 255, 256, 257, 65537]), st.integers(1, 70_000)),
       seed=seeds, workgroup=st.sampled_from([4, 64, 256]))
def test_subgroup_reduction_matches_numpy(subgroup_device, n, seed, workgroup):
    x = nonzero(np.random.default_rng(seed), n)
    got = reduction.run(subgroup_device, x, subgroups=True, workgroup_size=workgroup)
    want = x.astype(np.float64).sum()
    passes, count = 0, n
    while count > 1:
        passes, count = passes + 1, -(-count // workgroup)
    # subgroupAdd may sum its lanes in any order, then invocation 0 adds the
    # subgroups' sums one by one: no path is longer than the workgroup
    tol = 2 * max(passes, 1) * workgroup * U * np.abs(x.astype(np.float64)).sum()
    assert abs(got - want) <= tol, (got, want, tol)


def test_subgroup_kernel_is_refused_without_the_feature(device):
    dev = device_lacking(device, "subgroup")
    kernel = reduction.kernel_for(dev, subgroups=True)
    assert kernel.features == {"subgroup"}
    with pytest.raises(sd.FeatureError, match="subgroup"):
        dev.dispatch(kernel, {"x": dev.buffer(np.ones(4, np.float32)),
                              "partials": dev.zeros(1, np.float32)}, 1)


def test_default_reduction_uses_subgroups_only_when_available(device):
    kernel = reduction.kernel_for(device)
    assert (kernel.name == "reduce_sum_subgroup") == device.has_feature("subgroup")


# ---------------------------------------------------------------- batches

def _saxpy_chain(device, x, y0, coefficients):
    """y <- a*x + y for each a, alternating the override and uniform kernels;
    then the sum of y in reduction passes. Returns (y, partials of pass 1, total)."""
    by_override = sd.compile(saxpy.saxpy, 64, a_from="override")
    by_uniform = sd.compile(saxpy.saxpy, 64, a_from="uniform")
    x_buf, y_buf = device.buffer(x), device.buffer(y0)
    for k, a in enumerate(coefficients):
        if k % 2:
            a_buf = device.uniform(np.float32(a))
            device.dispatch_1d(by_uniform, {"x": x_buf, "y": y_buf, "a": a_buf}, x.size)
        else:
            device.dispatch_1d(by_override, {"x": x_buf, "y": y_buf}, x.size,
                               overrides={"a": float(a)})
    red = sd.compile(reduction.reduce_sum, 64)
    bufs = [y_buf]
    while bufs[-1].size > 1:
        groups = -(-bufs[-1].size // 64)
        bufs.append(device.buffer(np.full(groups, np.nan, np.float32)))
        device.dispatch(red, {"x": bufs[-2], "partials": bufs[-1]}, groups)
    return device.read(y_buf), device.read(bufs[1]), device.read(bufs[-1])


@SETTINGS
@given(n=st.integers(2, 20_000), seed=seeds, steps=st.integers(1, 6))
def test_batched_and_one_by_one_dispatch_agree_bit_for_bit(device, n, seed, steps):
    rng = np.random.default_rng(seed)
    x, y0 = nonzero(rng, n), nonzero(rng, n)
    coefficients = nonzero(rng, steps)
    submits = device.stats["submits"]
    one_by_one = _saxpy_chain(device, x, y0, coefficients)
    unbatched_submits = device.stats["submits"] - submits
    submits = device.stats["submits"]
    with device.batch():
        batched = _saxpy_chain(device, x, y0, coefficients)   # its reads submit as they go
    batched_submits = device.stats["submits"] - submits
    for a, b in zip(one_by_one, batched):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.isnan(batched[2]).any()
    # Each read is one submit; in the batch the first one also carries every
    # dispatch recorded before it, so the batch needs only the three reads.
    assert batched_submits == 3 < unbatched_submits
    want = y0.astype(np.float64) + coefficients.astype(np.float64).sum() * x.astype(np.float64)
    assert np.abs(batched[0] - want).max() <= 4 * steps * U * (np.abs(want).max() + 1)


def test_reduction_passes_in_one_batch_with_a_read_and_a_write_in_the_middle(device):
    """Pass 1, read its partials, overwrite x, pass 1 again, then the later
    passes: every command sees exactly what was recorded before it."""
    kernel = sd.compile(reduction.reduce_sum, 64)
    rng = np.random.default_rng(7)
    n = 64 * 64 * 3 + 17                              # 3 passes: 12306 -> 193 -> 4 -> 1
    x1, x2 = nonzero(rng, n), nonzero(rng, n)
    groups1 = -(-n // 64)
    groups2 = -(-groups1 // 64)
    x_buf = device.buffer(x1)
    p1a = device.buffer(np.full(groups1, np.nan, np.float32))
    p1b = device.buffer(np.full(groups1, np.nan, np.float32))
    p2 = device.buffer(np.full(groups2, np.nan, np.float32))
    p3 = device.buffer(np.full(1, np.nan, np.float32))

    def sums(x):
        padded = np.zeros(groups1 * 64)
        padded[:n] = x
        return padded.reshape(groups1, 64).sum(axis=1)

    with device.batch():
        device.dispatch(kernel, {"x": x_buf, "partials": p1a}, groups1)
        mid = device.read(p1a)                        # submits what is recorded, batch stays open
        assert device.in_batch
        device.write(x_buf, x2)                       # must not reach the pass recorded above
        device.dispatch(kernel, {"x": x_buf, "partials": p1b}, groups1)
        device.dispatch(kernel, {"x": p1b, "partials": p2}, groups2)
        device.dispatch(kernel, {"x": p2, "partials": p3}, 1)
        submits = device.stats["submits"]
    assert device.stats["submits"] == submits + 1     # the three passes went in one submit
    scale = np.abs(x1.astype(np.float64)).reshape(-1)[: n].sum()
    np.testing.assert_allclose(mid, sums(x1.astype(np.float64)), rtol=0, atol=12 * U * scale)
    np.testing.assert_array_equal(device.read(p1a), mid)
    np.testing.assert_allclose(device.read(p1b), sums(x2.astype(np.float64)), rtol=0,
                               atol=12 * U * scale)
    total = float(device.read(p3)[0])
    want = x2.astype(np.float64).sum()
    assert abs(total - want) <= 2 * 18 * U * np.abs(x2.astype(np.float64)).sum()
