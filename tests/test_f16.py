"""float16 storage: A, B, x and output stored as f16, every sum in f32.

Inputs are drawn as float16 values, so the float64 reference sees exactly
what the GPU reads. The bound (``reference.f16_tolerance``) is the f32 bound
of tests/test_strategies.py plus rounding the result to the nearest float16:

    |gpu - numpy| <= tol32 + 2**-11 * (|numpy| + tol32) + 2**-25

where tol32 = 1e-4 * (|scale| * |B| @ (|A| @ |x|) + |base|). Every test here
needs the adapter's shader-f16 and says so when it skips (llvmpipe's OpenGL
driver lacks it; lavapipe has it).
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import problem
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_strategies import EDGE_DIMS, STRATEGY_TEXTS

import lora
import lora.hesper as E
from lora import Strategy, Weight, forward_plan
from lora import reference as R
from lora.core import tuning
from shaderdsl.errors import BindingError, FeatureError

F16 = np.float16
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
dims = st.one_of(st.sampled_from(EDGE_DIMS), st.integers(1, 600))


@pytest.fixture(scope="module", autouse=True)
def needs_f16(device):
    if not device.has_feature("shader-f16"):
        pytest.skip(f"adapter {device.name!r} ({device.backend}) lacks shader-f16")


# the former lora.forward paths as strategy texts ("auto": the autotuned one)
PATH_STRATEGY = {"three": "three:256", "fused": "split:256", "single": "single:256:1",
                 "auto": None}


def check(got, a, b, x, base, scale, what):
    assert got.dtype == F16, what
    if scale == 0:
        assert np.array_equal(got.view(np.uint16), base.view(np.uint16)), \
            f"{what}: scale 0 must leave the base exactly"
        return
    got = got.astype(np.float64)
    want = R.forward(x, a, b, scale, base)
    tol = R.f16_tolerance(x, a, b, scale, base)
    assert not np.isnan(got).any(), what
    bad = np.argwhere(np.abs(got - want) > tol)
    assert bad.size == 0, (f"{what}: {len(bad)} element(s) out of tolerance, first at "
                           f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want "
                           f"{want[tuple(bad[0])]}, tol {tol[tuple(bad[0])]}")


def run_plan(device, a, b, x, base, scale, tokens, strategy):
    w = Weight.from_numpy(device, a, b, dtype=F16)
    plan = forward_plan(device, w, scale, tokens, Strategy.parse(strategy))
    x_buf, out = device.buffer(x), device.buffer(base)
    before = device.stats["dispatches"]
    plan(x_buf, out)
    assert device.stats["dispatches"] - before == plan.dispatches
    got = device.read(out).reshape(base.shape)
    assert np.array_equal(device.read(x_buf).reshape(x.shape).view(np.uint16),
                          x.view(np.uint16)), "the input was modified"
    return got


@pytest.mark.examples(quick=3)
@settings(SETTINGS, max_examples=20)
@given(strategy=st.sampled_from(STRATEGY_TEXTS), tokens=st.integers(1, 40),
       rank=st.integers(1, 16), in_dim=dims, out_dim=dims,
       scale=st.sampled_from([0.0, 1.0, -1.0, 2.0, -3.5, 0.125]), positive=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_plan_f16_matches_numpy(device, sub_ok, strategy, tokens, rank, in_dim, out_dim, scale,
                                positive, seed):
    if strategy.endswith(":sg"):
        assume(sub_ok)
    a, b, x, base = problem(np.random.default_rng(seed), rank, in_dim, out_dim, tokens, positive,
                            dtype=F16)
    got = run_plan(device, a, b, x, base, scale, tokens, strategy)
    check(got, a, b, x, base, scale, strategy)


@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", STRATEGY_TEXTS)
def test_f16_every_output_written(device, sub_ok, strategy):
    """Ragged tiles and workgroups; all-positive inputs, so a skipped element
    would stay at its base."""
    if strategy.endswith(":sg") and not sub_ok:
        pytest.skip("adapter lacks 'subgroup'")
    a, b, x, base = problem(np.random.default_rng(37), 5, 131, 259, 37, positive=True, dtype=F16)
    got = run_plan(device, a, b, x, base, 0.5, 37, strategy)
    assert np.all(got.astype(np.float32) > base.astype(np.float32) + 0.1)
    check(got, a, b, x, base, 0.5, strategy)


@pytest.mark.examples(quick=4)
@settings(SETTINGS, max_examples=15)
@given(path=st.sampled_from(["three", "fused", "single"]), rank=st.integers(1, 16),
       in_dim=dims, out_dim=dims, tokens=st.integers(1, 5),
       scale=st.sampled_from([1.0, -0.5, 2.0]), seed=st.integers(0, 2**32 - 1))
def test_forward_f16_paths_match_numpy(device, path, rank, in_dim, out_dim, tokens, scale, seed):
    """The execute paths of the lora issue, on float16 storage, over random shapes."""
    a, b, x, base = problem(np.random.default_rng(seed), rank, in_dim, out_dim, tokens,
                            dtype=F16)
    got = lora.forward(x, a, b, base, scale=scale, device=device, strategy=PATH_STRATEGY[path],
                       dtype=F16)
    check(got, a, b, x, base, scale, path)


# slow: "auto" tunes (compiles every candidate) for each token count, ~10 s each
@pytest.mark.parametrize("path", ["three", "fused", "single",
                                  pytest.param("auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tokens", [1, 6])
def test_forward_f16_paths(device, path, tokens):
    """lora.forward(dtype=float16): every path stores and returns float16."""
    a, b, x, base = problem(np.random.default_rng(tokens), 8, 260, 130, tokens, dtype=F16)
    got = lora.forward(x, a, b, base, scale=1.5, device=device, strategy=PATH_STRATEGY[path],
                       dtype=F16)
    assert got.shape == base.shape
    check(got, a, b, x, base, 1.5, path)


@pytest.mark.slow  # tunes for float16 (~5 s)
def test_forward_f16_from_float32_input(device):
    """float32 (or float64) arrays are rounded to float16 first: the result is
    the forward of the rounded values."""
    rng = np.random.default_rng(5)
    a, b, x = rng.random((4, 64)), rng.random((48, 4)), rng.random((3, 64))
    got = lora.forward(x, a, b, scale=0.5, device=device, dtype="float16")
    a16, b16, x16 = (v.astype(F16) for v in (a, b, x))
    check(got, a16, b16, x16, np.zeros((3, 48), F16), 0.5, "cast")


def test_execute_functions_f16(device):
    """The per-kernel execute functions with a float16 weight: x and output
    float16, the scratch h and y float32."""
    rng = np.random.default_rng(9)
    a, b, x, base = problem(rng, 4, 100, 72, 3, dtype=F16)
    w = Weight.from_numpy(device, a, b, dtype=F16)
    assert w.dtype == F16 and "float16" in repr(w)
    x_buf, out = device.buffer(x), device.buffer(base)
    h, y = device.empty((3, 4), np.float32), device.empty((3, 72), np.float32)
    E.execute_project_a(device, w, x_buf, h)
    assert np.all(np.abs(device.read(h) - R.project_a(a, x)) <= R.h_tolerance(x, a))
    E.execute_project_b(device, w, h, y)
    E.execute_add_scaled(device, y, out, scale=-2.0)
    check(device.read(out).reshape(3, 72), a, b, x, base, -2.0, "three kernels")


def test_add_scaled_f16_output(device):
    rng = np.random.default_rng(3)
    y = rng.standard_normal(101).astype(np.float32)
    base = rng.standard_normal(101).astype(F16)
    out = device.buffer(base)
    E.execute_add_scaled(device, device.buffer(y), out, scale=0.75)
    want = base.astype(np.float64) + 0.75 * y
    got = device.read(out).astype(np.float64)
    tol32 = R.RTOL_ADD * (np.abs(base.astype(np.float64)) + 0.75 * np.abs(y))  # f32 sum
    bound = R.F16_ROUNDING * (np.abs(want) + tol32) + tol32 + 2.0 ** -25
    assert np.all(np.abs(got - want) <= bound)


def test_mixed_dtypes_refused_before_dispatch(device):
    """A float16 weight with float32 activations (and the reverse) is refused,
    naming both dtypes, before anything is recorded."""
    a, b, x, base = problem(np.random.default_rng(2), 4, 32, 40, 2, dtype=F16)
    w16 = Weight.from_numpy(device, a, b, dtype=F16)
    w32 = Weight.from_numpy(device, a, b)
    x16, out16 = device.buffer(x), device.buffer(base)
    x32, out32 = device.buffer(x.astype(np.float32)), device.buffer(base.astype(np.float32))
    before = device.stats["dispatches"]
    cases = [(w16, x32, out16), (w16, x16, out32), (w32, x16, out32), (w32, x32, out16)]
    for w, xb, ob in cases:
        with pytest.raises(BindingError, match="expected dtype float(16|32), got float(32|16)"):
            E.execute_lora_forward_single(device, w, 1.0, xb, ob)
        with pytest.raises(BindingError, match="the weight's dtype"):
            forward_plan(device, w, 1.0, 2, Strategy.parse("tiled:64:4"))(xb, ob)
    with pytest.raises(BindingError, match="h_buf: expected dtype float32, got float16"):
        E.execute_lora_forward_fused(device, w16, 1.0, x16, out16, device.empty((2, 4), F16))
    assert device.stats["dispatches"] == before
    assert np.array_equal(device.read(out16).view(np.uint16), base.view(np.uint16))


def test_f16_needs_the_feature(device, monkeypatch):
    """Without shader-f16 the float16 weight is refused before any upload."""
    # on the instance: a class-level patch is shadowed where an earlier test's
    # instance-level monkeypatch left the bound method in the instance's dict
    monkeypatch.setattr(device, "has_feature", lambda name: name != "shader-f16")
    monkeypatch.setattr(device, "_alloc", boom)
    with pytest.raises(FeatureError, match="float16 storage needs the 'shader-f16' feature"):
        Weight.from_numpy(device, np.ones((2, 8)), np.ones((8, 2)), dtype=F16)
    with pytest.raises(FeatureError, match="shader-f16"):
        lora.forward(np.ones(8), np.ones((2, 8)), np.ones((8, 2)), device=device, dtype=F16)


def boom(*args, **kwargs):
    raise AssertionError("a buffer was allocated")


@pytest.mark.parametrize("bad", ["int8", np.float64, "bfloat16", None])
def test_bad_storage_dtype(device, bad):
    with pytest.raises((ValueError, TypeError), match="dtype: expected float32 or float16"):
        Weight.from_numpy(device, np.ones((2, 8)), np.ones((8, 2)), dtype=bad)


def test_values_beyond_f16_range_refused(device):
    with pytest.raises(BindingError, match=r"a has 16 NaN or infinite value\(s\) as float16 "
                                           r"\(float16 holds at most 65504\)"):
        Weight.from_numpy(device, np.full((2, 8), 70000.0), np.ones((8, 2)), dtype=F16)
    with pytest.raises(BindingError, match="x: values beyond float16's range"):
        lora.forward(np.full(8, 1e5), np.ones((2, 8)), np.ones((8, 2)), device=device, dtype=F16)


@pytest.mark.parametrize("n, size", [(7, 7), (6, 9), (9, 9)])
def test_save_activation_f16(device, n, size):
    """float16 copies go in 4-byte words: an even count, or the whole destination."""
    src = np.arange(1, size + 1, dtype=F16)
    dst0 = np.full(size, -1.0, F16)
    dst = device.buffer(dst0)
    E.save_activation(device, device.buffer(src), dst, n)
    got = device.read(dst)
    assert np.array_equal(got[:n], src[:n]) and np.array_equal(got[n:], dst0[n:])


def test_save_activation_f16_odd_count_refused(device):
    src, dst = device.buffer(np.ones(9, F16)), device.buffer(np.zeros(9, F16))
    with pytest.raises(BindingError, match="copy an even count"):
        E.save_activation(device, src, dst, 5)
    assert not device.read(dst).any()


def test_tuning_cache_keeps_dtypes_apart(device):
    k32 = tuning.cache_key(device, 8, 64, 64, 1)
    k16 = tuning.cache_key(device, 8, 64, 64, 1, F16)
    assert k32 != k16 and k16.endswith("|float16") and "float" not in k32
