"""Bad input to the lora package: each mistake raises a clear error before any
dispatch, and leaves every buffer as it was. Also Config, Weight, the CLI and
the example script."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import device_or_skip

import lora
from lora import Config, Strategy, Weight, forward, forward_plan
from lora import reference as R
from lora.hesper import (
    execute_add_scaled,
    execute_fused_b_add,
    execute_lora_forward,
    execute_lora_forward_fused,
    execute_lora_forward_single,
    execute_project_a,
    execute_project_b,
    save_activation,
)
from shaderdsl.errors import AliasingError, BindingError, DispatchError, FeatureError

RANK, IN, OUT = 3, 40, 24


@pytest.fixture
def setup(device):
    """A weight, buffers for 1 token (x, out, h, y) and snapshots of their contents."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((RANK, IN)).astype(np.float32)
    b = rng.standard_normal((OUT, RANK)).astype(np.float32)
    w = Weight.from_numpy(device, a, b)
    host = {"x": rng.standard_normal(IN).astype(np.float32),
            "out": rng.standard_normal(OUT).astype(np.float32),
            "h": np.full(RANK, np.nan, np.float32), "y": np.full(OUT, np.nan, np.float32)}
    bufs = {k: device.buffer(v, name=k) for k, v in host.items()}
    return w, bufs, host


def unchanged(device, bufs, host):
    for k, v in host.items():
        assert np.array_equal(device.read(bufs[k]).view(np.uint32), v.view(np.uint32)), k


class NoDispatch:
    """Asserts that the block records no dispatch or copy, and raises ``exc``."""

    def __init__(self, device, exc, match):
        self.device, self.raises = device, pytest.raises(exc, match=match)

    def __enter__(self):
        self.before = dict(self.device.stats)
        self.raises.__enter__()

    def __exit__(self, *exc_info):
        swallowed = self.raises.__exit__(*exc_info)
        for key in ("dispatches", "copies"):
            assert self.device.stats[key] == self.before[key], key
        return swallowed


def calls(device, w, b):
    """Every execute function, with the buffers from ``b`` (a dict)."""
    return {
        "project_a": lambda: execute_project_a(device, w, b["x"], b["h"]),
        "project_b": lambda: execute_project_b(device, w, b["h"], b["y"]),
        "add_scaled": lambda: execute_add_scaled(device, b["y"], b["out"], None, 2.0),
        "fused_b_add": lambda: execute_fused_b_add(device, w, 2.0, b["h"], b["out"]),
        "three": lambda: execute_lora_forward(device, w, 2.0, b["x"], b["out"], b["h"], b["y"]),
        "fused": lambda: execute_lora_forward_fused(device, w, 2.0, b["x"], b["out"], b["h"]),
        "single": lambda: execute_lora_forward_single(device, w, 2.0, b["x"], b["out"]),
    }


# ---------------------------------------------------------------- buffers

WRONG_SHAPES = [
    ("x", (IN + 1,), "three",
     r"input_buf: expected shape \(in_dim,\) = \(40,\) or \(tokens, 40\), got \[41\]"),
    ("x", (IN, 2), "single", r"input_buf: expected shape .* got \[40, 2\]"),
    ("x", (IN + 1,), "project_a", r"x_buf: expected shape \(in_dim,\)"),
    ("h", (RANK + 1,), "fused",
     r"h_buf: expected shape \(3,\) or \(1, 3\) for 1 token\(s\) of rank = 3, got \[4\]"),
    ("h", (2, RANK), "three", r"h_buf: expected shape \(3,\) or \(1, 3\)"),
    ("y", (OUT - 1,), "three", r"y_buf: expected shape \(24,\) or \(1, 24\) .* got \[23\]"),
    ("y", (OUT + 1,), "project_b", r"y_buf: expected shape \(24,\)"),
    ("out", (2, OUT), "fused", r"output_buf: expected shape \(24,\) or \(1, 24\)"),
    ("out", (OUT - 1,), "single", r"output_buf: expected shape"),
    ("out", (OUT - 1,), "fused_b_add", r"output_buf: expected shape"),
    ("h", (RANK, 1), "project_b", r"h_buf: expected shape \(rank,\) = \(3,\) or \(tokens, 3\)"),
]


