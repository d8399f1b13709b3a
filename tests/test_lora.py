"""The LoRA kernels and paths on the GPU, against the float64 numpy reference.

Each property test draws shapes (rank 1..64, in_dim and out_dim 1..5000 with
workgroup edges 255/256/257 and odd sizes favoured, 1 to 3 tokens), a scale
(0, -0, negatives included) and a seed for fresh N(0, 1) inputs.

Poison: scratch outputs (h, y) start as NaN, so an element a kernel forgets
fails; outputs updated in place start as random base values.

Tolerance (elementwise, see lora.reference and docs/lora.md "Accuracy"):
  h = A @ x                   |err| <= 1e-5 * (|A| @ |x|)
  y = B @ h                   |err| <= 1e-5 * (|B| @ |h|)
  output += scale * y         |err| <= 1e-6 * (|scale| |y| + |base|)
  output += scale * B @ h     |err| <= 1e-5 * (|scale| |B| @ |h| + |base|)
  whole forward               |err| <= 1e-4 * (|scale| |B| @ (|A| @ |x|) + |base|)
An f32 sum of n terms is off by at most about n * 2**-24 times the sum of
their absolute values in the worst case, and by about sqrt(n) * 2**-24 for
terms of random sign (the inputs here): 5000 terms give ~4e-6, under 1e-5.

On lavapipe the kernels that reduce in workgroup memory without subgroups
take seconds to compile at high rank (4-5 s at rank 64 with the tree's
halving as a runtime loop), so the property tests draw rank <= 16 for those
variants (with up to 1024 threads, where the device allows them, so ranks
past 4 reduce in several groups) and
1..64 for the others (seed strategy, subgroups); rank 64 on the default
strategy is tested once, with 32 threads.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import assert_close, kernel_lead, normal
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import lora.kernels as K
from lora import Config, Weight, forward
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
from shaderdsl.checks import MAX_INVOCATIONS, check_kernel
from shaderdsl.errors import DispatchError

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
seeds = st.integers(0, 2**32 - 1)
EDGES = [1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 255, 256, 257, 511, 1023, 2560, 4097, 4999, 5000]
dims = st.one_of(st.sampled_from(EDGES), st.integers(1, 5000))
tokens_st = st.sampled_from([None, 1, 2, 3])   # None: 1-D buffers
scales = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, -3.5, 0.125, 1e-3]),
                   st.floats(-16, 16, allow_nan=False, width=32))
NAN = np.float32("nan")


def over_limits(device, kernel):
    """Why the device refuses ``kernel`` (the runtime's DispatchError, naming
    the limit), or None: subgroup reductions at high rank and 1024 threads can
    need more workgroup memory than the device has."""
    try:
        check_kernel(kernel, device)
    except DispatchError as e:
        return e
    return None


def thread_counts(device):
    """64, 256 and 1024 threads, those the device allows in a workgroup (a
    WebGPU device may allow only 256: SwiftShader, and WebGPU's default limits)."""
    cap = device.limits.get(MAX_INVOCATIONS, 1024)
    return st.sampled_from([t for t in (64, 256, 1024) if t <= cap])


def project_a_kernel(rank, in_dim, tokens, threads=256, projection="workgroup",
                     subgroups=False):
    """The project_a kernel execute_project_a runs for these arguments."""
    if projection == "seed":
        return K.KERNELS["project_a_seed"].kernel(rank=rank, in_dim=in_dim, tokens=tokens)
    return K.KERNELS["project_a"].kernel(rank=rank, in_dim=in_dim, tokens=tokens,
                                         threads=threads, subgroups=subgroups)


def cheap_rank(variant):
    """Rank range for a project_a variant (see the module docstring)."""
    return st.integers(1, 16) if variant == "workgroup" else st.integers(1, 64)


def poisoned(device, shape):
    return device.buffer(np.full(shape, NAN, np.float32))


def variant_kw(variant, sub_ok, in_hypothesis=True) -> dict[str, Any]:
    """The execute functions' keyword arguments (projection, subgroups) for a variant."""
    if variant == "seed":
        return {"projection": "seed"}
    if variant == "subgroups":
        if not sub_ok:
            if in_hypothesis:
                assume(False)
            pytest.skip("adapter lacks 'subgroup'")
        return {"subgroups": True}
    return {}


# ---------------------------------------------------------------- each kernel

@pytest.mark.examples(quick=4)
@SETTINGS
@given(data=st.data(), variant=st.sampled_from(["workgroup", "seed", "subgroups"]),
       in_dim=dims, tokens=tokens_st, seed=seeds)
def test_project_a(device, sub_ok, data, variant, in_dim, tokens, seed):
    rank = data.draw(cheap_rank(variant), "rank")
    threads = data.draw(thread_counts(device), "threads")
    rng = np.random.default_rng(seed)
    a, b = normal(rng, (rank, in_dim)), normal(rng, (3, rank))
    x = normal(rng, kernel_lead(tokens) + (in_dim,))
    w = Weight.from_numpy(device, a, b)
    h = poisoned(device, kernel_lead(tokens) + (rank,))
    kw = variant_kw(variant, sub_ok)
    refused = over_limits(device, project_a_kernel(rank, in_dim, tokens or 1,
                                                   threads=threads, **kw))
    if refused:
        with pytest.raises(DispatchError, match="bytes of workgroup memory"):
            execute_project_a(device, w, device.buffer(x), h, threads=threads, **kw)
        return
    execute_project_a(device, w, device.buffer(x), h, threads=threads, **kw)
    assert_close(device.read(h), R.project_a(a, x), R.h_tolerance(x, a), "h")


@SETTINGS
@given(rank=st.integers(1, 64), out_dim=dims, tokens=tokens_st,
       threads=st.sampled_from([32, 256]), seed=seeds)
def test_project_b(device, rank, out_dim, tokens, threads, seed):
    rng = np.random.default_rng(seed)
    a, b = normal(rng, (rank, 2)), normal(rng, (out_dim, rank))
    h = normal(rng, kernel_lead(tokens) + (rank,))
    w = Weight.from_numpy(device, a, b)
    y = poisoned(device, kernel_lead(tokens) + (out_dim,))
    execute_project_b(device, w, device.buffer(h), y, threads=threads)
    tol = R.RTOL_Y * R.project_b(np.abs(b), np.abs(h)) + R.ATOL
    assert_close(device.read(y), R.project_b(b, h), tol, "y")


@SETTINGS
@given(n=st.one_of(st.sampled_from(EDGES + [65535, 70000]), st.integers(1, 20000)),
       scale=scales, extra=st.sampled_from([0, 0, 1, 300]), seed=seeds)
def test_add_scaled(device, n, scale, extra, seed):
    """output[:n] += scale * y[:n]; with longer buffers the tail is left alone."""
    rng = np.random.default_rng(seed)
    y, base = normal(rng, n + extra), normal(rng, n + extra)
    out = device.buffer(base)
    execute_add_scaled(device, device.buffer(y), out, n, scale)
    got = device.read(out)
    want = R.add_scaled(y[:n], base[:n], scale)
    tol = R.RTOL_ADD * (abs(scale) * np.abs(y[:n]) + np.abs(base[:n])) + R.ATOL
    assert_close(got[:n], want, tol, "output")
    assert np.array_equal(got[n:], base[n:])
    if scale == 0:
        assert np.array_equal(got, base)


@SETTINGS
@given(rank=st.integers(1, 64), out_dim=dims, tokens=tokens_st, scale=scales,
       threads=st.sampled_from([64, 256]), seed=seeds)
def test_fused_b_add(device, rank, out_dim, tokens, scale, threads, seed):
    rng = np.random.default_rng(seed)
    a, b = normal(rng, (rank, 2)), normal(rng, (out_dim, rank))
    h = normal(rng, kernel_lead(tokens) + (rank,))
    base = normal(rng, kernel_lead(tokens) + (out_dim,))
    w = Weight.from_numpy(device, a, b)
    out = device.buffer(base)
    execute_fused_b_add(device, w, scale, device.buffer(h), out, threads=threads)
    tol = R.RTOL_Y * (abs(scale) * R.project_b(np.abs(b), np.abs(h)) + np.abs(base)) + R.ATOL
    assert_close(device.read(out), R.fused_b_add(b, h, base, scale), tol, "output")


# ---------------------------------------------------------------- whole paths

def run_paths(device, a, b, x, base, scale, variant_kw=None, single_kw=None):
    """Run all three paths from the same inputs; returns {path: result}."""
    w = Weight.from_numpy(device, a, b)
    rank, out_shape = a.shape[0], base.shape
    x_buf = device.buffer(x)
    x_before = x.copy()
    results = {}
    for path in ("three", "fused", "single") if single_kw is not None else ("three", "fused"):
        out = device.buffer(base)
        if path == "three":
            h, y = poisoned(device, x.shape[:-1] + (rank,)), poisoned(device, out_shape)
            execute_lora_forward(device, w, scale, x_buf, out, h, y, **(variant_kw or {}))
        elif path == "fused":
            h = poisoned(device, x.shape[:-1] + (rank,))
            execute_lora_forward_fused(device, w, scale, x_buf, out, h, **(variant_kw or {}))
        else:
            execute_lora_forward_single(device, w, scale, x_buf, out, **(single_kw or {}))
        results[path] = device.read(out)
    assert np.array_equal(device.read(x_buf), x_before), "the input was modified"
    return results


def check_paths(results, a, b, x, base, scale):
    want = R.forward(x, a, b, scale, base)
    tol = R.tolerance(x, a, b, scale, base)
    for path, got in results.items():
        assert got.dtype == np.float32
        assert_close(got, want, tol, path)
    # the paths agree with each other within twice the bound (each is within it of numpy)
    for p, q in (("three", "fused"), ("fused", "single")):
        if q not in results:
            continue
        assert np.all(np.abs(results[p].astype(np.float64) - results[q]) <= 2 * tol), (p, q)


@pytest.mark.examples(quick=2)
@settings(SETTINGS, max_examples=20)
@given(data=st.data(), variant=st.sampled_from(["workgroup", "seed", "subgroups"]),
       in_dim=dims, out_dim=dims, tokens=tokens_st, scale=scales, seed=seeds)
def test_paths_match_numpy_and_agree(device, sub_ok, data, variant, in_dim, out_dim, tokens,
                                     scale, seed):
    rank = data.draw(cheap_rank(variant), "rank")
    kw = variant_kw(variant, sub_ok)
    # the single path reduces like "workgroup"; for high ranks use its subgroup variant
    # (without subgroups on the adapter, high ranks skip the single path here)
    opt = data.draw(st.sampled_from([1, 2, 3]), "outputs_per_thread")
    threads = data.draw(thread_counts(device), "threads")
    kw["threads"] = threads
    if variant == "workgroup" or (rank <= 16 and not sub_ok):
        single = {"outputs_per_thread": opt, "threads": threads}
    elif sub_ok:
        single = {"subgroups": True, "outputs_per_thread": opt, "threads": threads}
    else:
        single = None
    for k in (project_a_kernel(rank, in_dim, tokens or 1, **kw),
              single and K.KERNELS["fused_forward"].kernel(
                  rank=rank, in_dim=in_dim, out_dim=out_dim, scale=scale, tokens=tokens or 1,
                  **single)):
        assume(not k or over_limits(device, k) is None)
    rng = np.random.default_rng(seed)
    a, b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
    x = normal(rng, kernel_lead(tokens) + (in_dim,))
    base = normal(rng, kernel_lead(tokens) + (out_dim,))
    results = run_paths(device, a, b, x, base, scale, kw, single)
    check_paths(results, a, b, x, base, scale)
    if scale == 0:
        for got in results.values():
            assert np.array_equal(got, base)


@pytest.mark.parametrize("variant", ["workgroup", "seed", "subgroups"])
def test_seed_case_rank_8_dim_2560(device, sub_ok, variant):
    """Hesper's seed case: rank 8, in_dim = out_dim = 2560, one token, alpha 16."""
    cfg = Config(8, 16.0)
    assert cfg.scale == 2.0
    rng = np.random.default_rng(2560)
    a, b = normal(rng, (8, 2560)), normal(rng, (2560, 8))
    x, base = normal(rng, 2560), normal(rng, 2560)
    kw = variant_kw(variant, sub_ok, in_hypothesis=False)
    single = {"subgroups": True} if variant == "subgroups" else {}
    results = run_paths(device, a, b, x, base, cfg.scale, kw, single)
    check_paths(results, a, b, x, base, cfg.scale)
    # the delta is big next to the base here: make sure it is really there
    assert np.abs(results["fused"] - base).max() > 10


def test_rank_64_default_strategy(device, sub_ok):
    """The largest rank on the default strategy (reduction in workgroup memory, no
    subgroups), 5000 -> 4999, 2 tokens; the single path with subgroups when available.
    32 threads: at 256 this kernel takes ~30 s to compile on lavapipe (see top)."""
    rng = np.random.default_rng(64)
    a, b = normal(rng, (64, 5000)), normal(rng, (4999, 64))
    x, base = normal(rng, (2, 5000)), normal(rng, (2, 4999))
    single = {"subgroups": True, "outputs_per_thread": 2} if sub_ok else {}
    results = run_paths(device, a, b, x, base, -0.5, {"threads": 32},
                        dict(single, threads=32))
    check_paths(results, a, b, x, base, -0.5)


def test_multi_token_equals_token_by_token(device):
    rng = np.random.default_rng(7)
    a, b = normal(rng, (6, 300)), normal(rng, (257, 6))
    x, base = normal(rng, (3, 300)), normal(rng, (3, 257))
    # Bit-equal only with one kernel for both ("auto" may pick a tiled kernel for 3 tokens).
    together = forward(x, a, b, base, scale=1.5, device=device, strategy="split:256")
    apart = np.stack([forward(x[t], a, b, base[t], scale=1.5, device=device,
                              strategy="split:256") for t in range(3)])
    np.testing.assert_array_equal(together, apart)


# ---------------------------------------------------------------- lora.forward

@pytest.mark.examples(quick=5)
@settings(SETTINGS, max_examples=15)
@given(rank=st.integers(1, 12), in_dim=dims, out_dim=dims, tokens=tokens_st,
       path=st.sampled_from(["three", "fused", "single"]), with_base=st.booleans(),
       how=st.sampled_from(["alpha", "scale", "default"]), dtype=st.sampled_from(["f32", "f64"]),
       seed=seeds)
def test_numpy_forward(device, rank, in_dim, out_dim, tokens, path, with_base, how, dtype, seed):
    rng = np.random.default_rng(seed)
    cast = (lambda v: v) if dtype == "f32" else (lambda v: v.astype(np.float64))
    a, b = cast(normal(rng, (rank, in_dim))), cast(normal(rng, (out_dim, rank)))
    x = cast(normal(rng, kernel_lead(tokens) + (in_dim,)))
    base = cast(normal(rng, kernel_lead(tokens) + (out_dim,))) if with_base else None
    alpha = 3.0 if how == "alpha" else None
    given_scale = -0.25 if how == "scale" else None
    scale = {"alpha": 3.0 / rank, "scale": -0.25, "default": 1.0}[how]
    strategy = {"three": "three:256", "fused": "split:256", "single": "single:256:1"}[path]
    got = forward(x, a, b, base, alpha=alpha, scale=given_scale, device=device,
                  strategy=strategy)
    assert got.dtype == np.float32 and got.shape == kernel_lead(tokens) + (out_dim,)
    a32, b32, x32 = (v.astype(np.float32) for v in (a, b, x))
    base32 = None if base is None else base.astype(np.float32)
    assert_close(got, R.forward(x32, a32, b32, scale, base32),
                 R.tolerance(x32, a32, b32, scale, base32), path)


@pytest.mark.slow  # tunes (~7 s)
def test_numpy_forward_new_adapter_adds_nothing(device):
    """Weight.init's B is zero: the forward returns the base exactly."""
    w = Weight.init(device, 100, 70, 4, seed=3)
    a, b = w.numpy()
    base = np.arange(70, dtype=np.float32)
    x = np.ones(100, np.float32)
    np.testing.assert_array_equal(forward(x, a, b, base, alpha=8.0, device=device), base)


# ---------------------------------------------------------------- save_activation

@SETTINGS
@given(n=st.one_of(st.sampled_from(EDGES), st.integers(1, 20000)),
       extra=st.sampled_from([0, 1, 100]), shape2d=st.booleans(), seed=seeds)
def test_save_activation_copies_exactly(device, n, extra, shape2d, seed):
    rng = np.random.default_rng(seed)
    src = normal(rng, n)
    src[rng.random(n) < 0.05] = np.inf  # odd values travel bit for bit
    src[rng.random(n) < 0.05] = NAN
    src_buf = device.buffer(src.reshape(1, n) if shape2d else src)
    dst0 = np.full(n + extra, 7.0, np.float32)
    dst = device.buffer(dst0)
    save_activation(device, src_buf, dst, n)
    got = device.read(dst)
    assert np.array_equal(got[:n].view(np.uint32), src.view(np.uint32))
    assert np.array_equal(got[n:], dst0[n:])


def test_save_activation_in_a_forward_batch(device):
    """Recorded between dispatches: it copies the input as it is at that point."""
    rng = np.random.default_rng(11)
    a, b = normal(rng, (4, 64)), normal(rng, (32, 4))
    x = normal(rng, 64)
    w = Weight.from_numpy(device, a, b)
    x_buf, saved = device.buffer(x), device.empty(64, np.float32)
    out, h = device.buffer(np.zeros(32, np.float32)), device.empty(4, np.float32)
    with device.batch():
        save_activation(device, x_buf, saved)
        execute_lora_forward_fused(device, w, 2.0, x_buf, out, h)
    np.testing.assert_array_equal(device.read(saved), x)
    assert_close(device.read(out), R.forward(x, a, b, 2.0), R.tolerance(x, a, b, 2.0), "out")


# ---------------------------------------------------------------- dispatch counts and caching

def small_setup(device, tokens=1):
    rng = np.random.default_rng(5)
    a, b = normal(rng, (3, 40)), normal(rng, (24, 3))
    shape = kernel_lead(None if tokens == 1 else tokens)
    w = Weight.from_numpy(device, a, b)
    bufs = dict(x=device.buffer(normal(rng, shape + (40,))),
                out=device.buffer(normal(rng, shape + (24,))),
                h=device.empty(shape + (3,), np.float32), y=device.empty(shape + (24,), np.float32))
    return w, bufs


PATH_CALLS = {
    "three": lambda d, w, s, b: execute_lora_forward(d, w, s, b["x"], b["out"], b["h"], b["y"]),
    "fused": lambda d, w, s, b: execute_lora_forward_fused(d, w, s, b["x"], b["out"], b["h"]),
    "single": lambda d, w, s, b: execute_lora_forward_single(d, w, s, b["x"], b["out"]),
}


@pytest.mark.parametrize("path, dispatches", [("three", 3), ("fused", 2), ("single", 1)])
def test_dispatches_and_one_submit_per_forward(device, path, dispatches):
    w, bufs = small_setup(device)
    run = PATH_CALLS[path]
    run(device, w, 0.5, bufs)  # compile and check once
    device.sync()
    before = dict(device.stats)
    run(device, w, 0.5, bufs)
    after = dict(device.stats)
    assert after["dispatches"] - before["dispatches"] == dispatches
    assert after["submits"] - before["submits"] == 1
    for key in ("modules", "pipelines", "bind_groups"):
        assert after[key] == before[key], key
    # inside a batch: recorded, submitted once at the end
    with device.batch():
        for _ in range(5):
            run(device, w, 0.5, bufs)
        assert device.stats["submits"] == after["submits"]
    assert device.stats["submits"] == after["submits"] + 1
    assert device.stats["dispatches"] == after["dispatches"] + 5 * dispatches


def test_repeat_calls_generate_no_wgsl(device, monkeypatch):
    """After the first call for a combination, nothing builds or looks up a kernel."""
    w, bufs = small_setup(device, tokens=2)
    for run in PATH_CALLS.values():
        run(device, w, 1.25, bufs)

    def boom(*args, **kwargs):
        raise AssertionError("kernel built on the hot path")

    monkeypatch.setattr(K.KernelSpec, "kernel", boom)
    monkeypatch.setattr("shaderdsl.compile", boom)
    for run in PATH_CALLS.values():
        run(device, w, 1.25, bufs)
    device.sync()


def test_accumulates_in_place(device):
    """Two forwards add the delta twice: the output really is updated in place."""
    w, bufs = small_setup(device)
    a, b = w.numpy()
    x, base = device.read(bufs["x"]), device.read(bufs["out"])
    for run in PATH_CALLS.values():
        device.write(bufs["out"], base)
        run(device, w, 0.75, bufs)
        run(device, w, 0.75, bufs)
        want = base + 2 * R.lora_delta(x, a, b, 0.75)
        assert_close(device.read(bufs["out"]), want, 2 * R.tolerance(x, a, b, 0.75, base), "2x")
