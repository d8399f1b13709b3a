"""Every example's host code, unchanged, on the interpreter device: the same
results as numpy, with race and uninitialised-read detection on (a missing
barrier in an example would raise here). Small sizes: the interpreter runs
Python per invocation."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import h200_interp

from examples import (
    bitonic,
    half,
    histogram,
    int8_matmul,
    matmul,
    reduction,
    rows,
    saxpy,
    scan,
    stencil,
    subgroup_matmul,
)


def values(seed, shape, dtype: type = np.float32):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, shape).astype(dtype)


def test_saxpy(interp_device):
    x, y = values(1, 70), values(2, 70)
    got = saxpy.run(interp_device, 1.5, x, y)
    np.testing.assert_allclose(got, 1.5 * x.astype(np.float64) + y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("subgroups", [False, True])
def test_reduction(interp_device, subgroups):
    x = values(3, 300)
    got = reduction.run(interp_device, x, subgroups=subgroups, workgroup_size=64)
    assert abs(got - x.astype(np.float64).sum()) <= 1e-5 * np.abs(x).sum()


def test_matmul(interp_device):
    a, b = values(4, (9, 7)), values(5, (7, 11))
    np.testing.assert_allclose(matmul.run(interp_device, a, b, tile=4), a.astype(np.float64) @ b,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("private", [False, True])
def test_histogram(interp_device, private):
    v = np.random.default_rng(6).integers(0, 1000, 500).astype(np.uint32)
    got = histogram.run(interp_device, v, 13, private=private)
    assert np.array_equal(got, np.bincount(v % 13, minlength=13))


def test_half(interp_device):
    w, x = values(7, (5, 8), np.float16), values(8, 8, np.float16)
    want = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(half.run(interp_device, w, x), want, rtol=1e-2, atol=1e-2)


def test_rows(interp_device):
    x = values(9, (3, 70)) * 4
    np.testing.assert_allclose(rows.run(interp_device, rows.softmax, x), rows.softmax_reference(x),
                               rtol=1e-5, atol=0)
    gamma, beta = values(10, 70), values(11, 70)
    got = rows.run(interp_device, rows.layer_norm, x, gamma=gamma, beta=beta)
    np.testing.assert_allclose(got, rows.layer_norm_reference(x, gamma, beta), rtol=1e-4,
                               atol=1e-4)


def test_stencil(interp_device):
    img, weights = values(15, (11, 13)), values(16, (3, 3))
    np.testing.assert_allclose(stencil.run(interp_device, img, weights, tile=4),
                               stencil.reference(img, weights), rtol=1e-5, atol=1e-5)


def test_stencil_without_its_barrier_is_a_race_naming_both_lines(interp_device):
    """The example's docstring promises it: the tile's load and a tap's read."""
    import inspect

    import shaderdsl as sd
    from shaderdsl.interp import RaceError

    def no_barrier(m, **params):
        m.barrier = lambda: None  # the mistake: the same kernel, its barrier forgotten
        stencil.conv2d(m, **params)

    lines, first = inspect.getsourcelines(stencil.conv2d)
    load = first + next(i for i, t in enumerate(lines) if "tile[r, c] = pixel" in t)
    tap = first + next(i for i, t in enumerate(lines) if "acc += w[dy, dx]" in t)
    k = sd.compile(no_barrier, (4, 4), height=8, width=8, radius=1)
    bufs = {"img": interp_device.buffer(values(17, (8, 8))),
            "w": interp_device.buffer(values(18, (3, 3))),
            "out": interp_device.zeros((8, 8), np.float32)}
    with pytest.raises(RaceError, match=rf"data race on workgroup array element tile\[.*"
                                        rf"stencil.py:({load}|{tap}).*stencil.py:({load}|{tap})"):
        interp_device.dispatch(k, bufs, (2, 2))


@pytest.mark.parametrize("subgroups", [False, True])
def test_scan(interp_device, subgroups):
    x = np.random.default_rng(12).integers(-100, 100, 600).astype(np.int32)
    assert np.array_equal(scan.run(interp_device, x, subgroups=subgroups), np.cumsum(x))


def test_bitonic(interp_device):
    x = values(13, 300)
    assert np.array_equal(bitonic.run(interp_device, x), np.sort(x))


def test_int8_matmul(interp_device):
    rng = np.random.default_rng(14)
    a = rng.integers(-128, 128, (5, 12)).astype(np.int8)
    b = rng.integers(-128, 128, (12, 6)).astype(np.int8)
    assert np.array_equal(int8_matmul.run(interp_device, a, b), a.astype(np.int64) @ b)


def test_subgroup_matmul():
    """Subgroup matrices: no adapter here has the feature; the interpreter
    device emulates them exactly (subgroups of 32, as the kernel assumes)."""
    rng = np.random.default_rng(15)
    a = rng.integers(-128, 128, (32, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    got = subgroup_matmul.run(h200_interp(), a, b)
    assert np.array_equal(got, a.astype(np.int64) @ b)