@pytest.mark.parametrize("name, shape, call, match", WRONG_SHAPES)
def test_wrong_shapes(device, setup, name, shape, call, match):
    w, bufs, host = setup
    bad = dict(bufs)
    bad[name] = device.buffer(np.full(shape, 5.0, np.float32))
    with NoDispatch(device, BindingError, match):
        calls(device, w, bad)[call]()
    unchanged(device, bufs, host)
    assert np.all(device.read(bad[name]) == 5.0)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint32])
@pytest.mark.parametrize("name, call", [("x", "three"), ("out", "fused"), ("h", "three"),
                                        ("y", "add_scaled"), ("out", "single")])
def test_wrong_dtypes(device, setup, dtype, name, call):
    w, bufs, host = setup
    bad = dict(bufs)
    bad[name] = device.buffer(np.ones(host[name].shape, dtype))
    with NoDispatch(device, BindingError, rf"expected dtype float32, got {np.dtype(dtype).name}"):
        calls(device, w, bad)[call]()
    unchanged(device, bufs, host)


@pytest.mark.parametrize("call", ["three", "fused", "single", "project_a"])
def test_not_a_buffer(device, setup, call):
    w, bufs, host = setup
    bad = dict(bufs, x=host["x"])  # a numpy array instead of a Buffer
    with NoDispatch(device, BindingError, r"expected a Buffer .* got ndarray"):
        calls(device, w, bad)[call]()
    unchanged(device, bufs, host)


def test_add_scaled_too_small(device, setup):
    w, bufs, host = setup
    small = device.buffer(np.ones(OUT - 1, np.float32))
    with NoDispatch(device, BindingError, r"y_buf: num_elements = 24 but the buffer holds only 23"):
        execute_add_scaled(device, small, bufs["out"], OUT, 1.0)
    with NoDispatch(device, BindingError, r"output_buf: num_elements = 25 but .* only 24"):
        execute_add_scaled(device, device.buffer(np.ones(25, np.float32)), bufs["out"], 25, 1.0)
    with NoDispatch(device, ValueError, r"num_elements must be an int >= 1, got 0"):
        execute_add_scaled(device, bufs["y"], bufs["out"], 0, 1.0)
    unchanged(device, bufs, host)


def test_multi_token_mismatch(device, setup):
    w, bufs, host = setup
    x2 = device.buffer(np.ones((2, IN), np.float32))
    with NoDispatch(device, BindingError, r"output_buf: expected shape \(2, 24\) for 2 token"):
        execute_lora_forward_fused(device, w, 1.0, x2, bufs["out"], bufs["h"])
    unchanged(device, bufs, host)


# ---------------------------------------------------------------- aliasing

ALIASES = [
    ("three", dict(out="x"), r"input_buf and output_buf are the same buffer"),
    ("fused", dict(out="x"), r"input_buf and output_buf are the same buffer"),
    ("single", dict(out="x"), r"input_buf and output_buf are the same buffer"),
    ("three", dict(h="y"), r"h_buf and y_buf are the same buffer"),
    ("project_b", dict(y="h"), r"h_buf and y_buf are the same buffer"),
    ("add_scaled", dict(y="out"), r"y_buf and output_buf are the same buffer"),
    ("fused_b_add", dict(h="out"), r"h_buf and output_buf are the same buffer"),
    ("project_a", dict(h="x"), r"x_buf and h_buf are the same buffer"),
]


