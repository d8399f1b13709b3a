"""The bad-input cases of docs/errors.md that no other test file covers.

docs/errors.md lists every mistake with its exception, a real message and the
test that covers it; the rows whose test lives elsewhere (test_runtime.py,
test_lora_errors.py, test_codegen.py, test_strategies.py, test_features.py,
test_examples.py) name that test. This file has the rest, plus the NaN/Inf
behaviour of the LoRA forward and the examples.

Every refusal that happens before a dispatch is checked with ``refused``: the
call raises, ``device.stats["dispatches"]`` and ``["copies"]`` do not move, and
each output buffer reads back byte for byte as it was before the call.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import device_or_skip

import shaderdsl as sd
from lora import Strategy, Weight, forward, forward_plan
from lora.hesper import execute_lora_forward_auto
from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32
from shaderdsl.errors import (
    AliasingError,
    BindingError,
    DispatchError,
    FeatureError,
    KernelBuildError,
    NoAdapterError,
    ShaderNameError,
    ShaderTypeError,
    UniformityError,
    WGSLCompileError,
)
from shaderdsl.runtime import get_device, list_adapters

ROOT = Path(__file__).resolve().parents[1]
STORAGE_CAP = "max-storage-buffer-binding-size"
# Enumerated once, at collection, before any buffer is mapped (see settle()).
ADAPTERS = list_adapters()
BACKENDS = {a["backend"] for a in ADAPTERS}


# ---------------------------------------------------------------- helpers

def settle():
    """Give wgpu's poll thread time to finish before anything enumerates adapters.

    On the OpenGL backend, enumerating adapters on the main thread while
    wgpu-py's poll thread is still polling the device after a read makes
    wgpu-hal fail eglMakeCurrent (BadAccess) and abort the process
    (docs/errors.md, known issue 7). The runtime enumerates adapters for a
    FeatureError message and for a get_device() it has not cached; this file
    calls settle() before those instead of racing.
    """
    time.sleep(0.01)


@contextlib.contextmanager
def refused(devices, exc, match=None, buffers=()):
    """The block raises ``exc`` (message matching ``match``), records no dispatch
    or copy on any of ``devices``, and leaves every buffer in ``buffers`` as it was."""
    devices = devices if isinstance(devices, (list, tuple)) else [devices]
    for dev in devices:
        dev.sync()
    before = [{k: dev.stats[k] for k in ("dispatches", "copies")} for dev in devices]
    snaps = [(buf, buf.read().tobytes()) for buf in buffers]
    settle()
    with pytest.raises(exc, match=match) as info:
        yield info
    for dev, stats in zip(devices, before):
        for key, value in stats.items():
            assert dev.stats[key] == value, \
                f"{key} changed on {dev!r} although the call was refused"
    for buf, raw in snaps:
        assert buf.read().tobytes() == raw, f"{buf!r} changed although the call was refused"


def poisoned(device, n=64, dtype=np.float32, name="out"):
    """An output buffer holding 0.5, 1.5, 2.5, ...: any write shows."""
    return device.buffer((np.arange(n) + 0.5).astype(dtype), name=name)


def other_device(device):
    """The device of an adapter with another backend than ``device``'s, or skip."""
    others = [a for a in ADAPTERS if a["backend"] != device.backend]
    if not others:
        pytest.skip("only one adapter backend on this machine")
    settle()
    return device_or_skip(backend=others[0]["backend"])


def opengl_device():
    if not BACKENDS & {"OpenGL", "OpenGLES"}:
        pytest.skip("no OpenGL adapter on this machine")
    settle()
    return device_or_skip(backend="OpenGL")


def is_llvmpipe(device) -> bool:
    """lavapipe (Vulkan) or llvmpipe (OpenGL): the adapters whose NaN handling
    docs/errors.md records."""
    return "llvmpipe" in device.name.lower()


def add_one(m):
    """out[i] = x[i] + 1 over the length of out."""
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < B.array_length(out)):
        out[i] = x[i] + 1.0


def two_outputs(m):
    a = m.declare_output_buffer("a", f32)
    b = m.declare_output_buffer("b", f32)
    a[0] = 1.0
    b[0] = 2.0


def read_uniform(m):
    s = m.declare_uniform("s", f32)
    out = m.declare_output_buffer("out", f32)
    out[0] = s


def count(m):
    """One atomic increment per workgroup."""
    hits = m.declare_output_buffer("hits", sd.atomic(u32), 1)
    B.atomic_add(hits[0], 1)


ADD_ONE = sd.compile(add_one, 64)


# ================================================================ DSL build

def build_raising_inside_blocks(m, fail):
    x = m.declare_input_buffer("x", f32, 8)
    out = m.declare_output_buffer("out", f32, 8)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < 8):
        with m.loop(2, name="k"):
            if fail:
                {}["missing"]  # a plain Python bug, two blocks deep
            out[i] = x[i] * 2.0


def test_kernel_function_raising_inside_open_blocks(device):
    """KernelBuildError with the original as __cause__, even when the function
    dies with an if_ and a loop open; the next compile (and dispatch) works."""
    with pytest.raises(KernelBuildError, match=r"raised KeyError at .*test_error_catalogue\.py:"
                                               r"\d+: 'missing'") as info:
        sd.compile(build_raising_inside_blocks, 8, fail=True)
    assert isinstance(info.value.__cause__, KeyError)
    src = inspect.getsource(build_raising_inside_blocks).splitlines()
    line = build_raising_inside_blocks.__code__.co_firstlineno + next(
        k for k, text in enumerate(src) if '{}["missing"]' in text)
    assert f"test_error_catalogue.py:{line}: 'missing'" in str(info.value)
    # not cached: the same call raises again rather than returning a half-built kernel
    with pytest.raises(KernelBuildError):
        sd.compile(build_raising_inside_blocks, 8, fail=True)
    good = sd.compile(build_raising_inside_blocks, 8, fail=False)
    assert "for (var k: u32 = 0u; k < 2u; k += 1u) {" in good.wgsl
    out = device.zeros(8, np.float32)
    device.dispatch(good, {"x": device.buffer(np.arange(8, dtype=np.float32)), "out": out}, 1)
    np.testing.assert_array_equal(out.read(), np.arange(8) * 2.0)


def test_dsl_error_raised_midway_is_not_wrapped():
    """A DSL error inside the kernel function stays itself (not KernelBuildError)."""
    def mixes_types(m):
        x = m.declare_input_buffer("x", f32)
        with m.if_(m.global_id().x < 4):
            _ = x[0] + m.global_id().x  # raises: f32 + u32

    with pytest.raises(ShaderTypeError,
                       match=r"test_error_catalogue\.py:\d+: `\+` between f32 and u32"):
        sd.compile(mixes_types, 1)


