"""Workgroup reduce and scan (shaderdsl.collectives) on the GPU, in the
interpreter and against numpy: every op, power-of-two and other sizes, with and
without subgroups."""
from __future__ import annotations

import numpy as np
import pytest

import shaderdsl as sd
from shaderdsl import collectives as C
from shaderdsl import f32, i32, u32, vec4f
from shaderdsl.errors import ShaderTypeError
from shaderdsl.interp import Interpreter

SIZES = [1, 7, 32, 64, 100, 256]
NUMPY = {"sum": np.sum, "max": np.max, "min": np.min}


def reduce_kernel(m, n, op, dtype, subgroups, lanes):
    x = m.declare_input_buffer("x", dtype, n)
    out = m.declare_output_buffer("out", dtype, n)
    i = m.global_id().x
    fn = (lambda a, b: a * b) if op == "product" else op
    out[i] = C.reduce(m, x[i], fn, subgroups=subgroups, lanes=lanes)


def scan_kernel(m, n, op, dtype, subgroups, inclusive):
    x = m.declare_input_buffer("x", dtype, n)
    out = m.declare_output_buffer("out", dtype, n)
    i = m.global_id().x
    out[i] = C.scan(m, x[i], op, inclusive=inclusive, subgroups=subgroups)


def data(rng, n, dtype):
    if dtype == f32:
        return rng.integers(-50, 50, n).astype(np.float32)  # exact sums in f32
    if dtype == i32:
        return rng.integers(-1000, 1000, n).astype(np.int32)
    return rng.integers(0, 1000, n).astype(np.uint32)


def run(device, kernel, n, buffers, **params):
    """(GPU result, interpreter result) of one workgroup of n invocations."""
    k = sd.compile(kernel, n, n=n, **params)
    bufs = {name: device.buffer(v) for name, v in buffers.items()}
    device.dispatch(k, bufs, 1)
    gpu = device.read(bufs["out"])
    sg = device.has_feature("subgroup") and params.get("subgroups")
    cpu = Interpreter(k, subgroup_size=8 if sg else 32).dispatch(buffers, 1)["out"]
    return gpu, cpu


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "max", "min", "product"])
@pytest.mark.parametrize("subgroups", [False, True])
def test_reduce(device, n, op, subgroups):
    if subgroups and not device.has_feature("subgroup"):
        pytest.skip("adapter lacks 'subgroup'")
    rng = np.random.default_rng(n)
    dtype = i32 if op == "product" else f32
    x = data(rng, n, dtype) if op != "product" else rng.integers(-2, 3, n).astype(np.int32)
    gpu, cpu = run(device, reduce_kernel, n, {"x": x, "out": np.zeros_like(x)}, op=op,
                   dtype=dtype, subgroups=subgroups, lanes=None)
    want = np.prod(x.astype(np.int64)).astype(np.int32) if op == "product" else NUMPY[op](x)
    assert (gpu == want).all() and (cpu == want).all(), (gpu[:4], cpu[:4], want)


@pytest.mark.parametrize("lanes", [4, 16])
def test_reduce_over_groups_of_lanes(device, lanes):
    rng = np.random.default_rng(lanes)
    x = data(rng, 64, u32)
    gpu, cpu = run(device, reduce_kernel, 64, {"x": x, "out": np.zeros_like(x)}, op="max",
                   dtype=u32, subgroups=False, lanes=lanes)
    want = np.repeat(x.reshape(-1, lanes).max(axis=1), lanes)
    assert (gpu == want).all() and (cpu == want).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op, inclusive", [("sum", True), ("sum", False), ("max", True),
                                           ("min", False), ("max", False)])
@pytest.mark.parametrize("subgroups", [False, True])
def test_scan(device, n, op, inclusive, subgroups):
    if subgroups and not device.has_feature("subgroup"):
        pytest.skip("adapter lacks 'subgroup'")
    rng = np.random.default_rng(n + 1)
    x = data(rng, n, i32)
    gpu, cpu = run(device, scan_kernel, n, {"x": x, "out": np.zeros_like(x)}, op=op,
                   dtype=i32, subgroups=subgroups, inclusive=inclusive)
    acc = {"sum": np.cumsum, "max": np.maximum.accumulate, "min": np.minimum.accumulate}[op]
    want = acc(x.astype(np.int64)).astype(np.int32)
    if not inclusive:
        first = {"sum": 0, "min": 2 ** 31 - 1, "max": -2 ** 31}[op]  # np.iinfo(np.int32)
        want = np.concatenate([[first], want[:-1]]).astype(np.int32)
    assert (gpu == want).all() and (cpu == want).all(), (gpu[:8], cpu[:8], want[:8])


def test_reduce_refuses_an_unknown_op():
    with pytest.raises(ShaderTypeError,
                       match=r"test_collectives.py:\d+: op must be 'sum', 'max', 'min'"):
        sd.compile(reduce_kernel, 4, n=4, op="mean", dtype=f32, subgroups=False, lanes=None)


def test_reduce_has_its_barriers():
    k = sd.compile(reduce_kernel, 64, n=64, op="sum", dtype=f32, subgroups=False, lanes=None)
    assert k.wgsl.count("workgroupBarrier();") == 6 + 2  # one per level, store and reuse