@pytest.mark.parametrize("call, alias, match", ALIASES)
def test_aliasing(device, device_for_alias, call, alias, match):
    """Same buffer in two roles, one written: AliasingError, nothing recorded.
    (The buffers are made big enough for both roles, so only aliasing is wrong.)"""
    w, bufs, host = device_for_alias
    (dst, src), = alias.items()
    bad = dict(bufs)
    bad[dst] = bufs[src]
    with NoDispatch(device, AliasingError, match):
        calls(device, w, bad)[call]()
    unchanged(device, bufs, host)


@pytest.fixture
def device_for_alias(device):
    """Square weight with in_dim = out_dim = rank, so every buffer fits every role."""
    rng = np.random.default_rng(1)
    n = 8
    w = Weight.from_numpy(device, rng.standard_normal((n, n)), rng.standard_normal((n, n)))
    host = {k: rng.standard_normal(n).astype(np.float32) for k in ("x", "out", "h", "y")}
    return w, {k: device.buffer(v) for k, v in host.items()}, host


def test_weight_buffer_as_output(device):
    """rank 1, in_dim = out_dim = 4: A's buffer (1, 4) has the shape of a one-token output."""
    rng = np.random.default_rng(2)
    w = Weight.from_numpy(device, rng.standard_normal((1, 4)), rng.standard_normal((4, 1)))
    a_before = device.read(w.a)
    x = device.buffer(np.ones(4, np.float32))
    with NoDispatch(device, AliasingError, r"output_buf and weight.a are the same buffer"):
        execute_lora_forward_single(device, w, 1.0, x, w.a)
    with NoDispatch(device, AliasingError, r"output_buf and weight.a are the same buffer"):
        execute_lora_forward(device, w, 1.0, x, w.a, device.empty(1, np.float32),
                             device.empty(4, np.float32))
    np.testing.assert_array_equal(device.read(w.a), a_before)


# ---------------------------------------------------------------- other arguments

def test_bad_arguments(device, setup):
    w, b, host = setup

    def run(**kw):
        return execute_lora_forward(device, w, kw.pop("scale", 1.0), b["x"], b["out"], b["h"],
                                    b["y"], **kw)

    with NoDispatch(device, ValueError, r"scale: expected a finite float32 value, got nan"):
        run(scale=float("nan"))
    with NoDispatch(device, ValueError, r"scale: expected a finite"):
        run(scale=1e39)
    with NoDispatch(device, TypeError, r"scale: expected a real number, got str"):
        run(scale="2")
    with NoDispatch(device, TypeError, r"scale: expected a real number, got bool"):
        run(scale=True)
    with NoDispatch(device, ValueError, r"projection: expected one of \('workgroup', 'seed'\), "
                                        r"got 'fast'"):
        run(projection="fast")
    with NoDispatch(device, ValueError, r"threads: expected a power of two .* got 96"):
        run(threads=96)
    with NoDispatch(device, ValueError, r"threads must be an int >= 1, got 0"):
        run(threads=0)
    with NoDispatch(device, DispatchError, r"threads: 2048 is over max-compute-invocations"):
        run(threads=2048)
    with NoDispatch(device, ValueError, r"subgroups=True applies to projection='workgroup' "
                                        r"only, got projection='seed'"):
        run(projection="seed", subgroups=True)
    with NoDispatch(device, ValueError, r"outputs_per_thread must be an int >= 1, got 0"):
        execute_lora_forward_single(device, w, 1.0, b["x"], b["out"], outputs_per_thread=0)
    with NoDispatch(device, BindingError, r"weight: expected a lora.Weight .* got tuple"):
        execute_lora_forward_fused(device, (w.a, w.b), 1.0, b["x"], b["out"], b["h"])
    unchanged(device, b, host)