@pytest.mark.parametrize("declare, match", [
    (lambda m: (m.declare_input_buffer("x", f32), m.override("x", f32, 1.0)),
     r"the name 'x' is already declared in kernel"),
    (lambda m: (m.declare_uniform("s", f32), m.shared(f32, 4, "s")),
     r"the name 's' is already declared in kernel"),
    (lambda m: m.declare_output_buffer("global_id", f32),
     r"the name 'global_id' is already declared in kernel"),
    (lambda m: m.declare_input_buffer("main", f32),
     r"'main' is a predeclared WGSL type or builtin function name"),
    (lambda m: m.override("filter", f32, 1.0), r"'filter' is a WGSL keyword or reserved word"),
])
def test_name_collisions_across_kinds(declare, match):
    with pytest.raises(ShaderNameError, match=match):
        sd.compile(lambda m: declare(m), 1)


def test_bad_compile_arguments():
    def k(m):
        m.declare_input_buffer("x", f32)

    with pytest.raises(ValueError,
                       match=r"workgroup_size must be 1 to 3 positive ints, got \(0,\)"):
        sd.compile(k, (0,))
    with pytest.raises(ValueError,
                       match=r"workgroup_size must be 1 to 3 positive ints, got \(1, 1, 1, 1\)"):
        sd.compile(k, (1, 1, 1, 1))
    with pytest.raises(ValueError,
                       match=r"kernel name must be a one-line printable str, got 'a\\nb'"):
        sd.compile(k, 1, name="a\nb")


def index_out_of_range(m):
    x = m.declare_input_buffer("x", f32, 4)
    out = m.declare_output_buffer("out", f32, 4)
    out[0] = x[7]


def assign_to_swizzle(m):
    out = m.declare_output_buffer("out", f32, 4)
    v = m.var(sd.vec4f(1.0, 2.0, 3.0, 4.0), name="v")
    m.assign(v.xy, sd.vec2f(0.0, 0.0))
    out[0] = v.x


@pytest.mark.parametrize("fn, match", [
    (index_out_of_range,
     r"test_error_catalogue\.py:\d+: index 7 is out of range for array<f32, 4>"),
    (assign_to_swizzle, r"test_error_catalogue\.py:\d+: WGSL cannot assign to a swizzle \('xy'\)"),
])
def test_more_build_time_type_errors(fn, match):
    """A constant index past a fixed-size array, and m.assign to a multi-letter
    swizzle (docs/dsl.md section 3.4 still says the latter reaches the compiler)."""
    with pytest.raises(ShaderTypeError, match=match):
        sd.compile(fn, 1)


def divides_by_zero(m):
    out = m.declare_output_buffer("out", f32, 4)
    out[0] = f32(1.0) / 0.0


def test_dsl_kernel_rejected_by_the_compiler(device):
    """WGSLCompileError from a DSL-built kernel: the excerpt shows the WGSL line
    with a caret, python_line the line of this file that built it; nothing runs,
    and the device keeps working."""
    kernel = sd.compile(divides_by_zero, 1)
    out = poisoned(device, 4)
    with refused(device, WGSLCompileError, r"WGSL compile error in kernel 'divides_by_zero'",
                 [out]) as info:
        device.dispatch(kernel, {"out": out}, 1)
    err = info.value
    want = f"test_error_catalogue.py:{divides_by_zero.__code__.co_firstlineno + 2}"
    assert err.python_line is not None and err.python_line.endswith(want), err.python_line
    assert f"built by Python at {err.python_line}" in str(err)
    assert "1.0f / 0.0f" in err.excerpt and "^" in err.excerpt
    assert err.kernel_name == "divides_by_zero" and err.wgsl_line is not None
    with refused(device, WGSLCompileError, buffers=[out]):
        device.prepare(kernel)  # not cached as compiled: still refused
    x = device.buffer(np.zeros(4, np.float32))
    device.dispatch(ADD_ONE, {"x": x, "out": out}, 1)
    np.testing.assert_array_equal(out.read(), np.ones(4))


def needs_override(m):
    out = m.declare_output_buffer("out", f32)
    a = m.override("a", f32)  # no default
    out[0] = a


def test_override_without_value(device):
    """An override with no default and no value: the pipeline is refused."""
    kernel = sd.compile(needs_override, 1)
    out = poisoned(device, 4)
    with refused(device, WGSLCompileError,
                 r"Missing value for pipeline-overridable constant .*'a'", [out]):
        device.dispatch(kernel, {"out": out}, 1)
    device.dispatch(kernel, {"out": out}, 1, overrides={"a": 3.0})
    assert out.read()[0] == 3.0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e39])
def test_non_finite_override_value(device, value):
    """A NaN, infinite or out-of-f32-range override value is refused before any
    pipeline is made. Nothing runs."""
    kernel = sd.compile(needs_override, 1)
    out = poisoned(device, 4)
    with refused(device, DispatchError, r"is not a finite f32", [out]):
        device.dispatch(kernel, {"out": out}, 1, overrides={"a": value})
    device.dispatch(kernel, {"out": out}, 1, overrides={"a": 2.0})
    assert out.read()[0] == 2.0


def barrier_in_divergent_if(m):
    x = m.declare_output_buffer("x", f32)  # read_write: its values vary
    out = m.declare_output_buffer("out", f32)
    i = m.let(m.workgroup_id().x, "i")
    with m.if_(x[i] > 0.0):
        m.barrier()  # not reached by every invocation of the workgroup
    out[i] = x[i]


def test_barrier_in_divergent_control_flow_is_refused():
    """WGSL's uniformity rules forbid this barrier: Tint refuses it, naga takes it;
    the DSL refuses it at build, naming the barrier's and the condition's lines."""
    with pytest.raises(UniformityError, match=r"workgroupBarrier\(\) at \S+test_error_catalogue"
                       r"\.py:\d+ runs in non-uniform control flow: the if at \S+:\d+, whose "
                       r"condition reads the read_write buffer 'x', which varies"):
        sd.compile(barrier_in_divergent_if, 64)


# ================================================================ buffers and bindings

def fixed_128(m):
    x = m.declare_input_buffer("x", f32, 128)
    out = m.declare_output_buffer("out", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < 128):
        out[i] = x[i]