def vector_kernel(m, n, op, subgroups, how):
    x = m.declare_input_buffer("x", vec4f, n)
    out = m.declare_output_buffer("out", vec4f, n)
    i = m.global_id().x
    if how == "reduce":
        out[i] = C.reduce(m, x[i], op, subgroups=subgroups)
    else:
        out[i] = C.scan(m, x[i], op, inclusive=how == "inclusive", subgroups=subgroups)


@pytest.mark.parametrize("how", ["reduce", "inclusive", "exclusive"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("subgroups", [False, True])
def test_vector_values_reduce_and_scan_per_component(device, how, op, subgroups):
    """A vec4 value: the identities (a var's start, the exclusive scan's first
    value) are splat over the components; it raised "var of type vec4<f32>
    initialised with f32" before."""
    if subgroups and not device.has_feature("subgroup"):
        pytest.skip("adapter lacks 'subgroup'")
    n = 24
    x = np.random.default_rng(5).integers(-50, 50, (n, 4)).astype(np.float32)
    gpu, cpu = run(device, vector_kernel, n, {"x": x, "out": np.zeros_like(x)}, op=op,
                   subgroups=subgroups, how=how)
    x64 = x.astype(np.float64)
    if how == "reduce":
        want = np.broadcast_to(NUMPY[op](x64, axis=0), x.shape)
    else:
        acc = {"sum": np.cumsum, "max": np.maximum.accumulate, "min": np.minimum.accumulate}
        want = acc[op](x64, axis=0)
        if how == "exclusive":
            first = {"sum": 0.0, "max": -3.4028234663852886e38, "min": 3.4028234663852886e38}
            want = np.concatenate([np.full((1, 4), first[op]), want[:-1]])
    assert (gpu == want).all() and (cpu == want).all(), (gpu[:3], cpu[:3], want[:3])


def named_reduce(m, names):
    x = m.declare_input_buffer("x", f32, 4)
    out = m.declare_output_buffer("out", f32, 4)
    i = m.global_id().x
    if isinstance(names, list) and len(names) == 2:
        a, b = C.reduce(m, [x[i], x[i] * 2.0], names=names)
        out[i] = a + b
    else:
        out[i] = C.reduce(m, x[i], names=names)


def test_reduce_names_one_per_value():
    """A str names a single value (it named the let after its first letter);
    a list of another length is refused at the user's line (was an IndexError)."""
    wgsl = sd.compile(named_reduce, 4, names="total").wgsl
    assert "let total = " in wgsl and "let t = " not in wgsl
    assert "let lo = " in sd.compile(named_reduce, 4, names=["lo", "hi"]).wgsl
    want = r"test_collectives.py:\d+: names must give one name per reduced value \(1\), got \['a'"
    with pytest.raises(ShaderTypeError, match=want):
        sd.compile(named_reduce, 4, names=["a", "b", "c"])


def bool_reduce(m):
    x = m.declare_input_buffer("x", f32, 16)
    out = m.declare_output_buffer("out", u32, 16)
    out[m.local_index()] = u32(C.reduce(m, x[m.local_index()] > 0.0))


def lanes_reduce(m, lanes):
    x = m.declare_input_buffer("x", f32, 16)
    out = m.declare_output_buffer("out", f32, 16)
    out[m.local_index()] = C.reduce(m, x[m.local_index()], lanes=lanes)


def mixed_reduce(m):
    x = m.declare_input_buffer("x", f32, 16)
    out = m.declare_output_buffer("out", f32, 16)
    a, b = C.reduce(m, [x[m.local_index()], m.local_index()])
    out[m.local_index()] = a + f32(b)


@pytest.mark.parametrize("kernel, params, message", [
    (bool_reduce, {}, r"collectives.reduce combines numbers \(f32, f16, i32, u32 or vectors of "
                      r"them\), got bool \(count a condition as u32\(cond\)\)"),
    (lanes_reduce, {"lanes": 5}, r"lanes must divide the workgroup's 16 invocations into groups, "
                                 r"got 5"),
    (mixed_reduce, {}, r"collectives.reduce of several values needs them of one type, got f32, "
                       r"u32"),
])
def test_values_a_collective_cannot_combine_are_refused_at_the_line(kernel, params, message):
    """They failed inside the collective: a KernelBuildError ('bool is not
    host-shareable'), an OutOfBoundsError on its array at run time (lanes=5
    of 16), 'cannot assign u32 to a f32 location'."""
    with pytest.raises(ShaderTypeError, match=r"test_collectives.py:\d+: " + message):
        sd.compile(kernel, 16, **params)


def test_an_inclusive_scan_is_one_let_of_its_name():
    """It was `let prefix = ...; let scan = prefix;`."""
    for subgroups in (False, True):
        wgsl = sd.compile(scan_kernel, 16, n=16, op="sum", dtype=i32, subgroups=subgroups,
                          inclusive=True).wgsl
        assert "let scan = " in wgsl and "let prefix" not in wgsl and "= prefix;" not in wgsl