def test_limits_are_checked_before_dispatch(device):
    rng = np.random.default_rng(3)
    w1 = Weight.from_numpy(device, np.ones((1, 1)), np.ones((1, 1)))
    with NoDispatch(device, DispatchError, r"workgroup count 70000 on axis x exceeds"):
        forward_plan(device, w1, 1.0, 70000, Strategy.parse("three"))  # the count baked in
    invocations = device.limits["max-compute-invocations-per-workgroup"]
    if invocations < 1024:  # (WebGPU's default, 256, refuses 1024 threads first)
        pytest.skip(f"{device.name} allows {invocations} invocations per workgroup; the "
                    "workgroup-memory case needs 1024")
    if device.has_feature("subgroup"):
        w = Weight.from_numpy(device, rng.standard_normal((64, 8)), rng.standard_normal((8, 64)))
        x, out = device.buffer(np.ones(8, np.float32)), device.buffer(np.zeros(8, np.float32))
        with NoDispatch(device, DispatchError, r"bytes of workgroup memory, over "
                                               r"max-compute-workgroup-storage-size"):
            execute_lora_forward_single(device, w, 1.0, x, out, threads=1024, subgroups=True)
        assert not device.read(out).any()


def test_subgroups_without_the_feature(device, setup, monkeypatch):
    w, b, host = setup
    monkeypatch.setattr(device, "features", device.features - {"subgroup"})
    lora.clear_plan_cache()
    with NoDispatch(device, FeatureError, r"subgroups=True needs the 'subgroup' feature"):
        execute_lora_forward_single(device, w, 1.0, b["x"], b["out"], subgroups=True)
    with NoDispatch(device, FeatureError, r"'subgroup'"):
        execute_project_a(device, w, b["x"], b["h"], subgroups=True)
    unchanged(device, b, host)


def test_released_buffer_after_a_cached_call(device, setup):
    """A plan checked earlier is not trusted blindly: a released buffer still
    raises before the first of the three dispatches."""
    w, b, host = setup
    y = device.buffer(np.zeros(OUT, np.float32))
    execute_lora_forward(device, w, 1.0, b["x"], b["out"], b["h"], y)
    host["out"] = device.read(b["out"])
    host["h"] = device.read(b["h"])
    y.release()
    with NoDispatch(device, BindingError, r"y_buf: .* was released"):
        execute_lora_forward(device, w, 1.0, b["x"], b["out"], b["h"], y)
    unchanged(device, b, host)


def test_buffer_of_another_device(device, setup):
    from shaderdsl.runtime import list_adapters

    others = [a for a in list_adapters() if a["backend"] != device.backend]
    if not others:
        pytest.skip("only one adapter backend on this machine")
    other = device_or_skip(backend=others[0]["backend"])
    w, b, host = setup
    x = other.buffer(host["x"])
    with NoDispatch(device, BindingError, r"input_buf: .* belongs to another device"):
        execute_lora_forward_single(device, w, 1.0, x, b["out"])
    with NoDispatch(other, BindingError, r"weight: .* lives on another device"):
        execute_lora_forward_single(other, w, 1.0, x, other.buffer(host["out"]))
    unchanged(device, b, host)


def test_failure_in_a_batch_records_nothing(device, setup):
    w, b, host = setup
    bad_y = device.buffer(np.zeros(OUT + 1, np.float32))
    with pytest.raises(BindingError):
        with device.batch():
            execute_lora_forward(device, w, 1.0, b["x"], b["out"], b["h"], bad_y)
    unchanged(device, b, host)


def test_save_activation_errors(device, setup):
    w, b, host = setup
    with NoDispatch(device, AliasingError, r"src_buf and dst_buf are the same buffer"):
        save_activation(device, b["x"], b["x"])
    with NoDispatch(device, BindingError,
                    r"dst_buf: num_elements = 40 but the buffer holds only 24"):
        save_activation(device, b["x"], b["out"])
    with NoDispatch(device, BindingError, r"dst_buf: expected dtype float32, got int32"):
        save_activation(device, b["x"], device.buffer(np.zeros(IN, np.int32)))
    unchanged(device, b, host)


