"""Token counts read at run time: one compiled plan for every T up to a bound.

A Plan built with ``tokens=None, max_tokens=M`` runs kernels that read T
from the u32 uniform ``tokens``; each record computes its grids from T
(split over z past max-compute-workgroups-per-dimension) and passes
``np.uint32(T)``. The auto path and the fixed-strategy execute functions use
such plans (per bucket of token counts, ``lora.core.tuning.BUCKETS``), so a
serving loop whose batch size changes compiles nothing after warm-up.

Results are compared with the float64 reference within the whole-forward
bound of tests/test_strategies.py (``reference.tolerance``); outputs start as
random base values (all-positive inputs in some draws), so a row or column a
kernel skips, or one it adds twice (a split grid's extra workgroups), fails.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import check_result, normal, problem
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_strategies import ALIGNED_TEXTS, STRATEGY_TEXTS, boom

import lora.kernels as K
import shaderdsl.compiler
from lora import LayerShape, PlanAt, Strategy, Weight, forward_plan
from lora import reference as R
from lora.core import tuning
from lora.core.plan import split_grid
from lora.core.strategy import Gemm, Tiled
from lora.hesper import (
    execute_lora_forward,
    execute_lora_forward_auto,
    execute_lora_forward_fused,
    execute_lora_forward_single,
)
from shaderdsl.errors import BindingError, DispatchError


def aligned(strategy, rank: int, in_dim: int, out_dim: int) -> tuple[int, int, int]:
    """The dims, rounded up to multiples of 4 for the strategies that need them."""
    s = Strategy.parse(strategy)
    if s.name == "gemm" or getattr(s, "quad", False):
        return -(-rank // 4) * 4, -(-in_dim // 4) * 4, -(-out_dim // 4) * 4
    return rank, in_dim, out_dim


SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FORWARD_KERNELS = ("project_a_seed", "project_a", "project_b", "fused_b_add", "fused_forward",
                   "tiled_forward", "project_a_tiled", "tiled_b_add")
EDGE_DIMS = [1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300]
dims = st.one_of(st.sampled_from(EDGE_DIMS), st.integers(1, 300))
scales = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, -3.5, 0.125]),
                   st.floats(-16, 16, allow_nan=False, width=32))
STATS = ("modules", "pipelines")


def compiles(device) -> dict:
    device.sync()
    return {k: device.stats[k] for k in STATS}


# ---------------------------------------------------------------- the kernels

@pytest.mark.parametrize("name", FORWARD_KERNELS)
def test_runtime_kernels_read_tokens_from_a_uniform(name):
    """tokens=None: a u32 uniform named tokens, token-sized buffers runtime-sized,
    and the token axis combined with workgroup_id.z (no device needed)."""
    spec = K.KERNELS[name]
    given_ = dict(rank=8, in_dim=40, out_dim=24, scale=0.5, tokens=None, threads=64,
                  tile_tokens=4)
    kernel = spec.kernel(**{k: v for k, v in given_.items() if k in spec.parameter_names})
    uniforms = [b for b in kernel.bindings if b.access == "uniform"]
    assert [(b.name, str(b.elem)) for b in uniforms] == [("tokens", "u32")]
    sized = {b.name: b.length for b in kernel.bindings if b.access != "uniform"}
    assert all(sized[n] is None for n in ("x", "h", "y", "output") if n in sized)
    assert all(sized[n] is not None for n in ("A", "B") if n in sized)
    assert "workgroup_id.z" in kernel.wgsl and "num_workgroups" in kernel.wgsl
    baked = spec.kernel(**{k: (3 if k == "tokens" else v) for k, v in given_.items()
                           if k in spec.parameter_names})
    assert "uniform" not in baked.wgsl and "workgroup_id.z" not in baked.wgsl


def test_add_scaled_at_run_time_covers_tokens_times_columns():
    k = K.KERNELS["add_scaled"]
    kernel = k.kernel(num_elements=None, columns=7, scale=2.0)
    assert "let n = tokens * 7u;" in kernel.wgsl
    assert k.grid_rule(dict(k.params(num_elements=None, columns=7, scale=2.0), tokens=100)) == \
        (-(-700 // 256), 1, 1)


@pytest.mark.parametrize("grid, cap, want", [
    ((5, 3, 1), 5, (5, 3, 1)), ((6, 3, 1), 5, (3, 3, 2)), ((2, 11, 1), 5, (2, 4, 3)),
    ((70000, 1, 1), 65535, (35000, 1, 2)), ((1, 65536, 1), 65535, (1, 32768, 2)),
])
def test_split_grid(grid, cap, want):
    got = split_grid(K.KERNELS["copy"].kernel(n4=4), grid, cap)
    assert got == want
    axis = 0 if grid[0] > cap else 1
    assert max(got) <= cap and got[axis] * got[2] >= grid[axis]


def test_split_grid_refuses_what_z_cannot_hold():
    kernel = K.KERNELS["copy"].kernel(n4=4)
    for grid in ((26, 1, 1), (6, 6, 1), (6, 1, 2)):
        with pytest.raises(DispatchError, match="cannot be split over z"):
            split_grid(kernel, grid, 5)


# ---------------------------------------------------------------- every strategy, against numpy

@pytest.mark.examples(quick=5)
@settings(SETTINGS, max_examples=20)
@given(strategy=st.sampled_from(STRATEGY_TEXTS + ALIGNED_TEXTS),
       counts=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       extra=st.sampled_from([0, 0, 1, 60]), rank=st.integers(1, 16), in_dim=dims,
       out_dim=dims, scale=scales, positive=st.booleans(),
       max_workgroups=st.sampled_from([None, None, 9, 13]), seed=st.integers(0, 2**32 - 1))
def test_runtime_plan_matches_numpy(device, sub_ok, strategy, counts, extra, rank, in_dim,
                                    out_dim, scale, positive, max_workgroups, seed):
    """One run-time plan, several token counts in a row (each checked), grids
    split over z when max_workgroups is small."""
    s = Strategy.parse(strategy)
    assume(sub_ok or not s.subgroups)
    rank, in_dim, out_dim = aligned(strategy, rank, in_dim, out_dim)
    rng = np.random.default_rng(seed)
    a, b, _, _ = problem(rng, rank, in_dim, out_dim, 1, positive)
    w = Weight.from_numpy(device, a, b)
    try:
        plan = forward_plan(device, w, scale, None, s, max_tokens=max(counts) + extra,
                    max_workgroups=max_workgroups)
    except DispatchError as e:  # a tiny max_workgroups: z cannot hold the whole split
        assert max_workgroups and "cannot be split over z" in str(e)
        assume(False)
    assert plan.runtime and plan.tokens is None
    for tokens in counts:
        _, _, x, base = problem(rng, rank, in_dim, out_dim, tokens, positive, rows=True)
        x_buf, out = device.buffer(x), device.buffer(base)
        before = device.stats["dispatches"]
        plan(x_buf, out)
        assert device.stats["dispatches"] - before == plan.dispatches
        check_result(device.read(out), a, b, x, base, scale, f"{strategy} T={tokens}")
        assert np.array_equal(device.read(x_buf), x), "the input was modified"


@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", STRATEGY_TEXTS + ALIGNED_TEXTS)
def test_every_output_written_at_run_time(device, sub_ok, strategy):
    """All-positive inputs, ragged tiles and workgroups, grids split over z
    (max_workgroups 9): a skipped element stays at its base, a doubled one is off."""
    s = Strategy.parse(strategy)
    if s.subgroups and not sub_ok:
        pytest.skip("adapter lacks 'subgroup'")
    rng = np.random.default_rng(37)
    a, b, x, base = problem(rng, *aligned(strategy, 5, 131, 45), 37, positive=True, rows=True)
    w = Weight.from_numpy(device, a, b)
    plan = forward_plan(device, w, 0.5, None, s, max_tokens=40, max_workgroups=9)
    out = device.buffer(base)
    plan(device.buffer(x), out)
    got = device.read(out)
    assert np.all(got > base + 0.1)
    check_result(got, a, b, x, base, 0.5, strategy)
    split = [isinstance(step.grid, tuple) and step.grid[2] > 1 for step in plan._launches[37][0]]
    assert all(step.rule is not None for step in plan.steps), "a run-time plan has grid rules"
    assert split == [max(step.rule(37)) > 9 for step in plan.steps if step.rule is not None]
    tiles = isinstance(s, (Tiled, Gemm)) and s.tile_tokens > 4
    assert tiles or any(split), "nothing was split"


@pytest.mark.parametrize("strategy", ["seed", "three:32", "three:64:seed", "split:32",
                                      "split:64:sg", "single:32:1", "single:64:2:loop:sg",
                                      "tiled:32:1", "tiled:64:4", "tiled:64:8:4",
                                      "tiled:64:4:q", "gemm:32:1:2"])
def test_tokens_past_the_grid_limit(device, sub_ok, strategy):
    """70,000 tokens on a small shape: one workgroup per token would be over
    65,535 on one axis; the run-time plan splits it over z."""
    s = Strategy.parse(strategy)
    if s.subgroups and not sub_ok:
        pytest.skip("adapter lacks 'subgroup'")
    tokens = 70000
    rng = np.random.default_rng(70000)
    a, b, x, base = problem(rng, *aligned(strategy, 2, 3, 5), tokens, rows=True)
    plan = forward_plan(device, Weight.from_numpy(device, a, b), -1.5, None, s, max_tokens=tokens)
    out = device.buffer(base)
    plan(device.buffer(x), out)
    check_result(device.read(out), a, b, x, base, -1.5, strategy)
    cap = device.limits["max-compute-workgroups-per-dimension"]
    if cap < tokens and s.name != "tiled":
        assert any(isinstance(st_.grid, tuple) and st_.grid[2] > 1
                   for st_ in plan._launches[tokens][0])


def test_runtime_plan_float16(device):
    if not device.has_feature("shader-f16"):
        pytest.skip("adapter lacks shader-f16")
    rng = np.random.default_rng(16)
    a, b, _, _ = problem(rng, 4, 36, 20, 1)
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    w = Weight.from_numpy(device, a16, b16, dtype=np.float16)
    for text in ("split:64", "three:64", "single:64:1", "tiled:64:4", "tiled:64:4:q",
                 "gemm:64:4:2"):
        plan = forward_plan(device, w, 0.5, None, Strategy.parse(text), max_tokens=16)
        for tokens in (1, 5, 16):
            x = normal(rng, (tokens, 36)).astype(np.float16)
            base = normal(rng, (tokens, 20)).astype(np.float16)
            out = device.buffer(base)
            plan(device.buffer(x), out)
            got = device.read(out).astype(np.float64)
            want = R.forward(x, a16, b16, 0.5, base)
            tol = R.f16_tolerance(x, a16, b16, 0.5, base)
            assert np.all(np.abs(got - want) <= tol), (text, tokens)


# ---------------------------------------------------------------- the Plan's API

def test_plan_at_uses_the_first_rows(device):
    """A serving loop may keep buffers for the largest batch: at(T) (or
    tokens=T) uses their first T rows and leaves the rest alone."""
    rng = np.random.default_rng(3)
    a, b, x, base = problem(rng, 3, 20, 12, 10, rows=True)
    plan = forward_plan(device, Weight.from_numpy(device, a, b), 2.0, None,
                        Strategy.parse("split:64"), max_tokens=10)
    x_buf, out = device.buffer(x), device.buffer(base)
    at = plan.at(4)
    assert isinstance(at, PlanAt) and at.tokens == 4 and at.strategy == plan.strategy
    assert at.weight is plan.weight and at.dispatches == plan.dispatches
    at(x_buf, out)
    got = device.read(out)
    check_result(got[:4], a, b, x[:4], base[:4], 2.0, "first 4 rows")
    assert np.array_equal(got[4:], base[4:])
    plan(x_buf, out, tokens=7)
    want = base.astype(np.float64).copy()
    want[:7] = R.forward(x[:7], a, b, 2.0, base[:7])
    want[:4] = R.forward(x[:4], a, b, 2.0, want[:4])
    assert np.allclose(device.read(out), want, rtol=1e-5, atol=1e-5)


def test_runtime_plan_refuses_bad_buffers(device):
    rng = np.random.default_rng(4)
    a, b, x, base = problem(rng, 3, 20, 12, 6, rows=True)
    w = Weight.from_numpy(device, a, b)
    plan = forward_plan(device, w, 1.0, None, Strategy.parse("tiled:64:4"), max_tokens=5)
    assert "tokens=1..5" in repr(plan)
    out = device.buffer(base)
    before = device.stats["dispatches"]
    cases = [
        (device.buffer(x), out, None, r"token count 6 must be an int from 1 to 5"),
        (device.buffer(x[:3]), out, None,
         r"the buffers hold different token counts \{'input buffer': 3, 'output buffer': 6\}; "
         r"they must agree"),
        (device.buffer(x[:5]), device.buffer(base[:5]), 0, r"token count 0"),
        (device.buffer(x[:5]), device.buffer(base[:2]), 3, r"from 1 to 2"),
        (device.buffer(x[:, :7]), out, None, r"input buffer must be float32 \(T, 20\)"),
        (device.buffer(x[:2]), device.buffer(base[:2].astype(np.int32)), None,
         r"output buffer must be float32 \(T, 12\)"),
    ]
    for x_buf, out_buf, tokens, message in cases:
        with pytest.raises(BindingError, match=message):
            plan(x_buf, out_buf, tokens=tokens)
    assert device.stats["dispatches"] == before
    assert np.array_equal(device.read(out), base)
    with pytest.raises(ValueError, match="tokens must be an int from 1 to 5"):
        plan.at(6)
    with pytest.raises(ValueError, match="give tokens .* or tokens=None with max_tokens"):
        forward_plan(device, w, 1.0, None, Strategy.parse("split:64"))
    with pytest.raises(ValueError, match="give tokens .* or tokens=None with max_tokens"):
        forward_plan(device, w, 1.0, 3, Strategy.parse("split:64"), max_tokens=5)
    baked = forward_plan(device, w, 1.0, 3, Strategy.parse("split:64"))
    with pytest.raises(ValueError, match="at\\(\\) is for run-time plans"):
        baked.at(3)


def test_runtime_scratch_grows_with_the_token_count(device):
    """A run-time plan's own h grows (in powers of two) as larger counts come;
    save_h leaves h there for the backward."""
    rng = np.random.default_rng(5)
    a, b, _, _ = problem(rng, 3, 16, 8, 1)
    plan = forward_plan(device, Weight.from_numpy(device, a, b), 1.0, None,
                        Strategy.parse("single:64:1"), max_tokens=100, save_h=True)
    for tokens, rows in ((3, 4), (2, 4), (9, 16), (100, 100)):
        _, _, x, base = problem(rng, 3, 16, 8, tokens, rows=True)
        out = device.buffer(base)
        plan(device.buffer(x), out)
        assert plan.h is not None and plan.h.shape == (rows, 3)
        h = device.read(plan.h)[:tokens]
        assert np.allclose(h, R.project_a(a, x), rtol=1e-5, atol=1e-5)
        check_result(device.read(out), a, b, x, base, 1.0, f"T={tokens}")
    plan.release()
    with pytest.raises(BindingError, match="was released"):
        plan(device.buffer(x), device.buffer(base))


# ---------------------------------------------------------------- compiles nothing new

def test_varying_tokens_compile_nothing(device):
    """After one forward, every other count up to the bound reuses the same
    pipelines; a plan with T baked in compiles again for each new T."""
    rng = np.random.default_rng(6)
    a, b, _, _ = problem(rng, 4, 48, 40, 1)
    w = Weight.from_numpy(device, a, b)
    for text in ("seed", "three:64", "split:64", "single:64:1", "tiled:64:4"):
        plan = forward_plan(device, w, 0.5, None, Strategy.parse(text), max_tokens=300)
        plan.record(device.buffer(normal(rng, (2, 48))), device.buffer(normal(rng, (2, 40))))
        before = compiles(device)
        for tokens in (1, 3, 17, 64, 299, 300, 5):
            _, _, x, base = problem(rng, 4, 48, 40, tokens, rows=True)
            out = device.buffer(base)
            plan(device.buffer(x), out)
            check_result(device.read(out), a, b, x, base, 0.5, f"{text} T={tokens}")
        assert compiles(device) == before, text
    before = compiles(device)
    for tokens in (7, 8):  # the baked path, for contrast
        forward_plan(device, w, 0.5, tokens, Strategy.parse("split:64"))
    assert compiles(device)["pipelines"] == before["pipelines"] + 4


@pytest.mark.slow  # 1,000 forwards after tuning
def test_auto_serving_loop_of_1000_forwards_compiles_nothing(device, cache_dir, monkeypatch):
    """The issue's acceptance test: 1,000 forwards through the auto path with T
    drawn from the serving distribution of ``python -m lora bench
    --tokens-sweep`` (1..8192), after a warm-up of one forward per bucket:
    no module or pipeline is created, nothing is tuned again, and the results
    are right (checked on a sample)."""
    from lora.apps.bench_sweep import serving_tokens

    monkeypatch.setattr(tuning, "time_plan",  # the last candidate wins: no timing here
                        lambda dev, plan, *a, **k: 1.0 if plan.strategy == tuning.candidates(
                            dev, 4, 32, 24, plan.tokens)[-1] else 2.0)
    rng = np.random.default_rng(7)
    a, b, _, _ = problem(rng, 4, 32, 24, 1)
    w = Weight.from_numpy(device, a, b)
    counts = serving_tokens(np.random.default_rng(1000), 1000)
    assert counts.min() >= 1 and counts.max() <= 8192 and len(set(counts.tolist())) > 100
    warm = [1, 2, 17, 257, 4097]
    assert {tuning.bucket_of(int(t)) for t in counts} <= {tuning.bucket_of(t) for t in warm}
    for tokens in warm:
        execute_lora_forward_auto(device, w, 0.75, device.buffer(normal(rng, (tokens, 32))),
                                  device.buffer(normal(rng, (tokens, 24))))
    assert len({id(p) for p in w.plans.values()}) == len(warm)  # one plan per bucket
    monkeypatch.setattr(tuning, "autotune", boom)
    monkeypatch.setattr(tuning, "autotune_bucket", boom)
    monkeypatch.setattr(shaderdsl.compiler, "_build", boom)
    before = compiles(device)
    for n, tokens in enumerate(counts.tolist()):
        _, _, x, base = problem(rng, 4, 32, 24, tokens, rows=True)
        out = device.buffer(base)
        execute_lora_forward_auto(device, w, 0.75, device.buffer(x), out)
        if n % 50 == 0:
            check_result(device.read(out), a, b, x, base, 0.75, f"forward {n}, T={tokens}")
    assert compiles(device) == before
    assert len({id(p) for p in w.plans.values()}) == len(warm)  # one plan per bucket


def test_execute_functions_compile_nothing_for_a_new_count(device):
    rng = np.random.default_rng(8)
    a, b, _, _ = problem(rng, 3, 24, 20, 1)
    w = Weight.from_numpy(device, a, b)

    def run_all(tokens):
        _, _, x, base = problem(rng, 3, 24, 20, tokens, rows=True)
        h, y = device.empty((tokens, 3), np.float32), device.empty((tokens, 20), np.float32)
        outs = [device.buffer(base) for _ in range(3)]
        execute_lora_forward(device, w, 1.25, device.buffer(x), outs[0], h, y)
        execute_lora_forward_fused(device, w, 1.25, device.buffer(x), outs[1], h)
        execute_lora_forward_single(device, w, 1.25, device.buffer(x), outs[2])
        for out in outs:
            check_result(device.read(out), a, b, x, base, 1.25, f"T={tokens}")

    run_all(2)
    before = compiles(device)
    for tokens in (3, 40, 9):
        run_all(tokens)
    assert compiles(device) == before


# ---------------------------------------------------------------- buckets and the tuner

def test_buckets():
    assert tuning.BUCKETS[0] == (1, 1)
    for (lo, hi), (nxt, _) in zip(tuning.BUCKETS, tuning.BUCKETS[1:]):
        assert lo <= hi and nxt == hi + 1
    assert tuning.bucket_of(1) == (1, 1) and tuning.bucket_of(16) == (2, 16)
    assert tuning.bucket_of(17) == (17, 256) and tuning.bucket_of(8192) == (4097, 1 << 24)
    assert tuning.bucket_of(70000) == (4097, 1 << 24)  # past one axis of workgroups: split over z
    assert tuning.bucket_of(tuning.RUNTIME_TOKENS + 1) is None
    for bucket in tuning.BUCKETS:
        assert bucket[0] <= tuning.timed_tokens(bucket) <= min(bucket[1], tuning.TIMED_TOKENS)


def test_runtime_bucket_follows_the_binding_limit(device, monkeypatch):
    w = Weight.from_numpy(device, np.ones((2, 1000), np.float32), np.ones((10, 2), np.float32))
    assert tuning.runtime_bucket(device, w, 1) is None
    assert tuning.runtime_bucket(device, w, 5) == (2, 16)
    assert tuning.runtime_bucket(device, w, tuning.RUNTIME_TOKENS + 1) is None
    limits = dict(device.limits)
    limits["max-storage-buffer-binding-size"] = 4000 * 300  # 300 rows of 1000 float32
    monkeypatch.setattr(device, "limits", limits)
    assert tuning.fitting_tokens(device, w) == 300
    assert tuning.runtime_bucket(device, w, 200) == (17, 256)
    assert tuning.runtime_bucket(device, w, 280) == (257, 300)
    assert tuning.runtime_bucket(device, w, 301) is None  # a baked plan says why


def test_auto_keys_plans_by_bucket(device, cache_dir, monkeypatch):
    """The auto path: one plan per bucket on the weight, one tuning entry per
    bucket on disk; one token and counts past the last bucket stay baked."""
    monkeypatch.setattr(tuning, "time_plan",
                        lambda dev, plan, *a, **k: 1.0 if plan.strategy.name == "tiled" else 2.0)
    rng = np.random.default_rng(9)
    a, b, _, _ = problem(rng, 2, 12, 10, 1)
    w = Weight.from_numpy(device, a, b)
    for tokens in (1, 3, 16, 17, 40):
        _, _, x, base = problem(rng, 2, 12, 10, tokens, rows=True)
        out = device.buffer(base)
        execute_lora_forward_auto(device, w, 1.5, device.buffer(x), out, strategy="auto")
        check_result(device.read(out), a, b, x, base, 1.5, f"T={tokens}")
    plans = {key[2]: plan for key, plan in w.plans.items() if key[0] == "auto"}
    assert set(plans) == {1, (2, 16), (17, 256)}
    assert {id(p) for p in w.plans.values()} == {id(p) for p in plans.values()}
    assert plans[1].tokens == 1 and plans[(2, 16)].max_tokens == 16
    assert plans[(2, 16)].runtime and plans[(2, 16)].strategy.name == "tiled"
    import json
    table = json.loads((cache_dir / "lora_tuning.json").read_text())
    assert set(table) == {tuning.cache_key(device, 2, 12, 10, 1),
                          tuning.bucket_key(device, 2, 12, 10, (2, 16)),
                          tuning.bucket_key(device, 2, 12, 10, (17, 256))}
    assert "|t2-16" in tuning.bucket_key(device, 2, 12, 10, (2, 16))


def test_autotune_bucket_never_returns_what_cannot_run(device, cache_dir, monkeypatch):
    """The candidate with the most workgroup memory is made the fastest, then
    the device's limit is lowered under it: the tuner leaves it out, and what
    it returns runs at the bucket's bounds."""
    rank, in_dim, out_dim, bucket = 8, 68, 44, (17, 256)
    tokens = tuning.timed_tokens(bucket)
    cands = tuning.candidates(device, rank, in_dim, out_dim, tokens)

    def memory(s):
        return max(K.KERNELS[name].kernel(**params).workgroup_bytes
                   for name, params, *_ in s.kernels(LayerShape(rank, in_dim, out_dim)))

    biggest = max(cands, key=memory)
    assert any(memory(s) < memory(biggest) for s in cands)
    monkeypatch.setattr(tuning, "time_plan",
                        lambda dev, plan, *a, **k: 1.0 if plan.strategy == biggest else 2.0)
    limits = dict(device.limits)
    limits["max-compute-workgroup-storage-size"] = memory(biggest) - 4
    monkeypatch.setattr(device, "limits", limits)
    rng = np.random.default_rng(10)
    a, b, _, _ = problem(rng, rank, in_dim, out_dim, 1)
    w = Weight.from_numpy(device, a, b)
    chosen = tuning.autotune_bucket(device, w, 1.0, bucket)
    assert chosen != biggest and memory(chosen) < memory(biggest)
    plan = forward_plan(device, w, 1.0, None, chosen, max_tokens=bucket[1])
    for t in (bucket[0], bucket[1]):
        _, _, x, base = problem(rng, rank, in_dim, out_dim, t, rows=True)
        out = device.buffer(base)
        plan(device.buffer(x), out)
        check_result(device.read(out), a, b, x, base, 1.0, f"{chosen} T={t}")
