"""What several test files share: a second wgpu device or a skip, LoRA
problems and the checks of their results, and the bad input every device must
refuse with the GPU device's exceptions and messages. (The devices the tests
run on are fixtures in conftest.py.)"""
from __future__ import annotations

import re

import numpy as np
import pytest
from numpy.typing import DTypeLike

import shaderdsl as sd
from lora import reference as R
from shaderdsl import f32, interp
from shaderdsl.errors import AliasingError, BindingError, DispatchError

# ---------------------------------------------------------------- devices

def device_or_skip(backend=None, **kw):
    """get_device(backend, ...), or a skip naming the adapter when it is listed
    but cannot open a device (the H200's OpenGL adapter: "Parent device is lost")."""
    from shaderdsl.errors import NoAdapterError
    from shaderdsl.runtime import get_device

    try:
        return get_device(backend, **kw)
    except NoAdapterError as e:
        if "cannot open a device" not in str(e):
            raise
        pytest.skip(str(e).splitlines()[0])


def h200_interp():
    """A new interpreter device as the H200 (under Dawn) is for matrix kernels:
    subgroups of 32, its subgroup-matrix shapes (the interpreter's default) and
    48 KiB of workgroup memory (WebGPU's default, 16 KiB, is too little for
    the matrix tilings)."""
    return interp.Device(subgroup_size=32, limits={"max-compute-workgroup-storage-size": 49152})


# ---------------------------------------------------------------- LoRA problems


def normal(rng, shape):
    """Standard normal float32 values."""
    return rng.standard_normal(shape).astype(np.float32)


def kernel_lead(tokens):
    """Leading shape of a kernel's activations: () for the 1-D buffers of
    ``tokens=None`` (a kernel built for one vector), else (T,)."""
    return () if tokens is None else (tokens,)


def plan_lead(tokens):
    """Leading shape of a Plan's activations: () for one token ((dim,) buffers), else (T,)."""
    return () if tokens == 1 else (tokens,)


def problem(rng, rank, in_dim, out_dim, tokens, positive=False, *, rows=False,
            dtype: DTypeLike = np.float32):
    """Random A [rank, in_dim], B [out_dim, rank], x [lead, in_dim] and base
    [lead, out_dim] for one forward, in ``dtype``: lead is ``plan_lead(tokens)``,
    or (tokens,) even for one token with ``rows`` (a runtime-token plan's buffers).
    ``positive``: all-positive A, B and x, so no cancellation can make the delta
    of an element a kernel forgets small. In float16, A is scaled by
    1/sqrt(in_dim), as a trained adapter's is, so sums stay far from 65504."""
    lead = (tokens,) if rows else plan_lead(tokens)
    a = rng.standard_normal((rank, in_dim))
    if np.dtype(dtype) == np.float16:
        a /= np.sqrt(in_dim)
    b = rng.standard_normal((out_dim, rank))
    x, base = rng.standard_normal(lead + (in_dim,)), rng.standard_normal(lead + (out_dim,))
    if positive:
        a, b, x = np.abs(a) + 0.01, np.abs(b) + 0.01, np.abs(x) + 0.01
    return tuple(v.astype(dtype) for v in (a, b, x, base))


def assert_close(got, want, tol, what=""):
    """Elementwise |got - want| <= tol, same shape, no NaN (an element never
    written, where outputs start as NaN); names the first element out of bounds."""
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} NaN element(s)"
    bad = np.argwhere(np.abs(got - want) > tol)
    assert bad.size == 0, (f"{what}: {len(bad)} element(s) out of tolerance, first at "
                           f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want "
                           f"{want[tuple(bad[0])]}, tol {tol[tuple(bad[0])]}")


def check_result(got, a, b, x, base, scale, what):
    """A float32 forward's output within ``reference.tolerance`` of float64
    numpy; with scale 0 (or -0), the base exactly."""
    assert got.dtype == np.float32, (what, got.dtype)
    if scale == 0:
        assert np.array_equal(got, base), f"{what}: scale 0 must leave the base exactly"
        return
    assert_close(got, R.forward(x, a, b, scale, base), R.tolerance(x, a, b, scale, base), what)


# ---------------------------------------------------------------- bad input, alike everywhere

def scale128(m):
    x = m.declare_input_buffer("x", f32, 128)
    out = m.declare_output_buffer("out", f32)
    s = m.declare_uniform("s", f32)
    a = m.override("a", f32)
    out[m.global_id().x] = x[m.global_id().x] * s * a


