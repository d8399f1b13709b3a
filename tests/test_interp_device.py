"""The interpreter as a device (shaderdsl.interp.Device) and its workgroup-memory checks.

1. The same host code runs on the GPU device (fixture ``device``) and on the
   interpreter device and gives equal results, both checked against numpy
   float64 on random inputs: SAXPY, a workgroup reduction written with
   shaderdsl.collectives.reduce, a workgroup histogram with atomics.
2. Bad input gets the same exception type and message from both devices.
3. Batches run their work in order; an exception inside drops it.
4. Workgroup memory: a forgotten barrier raises RaceError naming both lines,
   the array and the element; a read before any write raises
   UninitializedReadError; kernels with correct barriers run clean.
"""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from helpers import assert_refused_alike, scale128

import examples.histogram as EH
import examples.saxpy as ES
import shaderdsl as sd
from shaderdsl import atomic, f16, f32, u32, vec4f
from shaderdsl import builtins as B
from shaderdsl import collectives as C
from shaderdsl.errors import (
    BindingError,
    DispatchError,
    FeatureError,
    InterpreterError,
    OutOfBoundsError,
    RaceError,
    UninitializedReadError,
    WGSLCompileError,
)
from shaderdsl.interp import Device, InterpDevice, Interpreter

RTOL_F32 = 2 ** -22          # a few f32 roundings


@pytest.fixture(scope="module")
def idev():
    return Device(subgroup_size=8)


@pytest.fixture(params=["gpu", "interp"])
def dev(request, device, idev):
    return device if request.param == "gpu" else idev


def line_of(fn, marker: str) -> str:
    """'test_interp_device.py:N' of the line of ``fn`` holding ``marker``."""
    src, first = inspect.getsourcelines(fn)
    (k,) = [i for i, line in enumerate(src) if marker in line]
    return f"test_interp_device.py:{first + k}"


def names(msg: str, fn, marker: str) -> bool:
    """Does ``msg`` name the line of ``fn`` holding ``marker`` (not just a prefix of it)?"""
    return re.search(re.escape(line_of(fn, marker)) + r"(?!\d)", msg) is not None


def starts_at(msg: str, fn, marker: str) -> bool:
    """Does ``msg`` begin with that line's 'file:line'?"""
    return names(msg.split(": ", 1)[0], fn, marker)


# ================================================================== same host code, both devices

def reduce_sums(m, subgroups=False):
    """out[w] = the sum of x over workgroup w (x padded with zeros past n)."""
    x = m.declare_input_buffer("x", f32)
    n = m.declare_uniform("n", u32)
    out = m.declare_output_buffer("out", f32)
    i = m.let(m.global_id().x, "i")
    v = B.select(f32(0.0), x[B.min(i, n - 1)], i < n)
    s = C.reduce(m, v, "sum", subgroups=subgroups)
    with m.if_(m.local_index() == 0):
        out[m.workgroup_id().x] = s


