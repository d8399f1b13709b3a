"""device.capture() and device.replay(): a graph of dispatches and copies
recorded once and recorded again per step, on the wgpu device and on the
interpreter's (each with its own form of a capture)."""
import numpy as np
import pytest

import shaderdsl as sd
from shaderdsl import f32, u32
from shaderdsl.errors import BindingError


def _scale_add(m, n):
    """y = 2 y + x: a step whose result depends on how many times it ran."""
    x = m.declare_input_buffer("x", f32, n)
    y = m.declare_output_buffer("y", f32, n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        y[i] = 2.0 * y[i] + x[i]


def _offset_add(m, n):
    """y[i] += off: a kernel given a uniform value."""
    y = m.declare_output_buffer("y", f32, n)
    off = m.declare_uniform("off", u32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        y[i] += f32(off)


def _devices(device):
    from shaderdsl import interp
    return [device, interp.Device()]


def test_a_replayed_graph_does_what_recording_it_again_does(device):
    """A step of two dispatches and a copy, captured at its first run and
    replayed 3 times in one batch, leaves what 4 recorded steps leave."""
    n = 37
    kernel = sd.compile(_scale_add, 64, n=n)
    rng = np.random.default_rng(0)
    x0, y0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for dev in _devices(device):
        x, y, z = dev.buffer(x0), dev.buffer(y0), dev.empty((n,), np.float32)

        def step(dev=dev, x=x, y=y, z=z):
            dev.dispatch_1d(kernel, {"x": x, "y": y}, n)
            dev.copy(y, z)
            dev.dispatch_1d(kernel, {"x": z, "y": y}, n)

        with dev.batch(), dev.capture() as graph:
            step()
        assert len(graph) == 3
        before = dev.stats["dispatches"]
        with dev.batch():
            for _ in range(3):
                dev.replay(graph)
        assert dev.stats["dispatches"] - before == 6
        want_y = y0.astype(np.float64)
        for _ in range(4):
            want_y = 2 * want_y + x0
            want_y = 2 * want_y + want_y
        np.testing.assert_allclose(dev.read(y), want_y, rtol=1e-5, err_msg=repr(dev))


def test_what_cannot_be_replayed_is_refused(device):
    """A released buffer, uniform values given to a dispatch, a capture inside
    a capture, and something other than a capture: each refused by name,
    before anything is recorded."""
    n = 8
    scale, offset = sd.compile(_scale_add, 64, n=n), sd.compile(_offset_add, 64, n=n)
    for dev in _devices(device):
        x, y = dev.buffer(np.ones(n, np.float32)), dev.empty((n,), np.float32)
        with dev.capture() as graph:
            dev.dispatch_1d(scale, {"x": x, "y": y}, n)
            with pytest.raises(RuntimeError, match="a capture is open already"):
                with dev.capture():
                    pass
        with dev.capture() as valued:
            dev.dispatch_1d(offset, {"y": y, "off": np.uint32(3)}, n)
        dev.release(x)
        before = dev.stats["dispatches"]
        with pytest.raises(BindingError, match=r"which the capture uses, was released"):
            dev.replay(graph)
        with pytest.raises(BindingError, match=r"uniform values"):
            dev.replay(valued)
        with pytest.raises(TypeError, match=r"expected a Capture"):
            dev.replay([])
        assert dev.stats["dispatches"] == before