def add_scaled_by_override(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    a = m.override("a", f32, 2.0)
    out[0] = a * x[0]


# (bindings given x and out, workgroups, kernel, exception, message). The same
# mistakes as in test_runtime.py, which proves the output unchanged; here the
# dispatch and copy counters are checked too.
RUNTIME_REFUSALS = {
    "wrong dtype": (lambda d, x, out: {"x": d.buffer(np.ones(64, np.int32)), "out": out}, 1,
                    "add_one", BindingError, r"expected dtype float32 \(WGSL f32\), got int32"),
    "too small": (lambda d, x, out: {"x": d.buffer(np.ones(100, np.float32)), "out": out}, 1,
                  "fixed_128", BindingError,
                  r"buffer has 400 bytes, needs at least 512 \(128 x f32, stride 4\)"),
    "missing name": (lambda d, x, out: {"out": out}, 1, "add_one", BindingError,
                     r"bindings do not match: it takes \['x', 'out'\]; missing \['x'\]"),
    "unknown name": (lambda d, x, out: {"x": x, "out": out, "z": x}, 1, "add_one",
                     BindingError, r"unknown \['z'\]"),
    "wrong count": (lambda d, x, out: [x], 1, "add_one",
                    BindingError, r"takes 2 bindings \['x', 'out'\], got 1"),
    "uniform for storage": (lambda d, x, out: {"x": d.uniform(np.ones(64, np.float32)),
                                               "out": out}, 1, "add_one", BindingError,
                            r"needs a storage buffer, got a uniform buffer"),
    "storage for uniform": (lambda d, x, out: {"s": d.buffer(np.ones(4, np.float32)), "out": out},
                            1, "read_uniform", BindingError,
                            r"needs a uniform buffer, got a storage buffer"),
    "read and write aliasing": (lambda d, x, out: {"x": out, "out": out}, 1, "add_one",
                                AliasingError,
                                r"one buffer is bound to 'x' \(read\), 'out' \(read_write\)"),
    "released": (lambda d, x, out: (x.release(), {"x": x, "out": out})[1], 1, "add_one",
                 BindingError, r"binding 'x' \(@binding\(0\)\): "
                               r"<Buffer #\d+ storage float32\[64\] released> was released"),
    "workgroups 0": (None, 0, "add_one", DispatchError,
                     r"workgroup count 0 on axis x must be >= 1"),
    "workgroups -1": (None, -1, "add_one", DispatchError,
                      r"workgroup count -1 on axis x must be >= 1"),
    "workgroups (1, 0)": (None, (1, 0), "add_one", DispatchError, r"workgroup count 0 on axis y"),
    "workgroups 70000": (None, 70000, "add_one", DispatchError,
                         r"workgroup count 70000 on axis x exceeds"),
    "workgroups 4 ints": (None, (1, 1, 1, 1), "add_one", DispatchError,
                          r"workgroups must be an int or 1 to 3 ints, got \(1, 1, 1, 1\)"),
    "workgroups ()": (None, (), "add_one", DispatchError,
                      r"workgroups must be an int or 1 to 3 ints, got \(\)"),
    "workgroups 2.5": (None, 2.5, "add_one", DispatchError,
                       r"workgroup counts must be ints, got 2.5"),
    "dispatch_1d n=0": (None, "n=0", "add_one", DispatchError, r"dispatch_1d needs n >= 1, got 0"),
    "missing feature": (None, 1, "needs_fake", FeatureError,
                        r"needs feature\(s\) 'fake-feature' "
                        r"\(available on: no adapter on this machine\)"),
    "too many invocations": (None, 1, "huge", DispatchError,
                             r"workgroup_size \(64, 64, 1\) has 4096 invocations, "
                             r"over max-compute-invocations"),
    "unknown override": (None, ("overrides", {"scael": 1.0}), "add_scaled_by_override",
                         DispatchError, r"has no override\(s\) \['scael'\]; it has \['a'\]"),
    "override not a number": (None, ("overrides", {"a": "big"}), "add_scaled_by_override",
                              DispatchError, r"override 'a': f32 needs a number, got 'big'"),
    "override bool": (None, ("overrides", {"a": True}), "add_scaled_by_override", DispatchError,
                      r"override 'a': bool given for f32"),
}


@pytest.mark.parametrize("case", list(RUNTIME_REFUSALS))
def test_runtime_refusals_record_nothing(device, case):
    import dataclasses

    make, wg, kname, exc, match = RUNTIME_REFUSALS[case]
    kernels = {"add_one": ADD_ONE, "fixed_128": sd.compile(fixed_128, 32),
               "read_uniform": sd.compile(read_uniform, 1),
               "needs_fake": dataclasses.replace(ADD_ONE, name="needs_fake",
                                                 features=frozenset({"fake-feature"})),
               "huge": dataclasses.replace(ADD_ONE, name="huge", workgroup_size=(64, 64, 1)),
               "add_scaled_by_override": sd.compile(add_scaled_by_override, 1)}
    kernel = kernels[kname]
    x, out = device.buffer(np.ones(64, np.float32)), poisoned(device)
    bindings = make(device, x, out) if make else {"x": x, "out": out}
    with refused(device, exc, match, [out]):
        if wg == "n=0":
            device.dispatch_1d(kernel, bindings, 0)
        elif isinstance(wg, tuple) and wg[:1] == ("overrides",):
            device.dispatch(kernel, bindings, 1, overrides=wg[1])
        else:
            device.dispatch(kernel, bindings, wg)


def test_copy_refusals_record_nothing(device):
    """The copy mistakes of test_runtime.py::test_copy, with the copy counter checked."""
    src = device.buffer(np.arange(10, dtype=np.uint32))
    dst = device.buffer(np.full(10, 7, np.uint32))
    with refused(device, BindingError, r"copy: nbytes=6 must be a non-negative multiple of 4",
                 [dst]):
        device.copy(src, dst, nbytes=6)
    with refused(device, BindingError, r"copy: nbytes=40 is larger than", [dst]):
        device.copy(src, device.zeros(2, np.uint32), nbytes=40)
    with refused(device, BindingError, r"copy: 40 bytes do not fit", [src]):
        device.copy(src, device.zeros(2, np.uint32))
    with refused(device, BindingError, r"copy: source and destination are the same buffer", [src]):
        device.copy(src, src)


@pytest.mark.parametrize("array, match", [
    (np.zeros(3, np.int64), r"dtype <i8 \(int64\) is not supported"),
    (np.zeros(3, bool), r"dtype \|b1 \(bool\) is not supported"),
    (np.zeros(3, ">f4"), r"dtype >f4 \(float32\) is not supported; use native-endian"),
    (np.zeros(3, np.complex64), r"complex64\) is not supported"),
    ([1.0, 2.0], r"buffer: expected a numpy array, got list"),
])
def test_host_arrays_the_runtime_refuses(device, array, match):
    bystander = poisoned(device, 4)
    with refused(device, BindingError, match, [bystander]):
        device.buffer(array)


def test_empty_shapes_and_dtypes(device):
    with refused(device, BindingError, r"negative shape \(2, -1\)"):
        device.empty((2, -1), np.float32)
    with refused(device, BindingError, r"buffer: dtype <f8 \(float64\) is not supported"):
        device.zeros(4, np.float64)
    with refused(device, BindingError, r"'float32x' is not a numpy dtype"):
        device.empty(4, "float32x")
    with refused(device, BindingError, r"shape must be an int or a tuple of ints, got 2.5"):
        device.empty(2.5, np.float32)


@pytest.mark.parametrize("value, match", [
    (True, r"uniform: bool is not host-shareable; pass np.uint32\(0/1\)"),
    (2**32, r"uniform: Python int 4294967296 does not fit u32"),
    (-1, r"uniform: Python int -1 does not fit u32; pass an np.int32"),
    ("2.0", r"uniform: expected a numpy array or scalar, got str"),
])
def test_uniform_values_refused(device, value, match):
    with refused(device, BindingError, match):
        device.uniform(value)


def test_write_needs_a_numpy_array(device):
    buf = poisoned(device, 5)
    with refused(device, BindingError, r"write to <Buffer 'out' #\d+ storage float32\[5\]>: "
                                       r"expected a numpy array, got list", [buf]):
        buf.write([1.0, 2.0, 3.0, 4.0, 5.0])


@pytest.mark.parametrize("what", ["ndarray", "None", "wrong dtype int32", "wrong dtype float16",
                                  "empty buffer"])
def test_bindings_that_do_not_fit(device, what):
    out = poisoned(device)
    x = {"ndarray": np.ones(64, np.float32), "None": None,
         "wrong dtype int32": device.buffer(np.ones(64, np.int32)),
         "wrong dtype float16": device.buffer(np.ones(64, np.float16)),
         "empty buffer": device.buffer(np.zeros(0, np.float32))}[what]
    match = {"ndarray": r"binding 'x' \(@binding\(0\)\): expected a Buffer "
                        r"\(device.buffer\(array\)\), got ndarray",
             "None": r"expected a Buffer .* got NoneType",
             "wrong dtype int32": r"expected dtype float32 \(WGSL f32\), got int32",
             "wrong dtype float16": r"expected dtype float32 \(WGSL f32\), got float16",
             "empty buffer": r"buffer has 0 bytes, needs at least 4 \(f32, stride 4\)"}[what]
    with refused(device, BindingError, match, [out]):
        device.dispatch(ADD_ONE, {"x": x, "out": out}, 1)


def test_unsigned_binding_refuses_signed_buffer(device):
    hits = device.buffer(np.array([7], np.int32))
    with refused(device, BindingError, r"binding 'hits' .* expected dtype uint32 .*got int32",
                 [hits]):
        device.dispatch(sd.compile(count, 1), {"hits": hits}, 1)


def test_runtime_does_not_check_shapes(device):
    """Not caught: the runtime checks dtype and byte size, not shape, so a 2-D
    buffer or a longer one binds to a 1-D array (the lora functions and Plans do
    check shapes)."""
    x = device.buffer(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = device.zeros((2, 6), np.float32)
    device.dispatch(ADD_ONE, {"x": x, "out": out}, 1)
    np.testing.assert_array_equal(out.read(), np.arange(1, 13).reshape(2, 6))


def test_write_write_aliasing(device):
    """Both uses write (test_runtime.py::test_aliasing has read + write)."""
    kernel = sd.compile(two_outputs, 1)
    out = poisoned(device, 4)
    with refused(device, AliasingError, r"kernel 'two_outputs': one buffer is bound to 'a' "
                                        r"\(read_write\), 'b' \(read_write\); WebGPU forbids",
                 [out]):
        device.dispatch(kernel, [out, out], 1)


def test_storage_binding_over_the_real_limit(device):
    """A storage buffer one element over max-storage-buffer-binding-size (a
    real allocation, done only where that limit is small) is refused."""
    cap = device.limits[STORAGE_CAP]
    if cap > 256 << 20:
        pytest.skip(f"{STORAGE_CAP} = {cap}: too big to allocate in a test")
    big = device.empty(cap // 4 + 1, np.float32)
    out = poisoned(device, 4)
    try:
        with refused(device, BindingError, rf"binding 'x' \(@binding\(0\)\): buffer of {cap + 4} "
                                           rf"bytes is over {STORAGE_CAP} = {cap}", [out]):
            device.dispatch(ADD_ONE, {"x": big, "out": out}, 1)
    finally:
        big.release()


def test_storage_binding_over_a_patched_limit(device, monkeypatch):
    """The limit is read from device.limits when bindings are first validated:
    with a 1 KiB limit, a DSL dispatch and a lora forward are both refused."""
    monkeypatch.setitem(device.limits, STORAGE_CAP, 1024)
    x = device.buffer(np.ones(300, np.float32))        # 1200 bytes
    out = poisoned(device, 16)
    with refused(device, BindingError,
                 rf"binding 'x' .*buffer of 1200 bytes is over {STORAGE_CAP} = 1024", [out]):
        device.dispatch(ADD_ONE, {"x": x, "out": out}, 1)
    rng = np.random.default_rng(0)
    w = Weight.from_numpy(device, rng.standard_normal((2, 200)), rng.standard_normal((16, 2)))
    x = device.buffer(np.ones(200, np.float32))  # 800 bytes: fits, A does not
    with refused(device, BindingError, rf"kernel 'fused_forward' binding 'A' .*buffer of 1600 "
                                       rf"bytes is over {STORAGE_CAP} = 1024", [out]):
        execute_lora_forward_auto(device, w, 1.0, x, out, strategy="single:64:1")


def test_uniform_binding_over_the_limit(device):
    cap = device.limits["max-uniform-buffer-binding-size"]
    if cap > 1 << 20:
        pytest.skip(f"max-uniform-buffer-binding-size = {cap}: too big for a test")
    s = device.uniform(np.zeros(cap // 4 + 1, np.float32))
    out = poisoned(device, 4)
    size = s.bound_bytes
    with refused(device, BindingError, rf"binding 's' .*buffer of {size} bytes is over "
                                       rf"max-uniform-buffer-binding-size = {cap}", [out]):
        device.dispatch(sd.compile(read_uniform, 1), {"s": s, "out": out}, 1)


def test_buffer_over_max_buffer_size(device, monkeypatch):
    """max-buffer-size is checked when a buffer is made (patched to 1 KiB here)."""
    monkeypatch.setitem(device.limits, "max-buffer-size", 1024)
    bystander = poisoned(device, 4)
    for make, size in ((lambda: device.buffer(np.zeros(257, np.float32)), 1028),
                       (lambda: device.empty(257, np.float32), 1028),
                       # 16-byte padding:
                       (lambda: device.uniform(np.zeros(257, np.float32)), 1040)):
        with refused(device, BindingError,
                     rf"buffer of {size} bytes is over max-buffer-size = 1024", [bystander]):
            make()
    device.buffer(np.zeros(256, np.float32))  # exactly at the limit: fine


def test_released_buffers_everywhere(device):
    """write, copy, Plan and the lora auto path refuse a released buffer;
    releasing twice is a no-op. (Dispatch and read: test_runtime.py::test_released_buffer.)"""
    dead = device.buffer(np.ones(4, np.float32))
    dead.release()
    dead.release()  # no error
    out = poisoned(device, 4)
    with refused(device, BindingError,
                 r"write: <Buffer #\d+ storage float32\[4\] released> was released"):
        dead.write(np.zeros(4, np.float32))
    with refused(device, BindingError, r"copy source: .* was released", [out]):
        device.copy(dead, out)
    with refused(device, BindingError, r"copy destination: .* was released", [out]):
        device.copy(out, dead)

    rng = np.random.default_rng(1)
    w = Weight.from_numpy(device, rng.standard_normal((2, 4)), rng.standard_normal((4, 2)))
    plan = forward_plan(device, w, 1.0, 1, Strategy.parse("seed"))
    with refused(device, BindingError,
                 r"<Plan seed .*>: input buffer must be a live Buffer on .* released>", [out]):
        plan(dead, out)
    # a weight released after its auto plan was cached: refused by the argument checks
    x = device.buffer(np.ones(4, np.float32))
    execute_lora_forward_auto(device, w, 1.0, x, out, strategy="single:64:1")
    w.b.release()
    with refused(device, BindingError, r"weight\.b: <Buffer 'lora\.B' #\d+ storage float32\[4, 2\] "
                                       r"released> was released", [out, x]):
        execute_lora_forward_auto(device, w, 1.0, x, out, strategy="single:64:1")


def test_buffers_of_another_device(device):
    """read, write, copy, dispatch and Plan refuse another device's buffer.
    (lora execute functions: test_lora_errors.py::test_buffer_of_another_device.)"""
    other = other_device(device)
    foreign = other.buffer(np.arange(4, dtype=np.float32))
    mine = poisoned(device, 4)
    with refused([device, other], BindingError,
                 r"read: <Buffer #\d+ storage float32\[4\]> belongs to another device", [foreign]):
        device.read(foreign)
    with refused([device, other], BindingError, r"write: .* belongs to another device", [foreign]):
        device.write(foreign, np.zeros(4, np.float32))
    with refused([device, other], BindingError, r"copy destination: .* belongs to another device",
                 [foreign, mine]):
        device.copy(mine, foreign)
    with refused([device, other], BindingError,
                 r"kernel 'add_one' binding 'x' \(@binding\(0\)\): .* belongs to another device",
                 [foreign, mine]):
        device.dispatch(ADD_ONE, {"x": foreign, "out": mine}, 1)
    rng = np.random.default_rng(2)
    w = Weight.from_numpy(device, rng.standard_normal((2, 4)), rng.standard_normal((4, 2)))
    plan = forward_plan(device, w, 1.0, 1, Strategy.parse("single:64:1"))
    with refused([device, other], BindingError, r"input buffer must be a live Buffer on",
                 [foreign, mine]):
        plan(foreign, mine)
    with refused([device, other], BindingError, r"Weight: a must be a Buffer on"):
        Weight(device, foreign, w.b, 4, 4, 1)


RELEASE_ON_THE_WRONG_DEVICE = textwrap.dedent("""
    import numpy as np
    import shaderdsl as sd
    from shaderdsl import f32
    from shaderdsl.errors import BindingError
    from shaderdsl.runtime import get_device

    def add_one(m):
        x = m.declare_input_buffer("x", f32)
        out = m.declare_output_buffer("out", f32)
        out[0] = x[0] + 1.0

    k = sd.compile(add_one, 1)
    mine, other = get_device("Vulkan"), get_device("OpenGL")
    x, out = mine.buffer(np.ones(4, np.float32)), mine.zeros(4, np.float32)
    mine.dispatch(k, {"x": x, "out": out}, 1)
    try:
        other.release(x)       # the wrong device: refused, x and mine's caches untouched
    except BindingError as e:
        print("refused:", e)
    mine.dispatch(k, {"x": x, "out": out}, 1)
    print("after:", mine.read(out)[0])
""")


def test_release_through_the_wrong_device():
    """Releasing through another device is refused; the buffer stays usable on its own.
    (In a subprocess: before the fix, the owner's next dispatch aborted the process.)"""
    if not {"Vulkan", "OpenGL"} <= BACKENDS:
        pytest.skip("needs a Vulkan and an OpenGL adapter")
    opengl_device()  # skips where the OpenGL adapter cannot open a device
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SHADERDSL_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", RELEASE_ON_THE_WRONG_DEVICE], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0 and "refused:" in r.stdout \
        and "belongs to another device" in r.stdout, \
        (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert "after: 2.0" in r.stdout


# ================================================================ dispatch

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_workgroup_count_at_and_over_the_limit(device, axis):
    """max-compute-workgroups-per-dimension workgroups run; one more is refused
    on every axis (x alone: test_runtime.py::test_bad_workgroups)."""
    cap = device.limits["max-compute-workgroups-per-dimension"]
    if cap > 1 << 16:
        pytest.skip(f"max-compute-workgroups-per-dimension = {cap}: too many to run in a test")
    kernel = sd.compile(count, 1)
    hits = device.zeros(1, np.uint32)
    grid = [1, 1, 1]
    grid[axis] = cap
    device.dispatch(kernel, {"hits": hits}, tuple(grid))
    assert hits.read()[0] == cap
    grid[axis] = cap + 1
    with refused(device, DispatchError, rf"kernel 'count': workgroup count {cap + 1} on axis "
                                        rf"{'xyz'[axis]} exceeds "
                                        rf"max-compute-workgroups-per-dimension = {cap}; "
                                        rf"split the grid", [hits]):
        device.dispatch(kernel, {"hits": hits}, tuple(grid))


@pytest.mark.parametrize("strategy", ["single:64:1", "seed", "split:64", "tiled:64:1"])
def test_lora_tokens_over_the_grid_limit(device, strategy):
    """70,000 tokens need 70,000 workgroups on one axis for some kernels: a plan
    with the count baked in refuses them before the first dispatch, on every
    strategy; the default (run-time) plans split the grid and run them."""
    tokens = 70000
    w = Weight.from_numpy(device, np.ones((1, 1)), np.ones((1, 1)))
    x = device.buffer(np.ones((tokens, 1), np.float32))
    out = device.buffer(np.full((tokens, 1), 5.0, np.float32))
    with refused(device, DispatchError, r"workgroup count 70000 on axis [xy] exceeds "
                                        r"max-compute-workgroups-per-dimension", [out]):
        forward_plan(device, w, 1.0, tokens, Strategy.parse(strategy))
    execute_lora_forward_auto(device, w, 1.0, x, out, strategy=strategy)
    assert (device.read(out) == 6.0).all()


def wide(m):
    out = m.declare_output_buffer("out", f32)
    out[0] = 1.0


def big_shared(m):
    out = m.declare_output_buffer("out", f32)
    s = m.shared(f32, 9000, "big")  # 36,000 bytes
    s[m.local_index()] = 1.0
    m.barrier()
    out[0] = s[0]


def test_workgroup_size_and_memory_over_the_limits(device):
    out = poisoned(device, 4)
    cap_x = device.limits["max-compute-workgroup-size-x"]
    with refused(device, DispatchError, rf"kernel 'wide': workgroup_size\[0\] = {2 * cap_x} "
                                        rf"exceeds max-compute-workgroup-size-x = {cap_x}",
                 [out]):
        device.dispatch(sd.compile(wide, (2 * cap_x,)), {"out": out}, 1)
    cap_z = device.limits["max-compute-workgroup-size-z"]
    with refused(device, DispatchError, rf"workgroup_size\[2\] = {2 * cap_z} exceeds "
                                        rf"max-compute-workgroup-size-z", [out]):
        device.dispatch(sd.compile(wide, (1, 1, 2 * cap_z)), {"out": out}, 1)
    mem = device.limits["max-compute-workgroup-storage-size"]
    if mem >= 36000:
        pytest.skip(f"max-compute-workgroup-storage-size = {mem}: 36,000 bytes fit")
    with refused(device, DispatchError, rf"kernel 'big_shared' declares 36000 bytes of workgroup "
                                        rf"memory, over max-compute-workgroup-storage-size = "
                                        rf"{mem}", [out]):
        device.dispatch(sd.compile(big_shared, 64), {"out": out}, 1)


# ================================================================ adapters and features

def negate_f16(m):
    src = m.declare_input_buffer("src", f16, 4)
    dst = m.declare_output_buffer("dst", f16, 4)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < 4):
        dst[i] = -src[i]


def test_f16_kernel_on_the_opengl_adapter(device):
    """FeatureError names the feature, the device, and the adapters that have it."""
    gl = opengl_device()
    if gl.has_feature("shader-f16"):
        pytest.skip("this OpenGL adapter has shader-f16")
    having = [f"{a['name']} ({a['backend']})" for a in ADAPTERS if "shader-f16" in a["features"]]
    where = ", ".join(having) if having else "no adapter on this machine"
    dst = gl.buffer(np.arange(4, dtype=np.float16))
    with refused(gl, FeatureError, None, [dst]) as info:
        src = gl.buffer(np.ones(4, np.float16))
        gl.dispatch(sd.compile(negate_f16, 4), {"src": src, "dst": dst}, 1)
    msg = str(info.value)
    line = next(n for n, text in enumerate(open(__file__).read().splitlines(), 1)
                if text.startswith("def negate_f16")) + 1  # src's declaration: the first f16 use
    assert (f"kernel 'negate_f16' needs feature(s) 'shader-f16' (first used at "
            f"tests/test_error_catalogue.py:{line}; available on: {where})") in msg
    assert f"device {gl.name!r} ({gl.backend}) lacks it" in msg
    assert "SHADERDSL_ADAPTER / SHADERDSL_BACKEND" in msg


def test_required_feature_on_a_backend_without_it():
    gl = opengl_device()
    if gl.has_feature("shader-f16"):
        pytest.skip("this OpenGL adapter has shader-f16")
    settle()
    with pytest.raises(FeatureError,
                       match=r"no matching adapter has feature\(s\) \['shader-f16'\]; "
                             r"adapters with all of \['shader-f16'\]: "):
        get_device(backend="OpenGL", features=["shader-f16"])


def test_lora_subgroup_strategy_on_the_opengl_adapter():
    gl = opengl_device()
    if gl.has_feature("subgroup"):
        pytest.skip("this OpenGL adapter has subgroups")
    w = Weight.from_numpy(gl, np.ones((2, 4)), np.ones((4, 2)))
    out = gl.buffer(np.arange(4, dtype=np.float32))
    with refused(gl, FeatureError, r"strategy single\(threads=64, subgroups=True\) needs the "
                                   r"'subgroup' feature, which .* \(OpenGL\) lacks", [out]):
        execute_lora_forward_auto(gl, w, 1.0, gl.buffer(np.ones(4, np.float32)), out,
                                  strategy="single:64:1:sg")


def test_adapter_that_cannot_open_a_device():
    """The H200 machine lists an OpenGL adapter whose request_device fails: the
    documented NoAdapterError names it (tests needing it skip with that text)."""
    from shaderdsl.runtime import Device

    class Broken:
        info = {"device": "Broken GPU", "backend_type": "OpenGL", "adapter_type": "Unknown"}
        features, limits = frozenset(), {}

        def request_device_sync(self, **kw):
            raise RuntimeError("Request device failed (3): Parent device is lost")

    with pytest.raises(NoAdapterError, match=r"adapter 'Broken GPU' \(OpenGL\) is listed but "
                                             r"cannot open a device: Request device failed"):
        Device(Broken())


def test_unknown_backend():
    names = [f"{a['name']} ({a['backend']})" for a in ADAPTERS]
    settle()
    with pytest.raises(NoAdapterError) as info:
        get_device(backend="Metal" if "Metal" not in str(names) else "D3D12")
    msg = str(info.value)
    assert "no adapter with backend" in msg and str(names) in msg
    assert "Check SHADERDSL_BACKEND / SHADERDSL_ADAPTER." in msg


def test_bad_wgpu_build_setting():
    env = dict(os.environ, PYTHONPATH=str(ROOT), SHADERDSL_WGPU="bogus")
    r = subprocess.run([sys.executable, "-c", "import shaderdsl.runtime"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=60)
    assert r.returncode != 0
    assert "NoAdapterError: SHADERDSL_WGPU='bogus': expected 'native' or 'dawn'" in r.stderr


# ================================================================ lora

def test_lora_auto_path_arguments(device):
    """The auto path checks scale, weight and buffers like the execute functions."""
    rng = np.random.default_rng(3)
    w = Weight.from_numpy(device, rng.standard_normal((2, 8)), rng.standard_normal((8, 2)))
    x, out = device.buffer(np.ones(8, np.float32)), poisoned(device, 8)
    with refused(device, ValueError, r"scale: expected a finite float32 value, got nan", [out]):
        execute_lora_forward_auto(device, w, float("nan"), x, out, strategy="single:64:1")
    with refused(device, ValueError, r"scale: expected a finite float32 value, got inf", [out]):
        execute_lora_forward_auto(device, w, float("inf"), x, out, strategy="single:64:1")
    with refused(device, BindingError, r"weight: expected a lora.Weight .* got tuple", [out]):
        execute_lora_forward_auto(device, (w.a, w.b), 1.0, x, out, strategy="single:64:1")
    with refused(device, BindingError, r"output_buf: expected dtype float32, got int32"):
        execute_lora_forward_auto(device, w, 1.0, x, device.buffer(np.zeros(8, np.int32)),
                                  strategy="single:64:1")
    with refused(device, ValueError, r"cannot parse strategy 'single:many'", [out]):
        execute_lora_forward_auto(device, w, 1.0, x, out, strategy="single:many")


def test_lora_forward_refuses_non_finite_weights_but_not_activations(device):
    """lora.forward: NaN/Inf in A or B is refused (Weight); in x or base it is computed."""
    a, b = np.ones((2, 3)), np.ones((4, 2))
    with pytest.raises(BindingError,
                       match=r"Weight: a has 1 NaN or infinite value\(s\) as float32"):
        forward(np.ones(3), np.array([[1, np.inf, 1], [1, 1, 1]]), b, device=device)
    got = forward(np.array([1.0, np.nan, 1.0]), a, b, np.zeros(4), device=device,
                  strategy="single:64:1")
    assert np.isnan(got).all()


# ================================================================ NaN and Inf

RANK, IN, OUT = 4, 32, 24


def nan_inf_problem(tokens):
    """A, B, x, base where row 0 of x holds a NaN, row 1 of base a +inf and a
    NaN, row 2 of x a +inf meeting an all-non-zero column of A (so h is +-inf and
    the outputs are +inf, -inf, or NaN from inf - inf and 0 * inf), row 3 finite."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((RANK, IN)).astype(np.float32)
    a[:, 7] = [1.0, -1.0, 2.0, 0.5]                     # h of row 2: +inf, -inf, +inf, +inf
    b = rng.standard_normal((OUT, RANK)).astype(np.float32)
    b[0] = [1, -1, 1, 1]                                # +inf
    b[1] = [-1, 1, -1, -1]                              # -inf
    b[2] = [1, 1, 1, 1]                                 # inf - inf = NaN
    b[3] = [0, -1, 1, 1]                                # 0 * inf = NaN
    x = rng.standard_normal((4, IN)).astype(np.float32)
    base = rng.standard_normal((4, OUT)).astype(np.float32)
    x[0, 3] = np.nan
    base[1, 0], base[1, 1] = np.inf, np.nan
    x[2, 7] = np.inf
    rows = {1: [2], 4: [0, 1, 2, 3]}[tokens]
    return a, b, x[rows], base[rows]


def numpy_f32(x, a, b, scale, base):
    """The forward in float32 numpy, with numpy's NaN/Inf semantics."""
    with np.errstate(all="ignore"):
        h = (x @ a.T).astype(np.float32)
        return (base + np.float32(scale) * (h @ b.T).astype(np.float32)).astype(np.float32)


def assert_like_numpy(got, want):
    """NaN where numpy has NaN, the same infinities, finite values within 1e-4."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


LORA_STRATEGIES = ["seed", "split:64", "single:64:1", "single:32:3:loop", "tiled:64:4",
                   "tiled:32:32:loop", "split:64:sg", "single:64:1:sg"]


@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", LORA_STRATEGIES)
@pytest.mark.parametrize("tokens", [1, 4])
def test_lora_nan_inf_propagate_like_numpy(device, strategy, tokens):
    s = Strategy.parse(strategy)
    if s.subgroups and not device.has_feature("subgroup"):
        pytest.skip("adapter lacks subgroup")
    a, b, x, base = nan_inf_problem(tokens)
    w = Weight.from_numpy(device, a, b)
    for scale in (1.0, -0.5):
        shape = (lambda arr: arr[0]) if tokens == 1 else (lambda arr: arr)
        out = device.buffer(shape(base))
        forward_plan(device, w, scale, tokens, s)(device.buffer(shape(x)), out)
        got = out.read().reshape(base.shape)
        want = numpy_f32(x, a, b, scale, base)
        assert np.isnan(want).any() and np.isinf(want).any()
        assert tokens == 1 or np.isfinite(want).any()
        assert_like_numpy(got, want)


@pytest.mark.parametrize("strategy", ["three:256", "split:256:seed", "single:256:1", "split:64"])
def test_lora_forward_paths_nan_inf(device, strategy):
    a, b, x, base = nan_inf_problem(4)
    got = forward(x, a, b, base, scale=2.0, device=device, strategy=strategy)
    assert_like_numpy(got, numpy_f32(x, a, b, 2.0, base))


@pytest.mark.parametrize("strategy", ["single:64:1", "tiled:64:4", "three:256", "split:256"])
def test_lora_scale_zero_with_nan_inf(device, strategy):
    """scale = 0: numpy gives NaN wherever B @ h is NaN or infinite (0 * inf,
    0 * NaN). The kernels bake 0.0 in as a literal and the shader compiler
    folds 0.0 * v to 0, so on lavapipe/llvmpipe the output is the base exactly
    (its own NaN and inf included). WGSL allows either."""
    a, b, x, base = nan_inf_problem(4)
    got = forward(x, a, b, base, scale=0.0, device=device, strategy=strategy)
    want = numpy_f32(x, a, b, 0.0, base)
    assert np.isnan(want).sum() > np.isnan(base).sum()
    if is_llvmpipe(device):
        np.testing.assert_array_equal(got, base)
    else:
        assert (np.array_equal(got, base, equal_nan=True)
                or np.array_equal(got, want, equal_nan=True))


SPECIALS_X = np.array([1, np.nan, np.inf, -np.inf, 0, np.inf, 2, -1, 0.5] * 8, np.float32)
SPECIALS_Y = np.array([1, 1, 1, np.inf, np.inf, -np.inf, np.nan, 3, -np.inf] * 8, np.float32)


@pytest.mark.parametrize("a_from", ["override", "uniform"])
def test_saxpy_nan_inf(device, a_from):
    from examples import saxpy

    got = saxpy.run(device, 2.5, SPECIALS_X, SPECIALS_Y, a_from=a_from)
    with np.errstate(all="ignore"):
        want = np.float32(2.5) * SPECIALS_X + SPECIALS_Y
    assert_like_numpy(got, want)


def test_saxpy_zero_times_inf(device):
    """a = 0: as a uniform, 0 * inf and 0 * NaN are NaN, as in numpy; as an
    override, the pipeline constant lets the shader compiler fold 0.0 * x to 0
    on lavapipe/llvmpipe, so y comes back unchanged."""
    from examples import saxpy

    with np.errstate(all="ignore"):
        want = np.float32(0.0) * SPECIALS_X + SPECIALS_Y
    assert_like_numpy(saxpy.run(device, 0.0, SPECIALS_X, SPECIALS_Y, a_from="uniform"), want)
    got = saxpy.run(device, 0.0, SPECIALS_X, SPECIALS_Y, a_from="override")
    if is_llvmpipe(device):
        np.testing.assert_array_equal(got, SPECIALS_Y)
    else:
        assert (np.array_equal(got, SPECIALS_Y, equal_nan=True)
                or np.array_equal(got, want, equal_nan=True))


@pytest.mark.parametrize("special, want", [(np.nan, np.nan), ("inf-inf", np.nan),
                                           (np.inf, np.inf), (-np.inf, -np.inf)])
def test_reduction_nan_inf(device, special, want):
    from examples import reduction

    x = np.ones(70000, np.float32)  # three passes
    if special == "inf-inf":
        x[10], x[65000] = np.inf, -np.inf
    else:
        x[12345] = special
    for subgroups in [False] + ([True] if device.has_feature("subgroup") else []):
        got = reduction.run(device, x, subgroups=subgroups)
        assert np.array_equal(got, want, equal_nan=True), (subgroups, got)


def test_matmul_nan_inf(device):
    from examples import matmul

    a = np.ones((9, 11), np.float32)
    a[1, 2], a[3, 0] = np.nan, np.inf
    b = np.ones((11, 10), np.float32)
    b[0, 4], b[5, 6] = 0.0, -np.inf                     # 0 * inf and inf - inf
    with np.errstate(all="ignore"):
        want = a @ b
    assert np.isnan(want).any() and np.isinf(want).any()
    np.testing.assert_array_equal(matmul.run(device, a, b), want)  # small integers: exact


@pytest.mark.parametrize("cols", [8, 7])
def test_half_gemv_nan_inf(device, cols):
    from examples import half

    if not device.has_feature("shader-f16"):
        pytest.skip("adapter lacks shader-f16")
    w = np.ones((3, cols), np.float16)
    w[0, 1], w[1, 2], w[2, 3] = np.nan, np.inf, 0
    x = np.ones(cols, np.float32)
    x[3] = np.inf                                        # row 1: inf + inf; row 2: 0 * inf
    with np.errstate(all="ignore"):
        want = w.astype(np.float32) @ x
    np.testing.assert_array_equal(half.run(device, w, x), want)


def min_max_clamp(m, n):
    a = m.declare_input_buffer("a", f32, n)
    b = m.declare_input_buffer("b", f32, n)
    lo = m.declare_output_buffer("lo", f32, n)
    hi = m.declare_output_buffer("hi", f32, n)
    cl = m.declare_output_buffer("cl", f32, n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        lo[i] = B.min(a[i], b[i])
        hi[i] = B.max(a[i], b[i])
        cl[i] = B.clamp(a[i], 0.0, 1.0)


def test_min_max_clamp_with_nan(device):
    """WGSL leaves min/max/clamp of a NaN indeterminate. On lavapipe and
    llvmpipe min/max return the other operand, like np.fmin/np.fmax (not
    np.minimum/np.maximum, which return NaN), and clamp(NaN, 0, 1) is 0, where
    np.clip gives NaN. Both NaN: NaN."""
    av = np.array([np.nan, 1, np.nan, np.inf, -np.inf, np.nan, 0.25], np.float32)
    bv = np.array([1, np.nan, np.nan, 1, 1, -np.inf, 0.75], np.float32)
    n = av.size
    bufs = {"a": device.buffer(av), "b": device.buffer(bv)}
    for k in ("lo", "hi", "cl"):
        bufs[k] = device.buffer(np.full(n, 9.0, np.float32))
    device.dispatch(sd.compile(min_max_clamp, 64, n=n), bufs, 1)
    lo, hi, cl = (bufs[k].read() for k in ("lo", "hi", "cl"))
    both = np.isnan(av) & np.isnan(bv)
    assert np.isnan(lo[both]).all() and np.isnan(hi[both]).all()
    finite = ~np.isnan(av) & ~np.isnan(bv)
    np.testing.assert_array_equal(lo[finite], np.minimum(av, bv)[finite])
    np.testing.assert_array_equal(hi[finite], np.maximum(av, bv)[finite])
    one = np.isnan(av) ^ np.isnan(bv)
    for got, fn in ((lo, np.fmin), (hi, np.fmax)):   # allowed: NaN or the other operand
        assert np.all(np.isnan(got[one]) | (got[one] == fn(av, bv)[one]))
    assert np.isnan(cl[np.isnan(av)]).all() or np.isin(cl[np.isnan(av)], [0.0, 1.0]).all()
    if is_llvmpipe(device):
        np.testing.assert_array_equal(lo, np.fmin(av, bv))
        np.testing.assert_array_equal(hi, np.fmax(av, bv))
        np.testing.assert_array_equal(cl, np.where(np.isnan(av), 0.0, np.clip(av, 0, 1)))
