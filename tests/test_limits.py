"""The limits the docs promise (issue 30): a high rank compiles, an x over
the storage-binding limit is refused by name, and the pipeline cache can be
emptied without breaking a plan still held."""
from __future__ import annotations

import numpy as np
import pytest

import lora
import shaderdsl as sd
from lora import Strategy, Weight, forward_plan
from lora.kernels.common import SUM_RUN, sum_terms
from lora.kernels.registry import KERNELS
from shaderdsl import f32
from shaderdsl.errors import BindingError, KernelBuildError

STORAGE_CAP = "max-storage-buffer-binding-size"


def _depth(e) -> int:
    """How deep a chain of binary operations goes (left operands)."""
    depth = 0
    while hasattr(e, "op") and hasattr(e, "a"):
        e, depth = e.a, depth + 1
    return depth


def test_a_long_sum_stays_shallow():
    """sum_terms keeps the order of a loop for up to SUM_RUN terms and adds
    longer sums in runs, so no expression is deeper than about SUM_RUN."""
    seen = {}

    def k(m):
        x = m.declare_input_buffer("x", f32, 4096)
        out = m.declare_output_buffer("out", f32, 1)
        total = sum_terms([x[i] for i in range(4096)])
        seen["depth"] = _depth(total)
        out[0] = total

    kernel = sd.compile(k, 1)
    assert seen["depth"] <= SUM_RUN + 4096 // SUM_RUN
    assert "x[4095u]" in kernel.wgsl or "x[4095]" in kernel.wgsl


def test_a_deep_chain_is_a_build_error_not_a_recursion_error():
    """A user's own left-deep chain of thousands of terms is refused by name."""
    def k(m):
        x = m.declare_input_buffer("x", f32, 4000)
        out = m.declare_output_buffer("out", f32, 1)
        total = x[0]
        for i in range(1, 4000):
            total = total + x[i]
        out[0] = total

    with pytest.raises(KernelBuildError, match=r"kernel 'k': an expression is nested too "
                                               r"deeply to compile .* add into an m.var with"):
        sd.compile(k, 1)


@pytest.mark.parametrize("name, params", [
    ("fused_b_add", dict(out_dim=8, rank=2048, scale=1.0, tokens=None)),
    ("fused_b_add", dict(out_dim=8, rank=4096, scale=1.0, tokens=2)),
])
def test_forward_kernels_at_rank_2048_compile(name, params):
    """fused_b_add at rank 2048 raised RecursionError in emit (a 512-term chain)."""
    kernel = KERNELS[name].kernel(**params)
    assert "@compute" in kernel.wgsl


def _reference(x, a, b, scale=1.0):
    x, a, b = (v.astype(np.float64) for v in (x, a, b))
    return scale * (x @ a.T) @ b.T


@pytest.mark.slow
@pytest.mark.parametrize("rank", [512])
def test_forward_at_a_high_rank(device, rank):
    """lora.forward at rank 512 (small in_dim, out_dim, tokens: 128-term chains of
    rank groups) equals numpy (7 s on lavapipe with a cold shader cache; the
    unrolled kernels' compile grows faster than the rank: 33 s at rank 1024, 140 s
    at 2048, whose WGSL test_forward_kernels_at_rank_2048_compile builds)."""
    rng = np.random.default_rng()
    a = rng.standard_normal((rank, 8)).astype(np.float32)
    b = rng.standard_normal((8, rank)).astype(np.float32)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    out = lora.forward(x, a, b, device=device)
    np.testing.assert_allclose(out, _reference(x, a, b), rtol=1e-5, atol=1e-3)


def test_x_over_the_storage_binding_limit(device, monkeypatch):
    """An x over max-storage-buffer-binding-size is a BindingError naming the
    buffer, its size, the limit and how many tokens fit (was: DispatchError
    "no strategy runs ...")."""
    monkeypatch.setitem(device.limits, STORAGE_CAP, 4096)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 16)).astype(np.float32)
    b = rng.standard_normal((8, 4)).astype(np.float32)
    x = rng.standard_normal((100, 16)).astype(np.float32)
    with pytest.raises(BindingError, match=rf"lora forward of 100 token\(s\) \(at most 64 fit; "
                                           rf"split the batch\): x \[100, 16\] float32: buffer of "
                                           rf"6400 bytes is over {STORAGE_CAP} = 4096"):
        lora.forward(x, a, b, device=device)
    out = lora.forward(x[:64], a, b, device=device)  # what fits still runs
    np.testing.assert_allclose(out, _reference(x[:64], a, b), rtol=1e-4, atol=1e-4)


def test_clear_plan_cache_releases_pipelines(device):
    """Each in_dim compiles pipelines; lora.clear_plan_cache() drops every one,
    and a plan its caller holds (not one of the plan cache's, which it
    releases) compiles again and gives the same result."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 24)).astype(np.float32)
    b = rng.standard_normal((8, 4)).astype(np.float32)
    x = rng.standard_normal((3, 24)).astype(np.float32)
    weight = Weight.from_numpy(device, a, b)
    plan = forward_plan(device, weight, 1.0, 3, Strategy.parse("split"))
    x_buf, out_buf = device.buffer(x), device.zeros((3, 8), np.float32)
    try:
        plan(x_buf, out_buf)
        before = device.read(out_buf).copy()
        for in_dim in (12, 20, 28):
            lora.forward(rng.standard_normal((3, in_dim)).astype(np.float32),
                         rng.standard_normal((4, in_dim)).astype(np.float32), b, device=device)
        assert len(device._cache.pipelines) > 0
        lora.clear_plan_cache()
        assert len(device._cache.pipelines) == 0 and len(device._cache.modules) == 0
        assert not device._kernels
        compiled = device.stats["pipelines"]
        device.write(out_buf, np.zeros((3, 8), np.float32))
        plan(x_buf, out_buf)
        assert device.stats["pipelines"] > compiled  # compiled again
        np.testing.assert_array_equal(device.read(out_buf), before)
    finally:
        plan.release()
        for buf in (x_buf, out_buf, weight.a, weight.b):
            device.release(buf)


def test_device_clear_pipeline_cache_counts(device):
    """Device.clear_pipeline_cache() returns how many pipelines it dropped."""
    rng = np.random.default_rng(2)
    lora.forward(rng.standard_normal((2, 36)).astype(np.float32),
                 rng.standard_normal((4, 36)).astype(np.float32),
                 rng.standard_normal((8, 4)).astype(np.float32), device=device)
    cached = len(device._cache.pipelines)
    assert cached > 0
    assert device.clear_pipeline_cache() == cached
    assert device.clear_pipeline_cache() == 0