# ---------------------------------------------------------------- lora.forward

def test_numpy_forward_errors(device):
    a, b = np.ones((2, 5)), np.ones((3, 2))
    x = np.ones(5)
    with pytest.raises(BindingError,
                       match=r"x: a is \[rank, in_dim\] = \[2, 5\], so x must end in 5"):
        forward(np.ones(6), a, b, device=device)
    with pytest.raises(BindingError, match=r"x: expected a real floating dtype .* got int64"):
        forward(np.ones(5, np.int64), a, b, device=device)
    with pytest.raises(BindingError, match=r"x: expected a real floating dtype .* got complex128"):
        forward(np.ones(5, complex), a, b, device=device)
    with pytest.raises(BindingError, match=r"x: expected shape \(in_dim,\) or \(\.\.\., in_dim\) "
                                           r"with in_dim >= 1, got \(5, 0\)"):
        forward(np.ones((5, 0)), a, b, device=device)
    with pytest.raises(BindingError, match=r"base: expected shape \(3,\)"):
        forward(x, a, b, np.ones(4), device=device)
    with pytest.raises(BindingError, match=r"b must be \[out_dim, 2\], got \[3, 3\]"):
        forward(x, a, np.ones((3, 3)), device=device)
    with pytest.raises(ValueError, match="give alpha or scale, not both"):
        forward(x, a, b, alpha=1.0, scale=1.0, device=device)
    with pytest.raises(ValueError, match=r"strategy must be one of \('seed', 'three', 'split', "
                                         r"'single', 'tiled', 'gemm', 'matrix'\), "
                                         r"got 'double' in 'double'"):
        forward(x, a, b, strategy="double", device=device)
    # alpha / rank, and the default scale 1
    np.testing.assert_allclose(forward(x, a, b, alpha=4.0, device=device), np.full(3, 20.0))
    np.testing.assert_allclose(forward(x, a, b, device=device), np.full(3, 10.0))