def host_reduce(dev, x: np.ndarray, threads: int, subgroups: bool) -> np.ndarray:
    """Host code written once, for either device."""
    k = sd.compile(reduce_sums, threads, subgroups=subgroups)
    groups = -(-x.size // threads)
    xb, out = dev.buffer(x, name="x"), dev.empty(groups, np.float32, name="out")
    dev.dispatch(k, {"x": xb, "n": dev.uniform(x.size), "out": out}, groups)
    return dev.read(out)


def test_saxpy_same_on_both_devices(dev):
    rng = np.random.default_rng(10)
    x = rng.standard_normal(300).astype(np.float32)
    y = rng.standard_normal(300).astype(np.float32)
    for a_from in ("override", "uniform"):
        got = ES.run(dev, 1.75, x, y, a_from=a_from)
        want = 1.75 * x.astype(np.float64) + y
        np.testing.assert_allclose(got, want, rtol=RTOL_F32, atol=1e-6)


@pytest.mark.parametrize("threads, subgroups", [(64, False), (48, False), (64, True)])
def test_workgroup_reduction_same_on_both_devices(device, idev, threads, subgroups):
    if subgroups and not device.has_feature("subgroup"):
        pytest.skip("the GPU adapter lacks subgroups")
    rng = np.random.default_rng(threads)
    x = rng.uniform(-1, 1, 333).astype(np.float32)
    want = np.add.reduceat(x.astype(np.float64), np.arange(0, x.size, threads))
    tol = threads * 2 ** -24 * threads          # |x| <= 1: threads roundings of sums <= threads
    gpu = host_reduce(device, x, threads, subgroups)
    cpu = host_reduce(idev, x, threads, subgroups)
    np.testing.assert_allclose(gpu, want, rtol=0, atol=tol)
    np.testing.assert_allclose(cpu, want, rtol=0, atol=tol)


def test_workgroup_histogram_with_atomics(dev):
    """Atomics on workgroup memory do not race with each other."""
    values = np.random.default_rng(11).integers(0, 2 ** 32, 500, dtype=np.uint32)
    got = EH.run(dev, values, 13, private=True, workgroup_size=32)
    np.testing.assert_array_equal(got, np.bincount(values % 13, minlength=13))


def array_length(m):
    x = m.declare_input_buffer("x", f16)
    out = m.declare_output_buffer("out", u32)
    out[0] = B.array_length(x)


def test_array_length_counts_the_padding_as_a_gpu_does(dev):
    """An f16[3] buffer is 8 bytes on a GPU: arrayLength is 4 on both devices."""
    if not dev.has_feature("shader-f16"):
        pytest.skip("no shader-f16")
    out = dev.zeros(1, np.uint32)
    dev.dispatch(sd.compile(array_length, 1), {"x": dev.buffer(np.ones(3, np.float16)),
                                               "out": out}, 1)
    assert dev.read(out)[0] == 4


def test_copy_read_write_release(dev):
    src = dev.buffer(np.arange(10, dtype=np.uint32))
    dst = dev.zeros(10, np.uint32)
    dev.copy(src, dst, nbytes=16)
    np.testing.assert_array_equal(dev.read(dst), [0, 1, 2, 3, 0, 0, 0, 0, 0, 0])
    dev.write(dst, np.full(10, 7, np.uint32))
    np.testing.assert_array_equal(dst.read(), np.full(10, 7))
    dev.release(src)
    assert src.released
    with pytest.raises(BindingError, match="was released"):
        dev.read(src)


def test_the_interpreter_device_names_itself():
    d = InterpDevice(subgroup_size=4, features=["subgroup"])
    assert isinstance(d, Device) and d.subgroup_size == 4
    assert (d.name, d.backend) == ("shaderdsl interpreter", "interpreter")
    assert d.has_feature("subgroup") and not d.has_feature("shader-f16")
    assert Device().features == {"subgroup", "shader-f16", "chromium-experimental-subgroup-matrix"}
    with pytest.raises(ValueError, match="timestamp-query"):
        Device(features=["timestamp-query"])


# ================================================================== batches

def add_one(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    i = m.global_id().x
    with m.if_(i < B.array_length(out)):
        out[i] = x[i] + 1.0


def test_batch_runs_in_order(dev):
    """x -> a -> (copy) b -> c: each step reads what the one before wrote."""
    k = sd.compile(add_one, 32)
    x = np.random.default_rng(12).standard_normal(70).astype(np.float32)
    xb, a, b, c = dev.buffer(x), dev.zeros(70, np.float32), dev.zeros(70, np.float32), \
        dev.zeros(70, np.float32)
    with dev.batch() as batch:
        assert dev.in_batch
        dev.dispatch_1d(k, {"x": xb, "out": a}, 70)
        dev.copy(a, b)
        dev.dispatch_1d(k, {"x": b, "out": c}, 70)
        dev.dispatch_1d(k, {"x": c, "out": a}, 70)
    assert not dev.in_batch and batch.gpu_time_ns is None    # no timestamps asked for
    np.testing.assert_allclose(dev.read(b), x.astype(np.float64) + 1, rtol=RTOL_F32, atol=1e-6)
    np.testing.assert_allclose(dev.read(a), x.astype(np.float64) + 3, rtol=RTOL_F32, atol=1e-6)


def test_exception_in_a_batch_drops_its_work(dev):
    k = sd.compile(add_one, 32)
    xb, out = dev.buffer(np.ones(8, np.float32)), dev.zeros(8, np.float32)
    with pytest.raises(KeyError):
        with dev.batch():
            dev.dispatch(k, {"x": xb, "out": out}, 1)
            raise KeyError("stop")
    np.testing.assert_array_equal(dev.read(out), np.zeros(8))
    dev.dispatch(k, {"x": xb, "out": out}, 1)
    dev.sync()
    np.testing.assert_array_equal(dev.read(out), np.full(8, 2.0))


# ================================================================== same errors, same messages

def test_bad_input_same_errors_as_the_gpu(device):
    assert_refused_alike(device, Device(limits=device.limits))  # the same limit errors


def needs_subgroups(m):
    out = m.declare_output_buffer("out", u32)
    out[m.local_index()] = B.subgroup_add(u32(1))


def test_missing_feature_is_a_feature_error():
    d = Device(features=[])
    with pytest.raises(FeatureError, match=r"needs feature\(s\) 'subgroup' \(first used at "
                                           r"\S+test_interp_device.py:\d+; available on: "
                                           r"interp.Device.*device 'shaderdsl interpreter' "
                                           r"\(interpreter\) lacks it"):
        d.dispatch(sd.compile(needs_subgroups, 8), {"out": d.zeros(8, np.uint32)}, 1)
    assert d.stats["dispatches"] == 0


def test_missing_override_fails_like_a_gpu_pipeline(device, idev):
    k = sd.compile(scale128, 64)
    for d in (device, idev):
        bufs = {"x": d.buffer(np.zeros(128, np.float32)), "out": d.zeros(128, np.float32),
                "s": d.uniform(2.0)}
        with pytest.raises(WGSLCompileError, match="[Mm]issing value for pipeline-overridable"):
            d.dispatch(k, bufs, 2)


# ================================================================== per-dispatch uniform values

def affine(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    s = m.declare_uniform("s", f32)
    v = m.declare_uniform("v", vec4f)
    i = m.global_id().x
    with m.if_(i < B.array_length(out)):
        out[i] = x[i] * s + v.x + v.w


def test_uniform_given_as_a_value(dev):
    """A plain value for a uniform binding, per dispatch (in a batch too)."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal(50).astype(np.float32)
    k = sd.compile(affine, 16)
    xb, outs = dev.buffer(x), [dev.zeros(50, np.float32) for _ in range(3)]
    v = np.array([0.5, 9.0, 9.0, -2.0], np.float32)
    scales = (3.0, np.float32(-1.5), 0.25)
    with dev.batch():
        for s, out in zip(scales, outs):
            dev.dispatch_1d(k, {"x": xb, "out": out, "s": s, "v": v}, 50)
    for s, out in zip(scales, outs):
        want = x.astype(np.float64) * float(s) + 0.5 - 2.0
        np.testing.assert_allclose(dev.read(out), want, rtol=RTOL_F32, atol=1e-6)
    dev.dispatch_1d(k, [xb, outs[0], dev.uniform(np.float32(2)), v], 50)
    np.testing.assert_allclose(dev.read(outs[0]), x.astype(np.float64) * 2 - 1.5,
                               rtol=RTOL_F32, atol=1e-6)


# ================================================================== workgroup memory checks

def forgot_barrier(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    sh = m.shared(f32, 16, "tile")
    t = m.let(m.local_index(), "t")
    sh[t] = x[t]                                       # WRITE
    out[t] = sh[(t + 1) % 16]                          # READ: needs a barrier before it


def with_barrier(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    sh = m.shared(f32, 16, "tile")
    t = m.let(m.local_index(), "t")
    sh[t] = x[t]
    m.barrier()
    v = m.let(sh[(t + 1) % 16], "v")
    m.barrier()                                        # before anyone overwrites tile
    sh[t] = v * 2.0
    m.barrier()
    out[t] = sh[(t + 15) % 16]


def test_forgotten_barrier_is_a_race_naming_both_lines(idev):
    k = sd.compile(forgot_barrier, 16)
    bufs = {"x": idev.buffer(np.ones(16, np.float32)), "out": idev.zeros(16, np.float32)}
    with pytest.raises(RaceError) as info:
        idev.dispatch(k, bufs, 1)
    msg = str(info.value)
    assert names(msg, forgot_barrier, "# WRITE") and names(msg, forgot_barrier, "# READ")
    # invocation 0 reads tile[1] before invocation 1 writes it
    assert "tile[1]" in msg and "local_index 0" in msg and "local_index 1" in msg
    assert "workgroupBarrier()" in msg
    np.testing.assert_array_equal(idev.read(bufs["out"]), np.zeros(16))   # nothing written back


def test_correct_barriers_run_clean(idev):
    x = np.random.default_rng(14).standard_normal(16).astype(np.float32)
    out = idev.zeros(16, np.float32)
    idev.dispatch(sd.compile(with_barrier, 16), {"x": idev.buffer(x), "out": out}, 1)
    np.testing.assert_array_equal(idev.read(out), 2 * x)   # tile[(t+15)%16] = 2 x[t]


def write_write(m):
    out = m.declare_output_buffer("out", u32)
    sh = m.shared(u32, 4, "flags")
    t = m.let(m.local_index(), "t")
    sh[t / 2] = t                                      # two writers per element
    m.barrier()
    out[t] = sh[t / 2]


def write_after_read(m):
    out = m.declare_output_buffer("out", u32)
    sh = m.shared(u32, 8, "buf")
    t = m.let(m.local_index(), "t")
    sh[t] = t
    m.barrier()
    v = m.let(sh[(t + 1) % 8], "v")                    # READ
    sh[t] = v + 1                                      # WRITE: reader t - 1 read it already
    out[t] = v


def read_after_write(m):
    out = m.declare_output_buffer("out", u32)
    sh = m.shared(u32, 8, "buf")
    t = m.let(m.local_index(), "t")
    sh[t] = t                                          # WRITE
    out[t] = sh[B.max(t, 1) - 1]                       # READ: written by t - 1 before


def test_write_write_and_write_after_read_races():
    with pytest.raises(RaceError, match=r"flags\[0\].*written by local_index 0.*written by "
                                        r"local_index 1"):
        Interpreter(write_write, 8).dispatch({"out": np.zeros(8, np.uint32)})
    with pytest.raises(RaceError) as info:
        Interpreter(write_after_read, 8).dispatch({"out": np.zeros(8, np.uint32)})
    msg = str(info.value)
    assert "buf[1]" in msg and "read by local_index 0" in msg
    assert "then written by local_index 1" in msg
    assert names(msg, write_after_read, "# READ")
    assert starts_at(msg, write_after_read, "# WRITE")
    with pytest.raises(RaceError) as info:
        Interpreter(read_after_write, 8).dispatch({"out": np.zeros(8, np.uint32)})
    msg = str(info.value)
    assert "buf[0]" in msg and "written by local_index 0" in msg
    assert "then read by local_index 1" in msg
    assert starts_at(msg, read_after_write, "# READ")
    assert names(msg, read_after_write, "# WRITE")


def read_before_write(m):
    out = m.declare_output_buffer("out", f32)
    sh = m.shared(vec4f, 4, "acc")
    t = m.let(m.local_index(), "t")
    sh[t].x = f32(1.0)
    m.barrier()
    out[t] = sh[t].x + sh[3 - t].y                     # UNWRITTEN: .y never stored


def skipped_element(m):
    out = m.declare_output_buffer("out", f32)
    sh = m.shared(f32, 8, "part")
    t = m.let(m.local_index(), "t")
    with m.if_(t < 7):
        sh[t] = f32(1.0)
    m.barrier()
    out[t] = sh[7 - t]                                 # UNWRITTEN: part[7] by invocation 0


def test_read_of_unwritten_workgroup_memory_raises():
    with pytest.raises(UninitializedReadError) as info:
        Interpreter(read_before_write, 4).dispatch({"out": np.zeros(4, np.float32)})
    msg = str(info.value)
    assert starts_at(msg, read_before_write, "# UNWRITTEN")
    assert "acc[3].y" in msg and "local_index 0" in msg
    with pytest.raises(UninitializedReadError) as info:
        Interpreter(skipped_element, 8).dispatch({"out": np.zeros(8, np.float32)})
    msg = str(info.value)
    assert starts_at(msg, skipped_element, "# UNWRITTEN") and "part[7]" in msg


def test_checks_can_be_turned_off():
    """Off, workgroup memory reads as zeros and the order of invocations decides."""
    out = Interpreter(skipped_element, 8, check_uninitialized=False).dispatch(
        {"out": np.zeros(8, np.float32)})["out"]
    np.testing.assert_array_equal(out, [0, 1, 1, 1, 1, 1, 1, 1])
    x = np.arange(1, 17, dtype=np.float32)
    want = np.zeros(16)
    want[15] = 1.0      # each reads its neighbour before it wrote; the last wraps to tile[0]
    out = Interpreter(forgot_barrier, 16, check_races=False, check_uninitialized=False).dispatch(
        {"x": x, "out": np.zeros(16, np.float32)})["out"]
    np.testing.assert_array_equal(out, want)
    d = Device(check_races=False, check_uninitialized=False)
    o = d.zeros(16, np.float32)
    d.dispatch(sd.compile(forgot_barrier, 16), {"x": d.buffer(x), "out": o}, 1)
    np.testing.assert_array_equal(d.read(o), want)


def test_storage_barrier_does_not_order_workgroup_memory():
    def k(m):
        out = m.declare_output_buffer("out", u32)
        sh = m.shared(u32, 4, "sh")
        t = m.let(m.local_index(), "t")
        sh[t] = t
        m.storage_barrier()
        out[t] = sh[3 - t]
    with pytest.raises(RaceError, match=r"sh\[3\]"):
        Interpreter(k, 4).dispatch({"out": np.zeros(4, np.uint32)})


def reduce_and_scan(m, n, op, subgroups):
    x = m.declare_input_buffer("x", f32, n)
    out = m.declare_output_buffer("out", f32, 2 * n)
    i = m.global_id().x
    out[i] = C.reduce(m, x[i], op, subgroups=subgroups)
    out[n + i] = C.scan(m, x[i], op, inclusive=False, subgroups=subgroups)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("n", [7, 64, 100])
def test_collectives_are_clean(n, op):
    """reduce and scan (tree and subgroup forms) pass the checks and match numpy."""
    x = np.random.default_rng(n).integers(-50, 50, n).astype(np.float32)   # exact in f32
    red = {"sum": np.sum, "max": np.max}[op](x)
    acc = {"sum": np.cumsum, "max": np.maximum.accumulate}[op](x)
    first = 0.0 if op == "sum" else -3.4028234663852886e38
    for subgroups in (False, True):
        out = Interpreter(reduce_and_scan, n, subgroup_size=8, n=n, op=op,
                          subgroups=subgroups).dispatch(
            {"x": x, "out": np.zeros(2 * n, np.float32)})["out"]
        np.testing.assert_array_equal(out[:n], np.full(n, red))
        np.testing.assert_array_equal(out[n:], np.concatenate([[first], acc[:-1]]))


def shaped_race(m):
    out = m.declare_output_buffer("out", u32)
    tile = m.shared(u32, (4, 5), "tile")
    t = m.let(m.local_index(), "t")
    tile[t / 5, t % 5] = t
    out[t] = tile[(t + 1) / 5, (t + 1) % 5]           # no barrier: reads a neighbour's


def test_shaped_workgroup_array_names_row_and_column():
    with pytest.raises(RaceError, match=r"tile\[0, 1\].*read by local_index 0.*written by "
                                        r"local_index 1"):
        Interpreter(shaped_race, 20).dispatch({"out": np.zeros(20, np.uint32)})


def test_limits_default_to_webgpus_and_can_mirror_a_gpu(device):
    k = sd.compile(forgot_barrier, 512)
    with pytest.raises(DispatchError, match=r"workgroup_size\[0\] = 512 exceeds "
                                            r"max-compute-workgroup-size-x = 256 on 'shaderdsl "
                                            r"interpreter'"):
        Device().prepare(k)
    mirror = Device(limits=device.limits)
    assert mirror.limits["max-compute-workgroup-size-x"] == \
        device.limits["max-compute-workgroup-size-x"]
    if device.limits["max-compute-invocations-per-workgroup"] >= 512:
        mirror.prepare(k)                  # accepted where the GPU accepts it


def _partials_by_32(m):
    """Per-subgroup partial sums at part[local_index / 32]: right only with
    subgroups of 32 or more (with 4 or 8 lanes, subgroups collide)."""
    x = m.declare_input_buffer("x", f32, 64)
    out = m.declare_output_buffer("out", f32, 2)
    part = m.shared(f32, 2, "part")
    lid = m.let(m.local_index(), "lid")
    s = m.let(B.subgroup_add(x[lid]), "s")
    with m.if_(m.subgroup_invocation_id() == 0):
        part[lid / 32] = s
    m.barrier()
    with m.if_(lid < 2):
        out[lid] = part[lid]


def test_subgroup_kernels_run_at_several_sizes():
    """Unless a size is fixed: 4 and 64 first (errors only), then 32."""
    x = np.arange(64, dtype=np.float32)
    d = Device()
    with pytest.raises(RaceError, match=r"with subgroups of 4 \(a GPU may have them; "
                                        r"interp.Device\(subgroup_size=...\) runs one size "
                                        r"only\): \S+test_interp_device.py:\d+: data race on "
                                        r"workgroup array element part\[0\]"):
        d.dispatch(sd.compile(_partials_by_32, 64),
                   {"x": d.buffer(x), "out": d.zeros(2, np.float32)}, 1)
        d.sync()
    fixed = Device(subgroup_size=32)
    out = fixed.zeros(2, np.float32)
    fixed.dispatch(sd.compile(_partials_by_32, 64), {"x": fixed.buffer(x), "out": out}, 1)
    assert fixed.read(out).tolist() == [x[:32].sum(), x[32:].sum()]


def _chain(m):
    """Workgroup w > 0 extends what workgroup w - 1 wrote: right only in order."""
    out = m.declare_output_buffer("out", u32, 4)
    w = m.let(m.workgroup_id().x, "w")
    with m.if_(m.local_index() == 0):
        with m.if_(w == 0):
            out[0] = 7
        with m.else_():
            out[w] = out[w - 1] + 1


def test_results_that_hang_on_the_workgroup_order_raise():
    d = Device()
    with pytest.raises(InterpreterError, match=r"kernel '_chain': the results depend on the order "
                                               r"its workgroups run in: 'out'\[1\] is 8 with "
                                               r"workgroup \(0, 0, 0\) first and 1 with the last "
                                               r"first \(3 element\(s\) differ\). 'out'\[1\] "
                                               r"was written at \S+test_interp_device.py:\d+ in "
                                               r"workgroup \(1, 0, 0\)"):
        d.dispatch(sd.compile(_chain, 4), {"out": d.zeros(4, np.uint32)}, 4)
        d.sync()
    hist = d.zeros(8, np.uint32)  # atomics that add commute: the same either way
    values = d.buffer(np.arange(256, dtype=np.uint32))
    d.dispatch(sd.compile(EH.histogram, 64, nbins=8), {"values": values, "hist": hist}, 4)
    assert d.read(hist).tolist() == [32] * 8


def _shuffle_past_the_workgroup(m, lane_offset: int, lanes: int = 32):
    """A workgroup of 16 in subgroups of 32: lanes 16-31 do not exist."""
    x = m.declare_input_buffer("x", f32, 16)
    out = m.declare_output_buffer("out", f32, 16)
    i = m.let(m.local_index(), "i")
    out[i] = B.subgroup_shuffle(x[i], (i + lane_offset) % lanes)


def test_results_that_hang_on_reads_of_missing_lanes_raise():
    """WGSL leaves them indeterminate (the H200 gave 0): the device runs the
    dispatch again with another value for them, and the results must not change."""
    d = Device(subgroup_size=32)
    x = np.arange(1, 17, dtype=np.float32)
    with pytest.raises(InterpreterError, match=r"kernel '_shuffle_past_the_workgroup': the "
                                               r"results depend on reads of subgroup lanes "
                                               r"that are not active \(at \S+test_interp_device"
                                               r".py:\d+\): 'out'\[8\] is 0.0 where they read 0 "
                                               r"and 9.0 where they read the reader's own value"):
        out = d.zeros(16, np.float32)
        d.dispatch(sd.compile(_shuffle_past_the_workgroup, 16, lane_offset=8),
                   {"x": d.buffer(x), "out": out}, 1)
        d.sync()
    assert not d.read(out).any()  # nothing written
    with pytest.raises(InterpreterError, match=r"'out'\[15\] is 0.0"):  # lane 15 reads 16
        d.dispatch(sd.compile(_shuffle_past_the_workgroup, 16, lane_offset=1),
                   {"x": d.buffer(x), "out": d.zeros(16, np.float32)}, 1)
    out = d.zeros(16, np.float32)  # lanes 0-15 read lanes 0-15, turned: all exist
    d.dispatch(sd.compile(_shuffle_past_the_workgroup, 16, lane_offset=1, lanes=16),
               {"x": d.buffer(x), "out": out}, 1)
    assert d.read(out).tolist() == np.roll(x, -1).tolist()


def _select_guard(m):
    """select() evaluates both operands: x[i] is read for every i."""
    x = m.declare_input_buffer("x", f32, 8)
    out = m.declare_output_buffer("out", f32, 16)
    i = m.let(m.global_id().x, "i")
    out[i] = B.select(f32(-1.0), x[i], i < 8)


def test_robust_access_clamps_out_of_bounds_indices_as_a_gpu_does(device):
    """By default the interpreter raises for the read select() drops; with
    robust_access it clamps, and agrees with the GPU."""
    x = np.random.default_rng().standard_normal(8).astype(np.float32)
    want = np.concatenate([x, np.full(8, -1, np.float32)])
    with pytest.raises(OutOfBoundsError, match=r"test_interp_device.py:\d+: index 8 is out of "
                                               r"bounds for storage buffer `x` \(8 elements\)"):
        d = Device()
        d.dispatch(sd.compile(_select_guard, 16),
                   {"x": d.buffer(x), "out": d.zeros(16, np.float32)}, 1)
    for d in (Device(robust_access=True), device):
        out = d.zeros(16, np.float32)
        d.dispatch(sd.compile(_select_guard, 16), {"x": d.buffer(x), "out": out}, 1)
        np.testing.assert_array_equal(d.read(out), want)


# ---------------------------------------------------------------- races on storage buffers

def forgot_atomic(m):
    x = m.declare_input_buffer("x", f32)
    total = m.declare_output_buffer("total", f32, 1)
    total[0] += x[m.global_id().x]   # RACE: every invocation updates total[0]


def neighbours(m, barrier):
    y = m.declare_output_buffer("y", f32, 16)
    t = m.local_index()
    y[t] = f32(t)                     # WRITE
    if barrier == "storage":
        m.storage_barrier()
    elif barrier == "workgroup":
        m.barrier()
    y[(t + 1) % 16] += 1.0            # UPDATE: the neighbour's element


def per_invocation(m):
    y = m.declare_output_buffer("y", f32, 16)
    h = m.declare_output_buffer("h", atomic(u32), 1)
    t = m.local_index()
    y[t] = f32(t)
    y[t] += y[t] * 2.0                # its own element: no race
    B.atomic_add(h[0], 1)             # atomics do not race


def test_a_sum_that_needed_an_atomic_is_a_storage_race(idev):
    """On lavapipe 64 workgroups of 64 added 512 of 4096 ones; the interpreter
    added them all and said nothing. Now RaceError names the element, both
    invocations and the line."""
    k = sd.compile(forgot_atomic, 64)
    total = idev.zeros(1, np.float32)
    with pytest.raises(RaceError, match=r"data race on storage buffer element total\[0\] in "
                                        r"kernel 'forgot_atomic', workgroup \(0, 0, 0\): "
                                        r"written by local_index 0 at .*, then read by "
                                        r"local_index 1 .* no storageBarrier\(\) between them"
                       ) as info:
        idev.dispatch(k, {"x": idev.buffer(np.ones(64, np.float32)), "total": total}, 1)
    assert starts_at(str(info.value), forgot_atomic, "# RACE") and "atomic" in str(info.value)
    np.testing.assert_array_equal(idev.read(total), [0.0])   # nothing written back


@pytest.mark.parametrize("barrier", ["none", "storage", "workgroup"])
def test_storage_races_end_at_a_barrier(idev, barrier):
    """Two invocations' accesses to one element race unless a barrier parts
    them; the check takes a workgroupBarrier() as parting them too (lenient:
    WGSL orders only workgroup memory with it)."""
    k = sd.compile(neighbours, 16, barrier=barrier)
    y = idev.zeros(16, np.float32)
    if barrier == "none":
        with pytest.raises(RaceError) as info:
            idev.dispatch(k, {"y": y}, 1)
        msg = str(info.value)
        assert names(msg, neighbours, "# WRITE") and names(msg, neighbours, "# UPDATE")
        return
    idev.dispatch(k, {"y": y}, 1)
    np.testing.assert_array_equal(idev.read(y), np.arange(16) + 1.0)


def test_own_elements_and_atomics_are_not_storage_races(idev):
    y, h = idev.zeros(16, np.float32), idev.zeros(1, np.uint32)
    idev.dispatch(sd.compile(per_invocation, 16), {"y": y, "h": h}, 1)
    np.testing.assert_array_equal(idev.read(y), 3.0 * np.arange(16))
    assert idev.read(h)[0] == 16
    off = Interpreter(forgot_atomic, 64, check_races=False)
    got = off.dispatch({"x": np.ones(64, np.float32), "total": np.zeros(1, np.float32)}, 1)
    assert got["total"][0] == 64.0   # check_races=False: as before, one invocation at a time