# The exception of each bad input that is not a BindingError.
BAD_INPUT_ERRORS = {"aliasing": AliasingError, "zero workgroups": DispatchError,
                    "four dims": DispatchError, "too many workgroups": DispatchError,
                    "dispatch_1d n=0": DispatchError, "unknown override": DispatchError,
                    "override type": DispatchError, "nan override": DispatchError}


def bad_inputs(dev, other):
    """name -> a call that must fail, built from ``dev``'s buffers (``other``:
    a second device, whose buffers ``dev`` must refuse)."""
    k = sd.compile(scale128, 64)
    x, out, s = dev.buffer(np.zeros(128, np.float32)), dev.zeros(128, np.float32), dev.uniform(2.0)
    ok, o = {"x": x, "out": out, "s": s}, {"a": 1.0}
    gone = dev.buffer(np.zeros(128, np.float32))
    dev.release(gone)

    def run(workgroups: int | tuple = 2, overrides=o, **given):
        return lambda: dev.dispatch(k, {**ok, **given}, workgroups, overrides=overrides)
    return {
        "wrong dtype": run(x=dev.buffer(np.zeros(128, np.int32))),
        "too small": run(x=dev.buffer(np.zeros(100, np.float32))),
        "missing": lambda: dev.dispatch(k, {"x": x, "s": s}, 2, overrides=o),
        "unknown": run(y=x), "too few": lambda: dev.dispatch(k, [x, out], 2, overrides=o),
        "not a buffer": run(x=np.zeros(128, np.float32)), "uniform as storage": run(x=s),
        "storage as uniform": run(s=x), "aliasing": run(out=x), "released": run(x=gone),
        "other device": run(x=other.buffer(np.zeros(128, np.float32))),
        "zero workgroups": run(0), "four dims": run((1, 1, 1, 1)),
        "too many workgroups": run((1, 65536)),
        "dispatch_1d n=0": lambda: dev.dispatch_1d(k, ok, 0, overrides=o),
        "unknown override": run(overrides={"b": 1.0}), "override type": run(overrides={"a": "big"}),
        "nan override": run(overrides={"a": float("nan")}),
        "value of another dtype": run(s=3),              # a Python int is a u32 uniform
        "value of another shape": run(s=np.zeros(2, np.float32)),
        "bool value": run(s=True), "str value": run(s="2"), "value for storage": run(x=3.0),
        "write shape": lambda: dev.write(out, np.zeros(127, np.float32)),
        "write list": lambda: dev.write(out, [0.0] * 128),
        "read released": lambda: dev.read(gone),
        "read other": lambda: dev.read(other.buffer(np.zeros(4, np.float32))),
        "copy odd": lambda: dev.copy(x, out, nbytes=6), "copy same": lambda: dev.copy(x, x),
        "copy too big": lambda: dev.copy(x, dev.zeros(2, np.float32)),
        "buffer dtype": lambda: dev.buffer(np.zeros(4, np.float64)),
        "buffer list": lambda: dev.buffer([1.0, 2.0]),
        "empty shape": lambda: dev.empty((2, -1), np.float32),
        "uniform bool": lambda: dev.uniform(True), "uniform negative": lambda: dev.uniform(-1),
    }


def normalized(e: Exception, devices) -> str:
    """The message without what differs by nature: buffer numbers and device names."""
    msg = re.sub(r"#\d+", "#N", str(e))
    for d in devices:
        msg = msg.replace(f"({d.name!r}, {d.backend})", "(DEVICE)").replace(repr(d.name), "DEVICE")
    return msg


def assert_refused_alike(gpu, dev):
    """Every bad input gets the same exception type and message from ``dev`` as
    from the GPU device, and ``dev`` runs and copies nothing meanwhile."""
    gpu_cases, dev_cases = bad_inputs(gpu, dev), bad_inputs(dev, gpu)
    before = dict(dev.stats)
    for name, gpu_call in gpu_cases.items():
        with pytest.raises(Exception) as g:
            gpu_call()
        with pytest.raises(Exception) as d:
            dev_cases[name]()
        assert type(g.value) is type(d.value), (name, g.value, d.value)
        assert isinstance(d.value, BAD_INPUT_ERRORS.get(name, BindingError)), (name, d.value)
        assert normalized(g.value, (gpu, dev)) == normalized(d.value, (gpu, dev)), name
    assert (dev.stats["dispatches"], dev.stats["copies"]) == \
        (before["dispatches"], before["copies"])