def test_leading_dimensions_and_no_tokens_as_torch_takes_them(device):
    """[batch, seq, in_dim] goes in as torch's Linear takes it; an empty batch
    gives an empty result; a wrongly shaped grad_out is named as such."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((2, 5)), rng.standard_normal((3, 2))
    x, base = rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 4, 3))
    got = forward(x, a, b, base, scale=0.5, device=device)
    assert got.shape == (2, 4, 3)
    want = base + 0.5 * np.einsum("or,ri,bsi->bso", b, a, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert forward(np.zeros((0, 5)), a, b, device=device).shape == (0, 3)
    assert forward(np.zeros((2, 0, 5)), a, b, device=device).shape == (2, 0, 3)
    g = rng.standard_normal((2, 4, 3))
    dx, da, db = lora.backward(x, a, b, g, scale=0.5, device=device)
    assert dx.shape == x.shape and da.shape == a.shape and db.shape == b.shape
    want_dx, want_da, want_db = (lora.reference.backward(x.reshape(8, 5), a, b, g.reshape(8, 3),
                                                         0.5)[k] for k in ("grad_x", "grad_a",
                                                                           "grad_b"))
    np.testing.assert_allclose(dx.reshape(8, 5), want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(da, want_da, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(db, want_db, rtol=1e-4, atol=1e-5)
    assert [v.shape for v in lora.backward(np.zeros((0, 5)), a, b, np.zeros((0, 3)),
                                           device=device)] == [(0, 5), (2, 5), (3, 2)]
    with pytest.raises(BindingError, match=r"grad_out: expected shape \(2, 4, 3\)"):
        lora.backward(x, a, b, np.ones((2, 4, 4)), device=device)


# ---------------------------------------------------------------- Config and Weight

def test_config():
    assert Config(8, 16).scale == 2.0
    assert Config(4).alpha == 4.0 and Config(4).scale == 1.0
    assert Config(8, -4).scale == -0.5 and Config(1, 0).scale == 0.0
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        Config(0, 1.0)
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        Config(2.0, 1.0)  # pyright: ignore[reportArgumentType]  (the wrong type is the test)
    with pytest.raises(TypeError, match="rank must be an int, got bool"):
        Config(True, 1.0)
    with pytest.raises(ValueError, match="alpha must be finite"):
        Config(2, float("inf"))
    with pytest.raises(TypeError, match="alpha must be a real number"):
        Config(2, "16")  # pyright: ignore[reportArgumentType]  (the wrong type is the test)
    with pytest.raises(AttributeError):
        Config(2, 2).rank = 3  # pyright: ignore[reportAttributeAccessIssue]  (frozen: the test)


def test_weight_from_numpy(device):
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    b = np.arange(8, dtype=np.float16).reshape(4, 2)
    w = Weight.from_numpy(device, a, b)
    assert (w.rank, w.in_dim, w.out_dim) == (2, 3, 4)
    ra, rb = w.numpy()
    assert ra.dtype == rb.dtype == np.float32
    np.testing.assert_array_equal(ra, a)
    np.testing.assert_array_equal(rb, b)
    w.write(b=np.ones((4, 2)))
    np.testing.assert_array_equal(w.numpy()[1], 1.0)
    with pytest.raises(BindingError, match=r"Weight.write: b must be \[4, 2\], got \[2, 4\]"):
        w.write(b=np.ones((2, 4)))


@pytest.mark.parametrize("a, b, match", [
    (np.ones(3), np.ones((4, 1)), r"a must be 2-D \[rank, in_dim\], got shape \(3,\)"),
    (np.ones((2, 3), np.int32), np.ones((4, 2)), r"a must have a real floating dtype .* got int32"),
    (np.ones((2, 3)), np.ones((4, 2), complex),
     r"b must have a real floating dtype .* got complex128"),
    (np.ones((2, 3)), np.ones((4, 2), bool), r"got bool"),
    (np.ones((2, 3)), np.ones((4, 3)),
     r"rank mismatch: a is \[rank, in_dim\] = \[2, 3\], so b must be \[out_dim, 2\], "
     r"got \[4, 3\]"),
    (np.ones((0, 3)), np.ones((4, 0)), r"must have no empty dimension"),
    (np.full((2, 3), np.nan), np.ones((4, 2)), r"a has 6 NaN or infinite value\(s\)"),
    (np.ones((2, 3)), np.full((4, 2), 1e39), r"b has 8 NaN or infinite value\(s\) as float32"),
])
def test_weight_rejects(device, a, b, match):
    with pytest.raises(BindingError, match=match):
        Weight.from_numpy(device, a, b)


def test_weight_init_is_peft_like(device):
    w = Weight.init(device, 2560, 300, 8, seed=1)
    a, b = w.numpy()
    assert a.shape == (8, 2560) and b.shape == (300, 8)
    assert not b.any()
    bound = 1 / np.sqrt(2560)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.99 * bound
    assert abs(a.std() - bound / np.sqrt(3)) < 0.02 * bound  # uniform: std = bound / sqrt(3)
    np.testing.assert_array_equal(Weight.init(device, 2560, 300, 8, seed=1).numpy()[0], a)
    assert not np.array_equal(Weight.init(device, 2560, 300, 8, seed=2).numpy()[0], a)
    with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
        Weight.init(device, 4, 4, 0)


def test_reference_float32_and_float64():
    rng = np.random.default_rng(0)
    a, b, x = rng.standard_normal((4, 9)), rng.standard_normal((7, 4)), rng.standard_normal((2, 9))
    want = x @ a.T @ b.T * 0.5
    np.testing.assert_allclose(R.lora_delta(x, a, b, 0.5), want, rtol=1e-12)
    assert R.forward(x, a, b, 0.5, dtype=np.float32).dtype == np.float32
    np.testing.assert_allclose(R.forward(x[0], a, b, 0.5, np.ones(7)), 1 + want[0], rtol=1e-12)
    assert R.fused_b_add(b, x @ a.T, np.zeros((2, 7)), 0.5).shape == (2, 7)


# ---------------------------------------------------------------- command line and example

def test_cli_wgsl_every_kernel(capsys):
    from lora.apps.cli import SHAPE_OPTION_KERNELS, main

    for name in SHAPE_OPTION_KERNELS:
        assert main(["wgsl", name, "--rank", "8", "--in-dim", "16", "--out-dim", "16",
                     "--scale", "2.0"]) == 0
        out = capsys.readouterr().out
        assert f"// kernel {name}" in out and "@compute @workgroup_size(256, 1, 1)" in out
    assert main(["wgsl", "project_a", "--projection", "seed", "--info"]) == 0
    out = capsys.readouterr().out
    assert "// kernel project_a_seed" in out and "// binding 2: h read_write f32 length=8" in out
    assert main(["wgsl", "fused_forward", "--subgroups", "--tokens", "2", "--threads", "64"]) == 0
    out = capsys.readouterr().out
    assert "subgroupAdd" in out and "@workgroup_size(64, 1, 1)" in out
    assert main(["wgsl", "add_scaled", "--out-dim", "100", "--tokens", "3", "--scale", "-1.5"]) == 0
    assert "output[i] += -1.5f * y[i];" in capsys.readouterr().out
    assert main(["wgsl", "project_b", "--rank", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["wgsl", "nope"])
    assert main(["wgsl", "fused_forward", "--dtype", "f16", "--info"]) == 0
    out = capsys.readouterr().out
    assert "enable f16;" in out and "A: array<vec4<f16>" in out and "output: array<f16," in out
    assert "// kernel fused_forward_f16" in out and "shader-f16" in out
    assert main(["wgsl", "project_a", "--rank", "64", "--rank-group", "8"]) == 0
    assert "let r0 = workgroup_id.y * 8u;" in capsys.readouterr().out
    assert main(["wgsl", "tiled_forward", "--rank", "64", "--tokens", "32",
                 "--token-block", "4"]) == 0
    assert "acc3_15" in capsys.readouterr().out  # 4 tokens x 16 of the 64 ranks per thread
    assert main(["wgsl", "tiled_forward", "--token-block", "3"]) == 1
    assert "token_block (3) must divide tile_tokens (16)" in capsys.readouterr().err
    assert main(["wgsl", "project_a", "--rank-group", "-1"]) == 1


@pytest.mark.slow  # python -m lora check and demo: every kernel
def test_cli_check_and_demo(device, capsys):
    from lora.apps.cli import main

    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") >= 12 and "all passed" in out
    assert main(["demo", "--rank", "4", "--dim", "300", "--tokens", "2", "--repeat", "3",
                 "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert device.name in out
    from lora.apps.demo_cli import ROW_NAMES

    for strategy, dispatches in (("three", 3), ("split", 2), ("single", 1)):
        name = ROW_NAMES[strategy]
        row = next(r for r in out.splitlines() if r.startswith(name))
        fields = row[len(name):].split()
        assert fields[:2] == [str(dispatches), "1"], row   # dispatches, submits per forward
        assert fields[4] == "ok", row


ROOT = Path(__file__).resolve().parents[1]


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "lora", "wgsl", "project_b", "--rank", "2",
                        "--out-dim", "10"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("// kernel project_b\n")
    assert "var<storage, read> B: array<f32, 20>;" in r.stdout
    assert "y[workgroup_id.y * 10u + i] = " in r.stdout


@pytest.mark.slow  # examples/lora_forward.py: the demo's shapes, autotuned
def test_example_script_runs(capsys):
    from examples import lora_forward

    lora_forward.main()
    out = capsys.readouterr().out
    assert "OK" in out and "nan" not in out.lower()
