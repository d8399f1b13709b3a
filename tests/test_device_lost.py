"""A GPU device destroyed or lost: every call raises DeviceLostError (never a
raw wgpu error, never an abort at the next submit), weights and plans made
on it are refused by name, and ``get_device()`` opens a fresh device. Each
test destroys a device of its own, never the session's."""
from __future__ import annotations

import numpy as np
import pytest
import wgpu  # after shaderdsl.runtime: it installs Dawn's build as wgpu under SHADERDSL_WGPU=dawn

import lora
import shaderdsl as sd
from shaderdsl import DeviceLostError, f32
from shaderdsl import builtins as B
from shaderdsl.runtime import device as runtime_device
from shaderdsl.runtime import get_device

LOST = r"was lost \(.*\): nothing more runs on it.*get_device\(\)"


def add_one(m):
    """y[i] += 1"""
    y = m.declare_output_buffer("y", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < B.array_length(y)):
        y[i] = y[i] + 1.0


@pytest.fixture
def own_devices(monkeypatch, device):
    """get_device() with a cache of its own: the devices it opens are this test's."""
    monkeypatch.setattr(runtime_device, "_devices", {})
    yield
    for dev in {id(d): d for d in runtime_device._devices.values()}.values():
        if not dev.lost:
            dev.destroy()


def every_call(dev, buf, kernel):
    """The host API's calls on ``dev``, each on ``buf``."""
    return {"buffer": lambda: dev.buffer(np.zeros(4, np.float32)),
            "read": lambda: dev.read(buf),
            "write": lambda: dev.write(buf, np.zeros(64, np.float32)),
            "copy": lambda: dev.copy(buf, buf, 4),
            "dispatch": lambda: dev.dispatch(kernel, {"y": buf}, 1),
            "sync": dev.sync,
            "batch": lambda: dev.batch().__enter__()}


@pytest.mark.parametrize("how", ["wgpu", "device"])
def test_calls_on_a_destroyed_device_raise_device_lost(own_devices, how):
    """After ``device.wgpu_device.destroy()`` (the wgpu handle) or
    ``device.destroy()``, every call raises DeviceLostError naming the device,
    including a dispatch of a combination cached before (whose submit aborted
    the process in wgpu-native)."""
    dev = get_device()
    kernel = sd.compile(add_one, 64)
    buf = dev.zeros(64, np.float32)
    dev.dispatch(kernel, {"y": buf}, 1)
    assert np.array_equal(dev.read(buf), np.ones(64, np.float32))
    dev.wgpu_device.destroy() if how == "wgpu" else dev.destroy()
    assert dev.lost
    for name, call in every_call(dev, buf, kernel).items():
        with pytest.raises(DeviceLostError, match=LOST) as info:
            call()
        assert repr(dev) in str(info.value), name
    dev.release(buf)  # cleaning up after a loss is no error
    assert buf.released


def test_get_device_opens_a_fresh_device_after_a_loss(own_devices):
    dev = get_device()
    dev.wgpu_device.destroy()
    fresh = get_device()
    assert fresh is not dev and not fresh.lost
    buf = fresh.buffer(np.arange(8, dtype=np.float32))
    assert np.array_equal(fresh.read(buf), np.arange(8, dtype=np.float32))
    x, a, b = np.ones((3, 8), np.float32), np.ones((2, 8), np.float32), np.ones((4, 2), np.float32)
    assert np.array_equal(lora.forward(x, a, b), np.full((3, 4), 16, np.float32))


def test_weights_and_plans_of_a_lost_device_are_refused_by_name(own_devices):
    dev = get_device()
    rng = np.random.default_rng(0)
    weight = lora.Weight.from_numpy(dev, rng.standard_normal((2, 8)),
                                    rng.standard_normal((4, 2)))
    plan = lora.auto_plan(dev, weight, 1.0, 3)
    x, out = dev.buffer(np.ones((3, 8), np.float32)), dev.empty((3, 4), np.float32)
    plan(x, out)
    dev.destroy()
    with pytest.raises(DeviceLostError, match=r"<Weight rank=2 in_dim=8 out_dim=4 .* is lost"):
        weight.numpy()
    with pytest.raises(DeviceLostError, match=r"<Weight .* is lost"):
        weight.write(a=np.zeros((2, 8), np.float32))
    with pytest.raises(DeviceLostError, match=r"<Plan .* was made on a device that is lost: "):
        plan(x, out)
    lora.clear_plan_cache(weight)  # frees the plan's buffers: cleaning up is no error


def test_an_error_saying_lost_marks_the_device_lost(own_devices, monkeypatch):
    """A device lost without destroy() (a driver reset) is seen by the error
    its next call gets: that call raises DeviceLostError, and the device is
    replaced."""
    dev = get_device()
    buf = dev.zeros(4, np.float32)

    class LostQueue:
        def write_buffer(self, *args):
            raise wgpu.GPUValidationError("Validation Error\n\nCaused by:\n  In "
                                          "wgpuQueueWriteBuffer\n    Parent device is lost")
    monkeypatch.setattr(dev, "queue", LostQueue())
    with pytest.raises(DeviceLostError, match=r"was lost \(Parent device is lost\)"):
        dev.write(buf, np.ones(4, np.float32))
    assert dev.lost and get_device() is not dev
    dev.destroy()  # (its wgpu device is still alive: free it)


def test_other_wgpu_errors_are_not_called_lost(own_devices, monkeypatch):
    dev = get_device()
    buf = dev.zeros(4, np.float32)

    class FailingQueue:
        def write_buffer(self, *args):
            raise wgpu.GPUValidationError("Validation Error: something else")
    monkeypatch.setattr(dev, "queue", FailingQueue())
    with pytest.raises(wgpu.GPUValidationError, match="something else"):
        dev.write(buf, np.ones(4, np.float32))
    assert not dev.lost


def test_the_wgpu_buffer_is_not_exposed(device):
    """Destroying a buffer's wgpu handle behind the device's back aborted the
    process at the next submit: the handle is private; release() frees it."""
    buf = device.zeros(4, np.float32)
    assert not hasattr(buf, "wgpu_buffer")
    buf.release()
    assert buf.released
