"""The examples, run on the GPU and compared with numpy in float64.

Each property test draws sizes (ragged ones included: 1, a workgroup plus or
minus one, large odd counts) and a seed for fresh random inputs, never zeros.
Outputs the kernels write into fresh buffers are NaN-poisoned by the
examples' ``run`` helpers, so an element a kernel forgets shows up as NaN and
fails the comparison. Tolerances are stated per test, in units of
U = 2**-24 (the f32 unit roundoff), scaled by the sum of absolute terms.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shaderdsl as sd
from examples import bitonic, half, histogram, int8_matmul, matmul, reduction, saxpy, scan, stencil
from examples import rows as rows_mod

U = 2.0 ** -24
SETTINGS = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def nonzero(rng, shape, dtype: type = np.float32):
    """Random values in +-[0.1, 1): fresh, varied in sign and size, never zero."""
    mag = rng.uniform(0.1, 1.0, shape)
    return (np.where(rng.random(shape) < 0.5, -mag, mag)).astype(dtype)


def f64(a):
    return np.asarray(a, np.float64)


def ragged(workgroup, hi):
    """Counts around workgroup boundaries, plus anything in 1..hi."""
    edges = sorted({1, 2, workgroup - 1, workgroup, workgroup + 1, 3 * workgroup + 5} - {0})
    return st.one_of(st.sampled_from(edges), st.integers(1, hi))


# ---------------------------------------------------------------- saxpy

@SETTINGS
@given(n=ragged(saxpy.WORKGROUP_SIZE, 5000), seed=seeds,
       a_from=st.sampled_from(["override", "uniform"]), bake_n=st.booleans())
def test_saxpy_matches_numpy(device, n, seed, a_from, bake_n):
    rng = np.random.default_rng(seed)
    x, y = nonzero(rng, n), nonzero(rng, n)
    a = float(np.float32(nonzero(rng, ())) * 4)  # a float32 value
    got = saxpy.run(device, a, x, y, a_from=a_from, bake_n=bake_n)
    want = f64(a) * f64(x) + f64(y)
    # a*x rounds once and the add once (or an fma once): within 2U of the terms
    tol = 2 * U * (np.abs(f64(a) * f64(x)) + np.abs(f64(y)))
    assert got.dtype == np.float32 and got.shape == (n,)
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


@pytest.mark.parametrize("n", [1, 63, 65, 100])
def test_saxpy_guard_leaves_elements_past_n_alone(device, n):
    """With n baked in, y may be longer than n: invocations past n must not write."""
    kernel = sd.compile(saxpy.saxpy, saxpy.WORKGROUP_SIZE, n=n)
    rng = np.random.default_rng(n)
    x = nonzero(rng, n + 64)
    y0 = nonzero(rng, n + 64)
    y0[n:] = np.nan
    y = device.buffer(y0)
    device.dispatch(kernel, {"x": device.buffer(x), "y": y}, -(-(n + 64) // 64),
                    overrides={"a": 3.0})
    got = device.read(y)
    ax, y = 3.0 * f64(x[:n]), f64(y0[:n])
    assert np.all(np.abs(got[:n] - (ax + y)) <= 2 * U * (np.abs(ax) + np.abs(y)))
    assert np.isnan(got[n:]).all()


# ---------------------------------------------------------------- reduction

def tree_depth(n, workgroup):
    """Additions on the longest path of the passes' trees: a bound on the error's growth."""
    depth, count = 0, n
    while count > 1:
        depth += workgroup.bit_length() - 1
        count = -(-count // workgroup)
    return max(depth, 1)


@SETTINGS
@given(n=ragged(64, 70_000), seed=seeds, workgroup=st.sampled_from([64, 256]))
def test_reduction_matches_numpy(device, n, seed, workgroup):
    rng = np.random.default_rng(seed)
    x = nonzero(rng, n)
    got = reduction.run(device, x, subgroups=False, workgroup_size=workgroup)
    want = f64(x).sum()
    # a summation tree of depth d is within about d*U*sum|x| of the exact sum
    tol = 2 * tree_depth(n, workgroup) * U * np.abs(f64(x)).sum()
    assert abs(got - want) <= tol, (got, want, tol)


@SETTINGS
@given(n=ragged(64, 5000), seed=seeds)
def test_reduction_partials_are_per_workgroup_sums(device, n, seed):
    """One pass: partial w is the sum of x[64w : 64w+64], every partial written."""
    rng = np.random.default_rng(seed)
    x = nonzero(rng, n)
    kernel = sd.compile(reduction.reduce_sum, 64)
    groups = -(-n // 64)
    partials = device.buffer(np.full(groups, np.nan, np.float32))
    device.dispatch(kernel, {"x": device.buffer(x), "partials": partials}, groups)
    got = device.read(partials)
    padded = np.zeros(groups * 64)
    padded[:n] = f64(x)
    want = padded.reshape(groups, 64).sum(axis=1)
    scale = np.abs(padded).reshape(groups, 64).sum(axis=1)
    assert np.all(np.abs(got - want) <= 2 * 6 * U * scale)


def test_reduction_rejects_non_power_of_two_workgroup():
    with pytest.raises(sd.KernelBuildError, match=r"power-of-two workgroup size, got \(48, 1, 1\)"):
        sd.compile(reduction.reduce_sum, 48)
    with pytest.raises(sd.KernelBuildError, match="1-D"):
        sd.compile(reduction.reduce_sum, (8, 8))


# ---------------------------------------------------------------- matmul

@pytest.mark.examples(quick=8)
@SETTINGS
@given(M=ragged(8, 40), K=ragged(8, 40), N=ragged(8, 40), seed=seeds,
       tile=st.sampled_from([4, 8, 16]))
def test_matmul_matches_numpy(device, M, K, N, seed, tile):
    rng = np.random.default_rng(seed)
    a, b = nonzero(rng, (M, K)), nonzero(rng, (K, N))
    got = matmul.run(device, a, b, tile=tile)
    want = f64(a) @ f64(b)
    # K products summed in f32: within (K+1)U of |A| @ |B|, elementwise
    tol = 2 * (K + 1) * U * (np.abs(f64(a)) @ np.abs(f64(b)))
    assert got.shape == (M, N)
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


def test_matmul_needs_a_square_workgroup():
    with pytest.raises(sd.KernelBuildError, match=r"square 2-D workgroup .* got \(64, 1, 1\)"):
        sd.compile(matmul.matmul, 64, M=4, K=4, N=4)


# ---------------------------------------------------------------- histogram

@SETTINGS
@given(n=ragged(histogram.WORKGROUP_SIZE, 20_000), nbins=ragged(histogram.WORKGROUP_SIZE, 1000),
       seed=seeds, private=st.booleans(), spread=st.sampled_from([3, 1000, 2**32]),
       workgroup=st.sampled_from([32, 128]))
def test_histogram_is_exact(device, n, nbins, seed, private, spread, workgroup):
    rng = np.random.default_rng(seed)
    # spread 3 piles everything on a few bins: atomics under contention
    low = int(rng.integers(1, 2**32 - spread + 1)) if spread < 2**32 else 0
    values = rng.integers(low, low + spread, n, dtype=np.uint64).astype(np.uint32)
    got = histogram.run(device, values, nbins, private=private, workgroup_size=workgroup)
    want = np.bincount(values % nbins, minlength=nbins)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, want)


def test_private_histogram_twice_in_a_row(device):
    """Workgroup memory left over from an earlier dispatch must not leak into counts."""
    values = np.arange(1, 5001, dtype=np.uint32)
    want = np.bincount(values % 37, minlength=37)
    for _ in range(3):
        np.testing.assert_array_equal(histogram.run(device, values, 37, private=True), want)


# ---------------------------------------------------------------- half

@pytest.fixture(scope="module")
def f16_device(device):
    if not device.has_feature("shader-f16"):
        pytest.skip("adapter lacks shader-f16")
    return device


@SETTINGS
@given(rows=ragged(half.WORKGROUP_SIZE, 200),
       cols=st.one_of(st.sampled_from([1, 3, 4, 8, 255, 256]), st.integers(1, 300)), seed=seeds)
def test_half_gemv_matches_numpy(f16_device, rows, cols, seed):
    rng = np.random.default_rng(seed)
    w = nonzero(rng, (rows, cols), np.float16)
    x = nonzero(rng, cols)
    got = half.run(f16_device, w, x)
    want = f64(w) @ f64(x)          # w is already f16: its values convert exactly
    tol = 2 * (cols + 1) * U * (np.abs(f64(w)) @ np.abs(f64(x)))
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


# ---------------------------------------------------------------- WGSL of every example

KERNELS = [
    ("saxpy override, n literal", saxpy.saxpy, 64, dict(n=100)),
    ("saxpy uniform, arrayLength", saxpy.saxpy, 64, dict(a_from="uniform")),
    ("reduce_sum 256", reduction.reduce_sum, 256, {}),
    ("reduce_sum 1", reduction.reduce_sum, 1, {}),
    ("reduce_sum_subgroup 256", reduction.reduce_sum_subgroup, 256, {}),
    ("reduce_sum_subgroup 4", reduction.reduce_sum_subgroup, 4, {}),
    ("matmul 8x8", matmul.matmul, (8, 8), dict(M=100, K=50, N=70)),
    ("matmul 16x16 tiny", matmul.matmul, (16, 16), dict(M=1, K=1, N=1)),
    ("histogram global", histogram.histogram, 128, dict(nbins=100)),
    ("histogram private", histogram.histogram, 128, dict(nbins=4096, private=True)),
    ("gemv_f16 vec4h", half.gemv_f16, 64, dict(rows=300, cols=256)),
    ("gemv_f16 scalar", half.gemv_f16, 64, dict(rows=300, cols=250)),
    ("int8_matmul", int8_matmul.int8_matmul, (8, 8), dict(M=37, K=301, N=45)),
    ("uint8_matmul", int8_matmul.int8_matmul, (8, 8), dict(M=1, K=1, N=1, signed=False)),
]


@pytest.mark.parametrize("fn, workgroup, params", [k[1:] for k in KERNELS],
                         ids=[k[0] for k in KERNELS])
def test_example_kernels_compile_under_naga(naga, fn, workgroup, params):
    kernel = sd.compile(fn, workgroup, **params)
    assert kernel.wgsl.startswith(f"// kernel {fn.__name__}\n")
    naga(kernel)


def test_example_features_are_declared():
    assert sd.compile(half.gemv_f16, 64, rows=4, cols=4).features == {"shader-f16"}
    assert sd.compile(reduction.reduce_sum_subgroup, 64).features == {"subgroup"}
    for fn, ws, params in [(saxpy.saxpy, 64, {}), (reduction.reduce_sum, 64, {}),
                           (matmul.matmul, (8, 8), dict(M=2, K=2, N=2)),
                           (histogram.histogram, 64, dict(nbins=3, private=True))]:
        assert sd.compile(fn, ws, **params).features == frozenset()


def test_cli_prints_example_wgsl(capsys):
    from shaderdsl.__main__ import main

    assert main(["wgsl", "examples.saxpy:saxpy", "n=100"]) == 0
    out = capsys.readouterr().out
    assert "if (i < 100u) {" in out and "y[i] = a * x[i] + y[i];" in out
    assert main(["wgsl", "examples.matmul:matmul", "M=3", "K=5", "N=7",
                 "--workgroup-size", "4,4"]) == 0
    assert "@workgroup_size(4, 4, 1)" in capsys.readouterr().out


@pytest.mark.parametrize("module", [saxpy, reduction, matmul, histogram, half, int8_matmul,
                                    stencil])
def test_example_main_runs(device, module, capsys):
    module.main()
    out = capsys.readouterr().out
    assert "// kernel " in out and "nan" not in out.lower()


# ---------------------------------------------------------------- stencil: a tile with a halo

@pytest.mark.examples(quick=8)
@SETTINGS
@given(height=ragged(stencil.TILE, 40), width=ragged(stencil.TILE, 40),
       radius=st.integers(0, 2), tile=st.sampled_from([4, 8]), seed=seeds)
def test_stencil_matches_numpy(device, height, width, radius, tile, seed):
    """Every output sums (2r+1)^2 products in order: within taps * U of the
    sum of absolute terms. Edges read zeros: the tile's halo past the image."""
    rng = np.random.default_rng(seed)
    img, weights = nonzero(rng, (height, width)), nonzero(rng, (2 * radius + 1,) * 2)
    got = stencil.run(device, img, weights, tile=tile)
    want = stencil.reference(img, weights)
    terms = stencil.reference(np.abs(img), np.abs(weights))
    assert np.all(np.abs(got - want) <= (2 * radius + 1) ** 2 * U * terms), \
        np.abs(got - want).max()


# ---------------------------------------------------------------- rows: softmax and LayerNorm

@pytest.mark.examples(quick=8)
@SETTINGS
@given(rows=st.integers(1, 5), cols=ragged(rows_mod.WORKGROUP_SIZE, 300), seed=seeds)
def test_softmax_rows(device, rows, cols, seed):
    """Error bound: exp, the max and the sum each within a few U relative; 64 U."""
    x = nonzero(np.random.default_rng(seed), (rows, cols)) * 8
    got = rows_mod.run(device, rows_mod.softmax, x)
    want = rows_mod.softmax_reference(x)
    np.testing.assert_allclose(got, want, rtol=64 * U * np.log2(cols + 1) + 1e-6, atol=0)


@pytest.mark.examples(quick=8)
@SETTINGS
@given(rows=st.integers(1, 5), cols=ragged(rows_mod.WORKGROUP_SIZE, 300), seed=seeds)
def test_layer_norm_rows(device, rows, cols, seed):
    """Error bound in units of the output's scale (|gamma| / std + |beta|):
    64 U times log2(cols)."""
    rng = np.random.default_rng(seed)
    x = nonzero(rng, (rows, cols)) + 3.0
    gamma, beta = nonzero(rng, cols), nonzero(rng, cols)
    got = rows_mod.run(device, rows_mod.layer_norm, x, gamma=gamma, beta=beta)
    want = rows_mod.layer_norm_reference(x, gamma, beta)
    scale = np.abs(gamma) / np.sqrt(f64(x).var(axis=1, keepdims=True) + 1e-5) * 4 + np.abs(beta)
    assert (np.abs(got - want) <= 256 * U * np.log2(cols + 2) * scale).all()


# ---------------------------------------------------------------- multi-block scan

@SETTINGS
@given(n=ragged(scan.WORKGROUP_SIZE, 70_000), seed=seeds, subgroups=st.booleans())
def test_multi_block_scan(device, n, seed, subgroups):
    """Integers: exact. Up to 70,000 values: three levels of blocks."""
    if subgroups and not device.has_feature("subgroup"):
        subgroups = False  # the tree form is tested then; the subgroup form needs the feature
    x = np.random.default_rng(seed).integers(-1000, 1000, n).astype(np.int32)
    got = scan.run(device, x, subgroups=subgroups)
    assert np.array_equal(got, np.cumsum(x, dtype=np.int64))


# ---------------------------------------------------------------- bitonic sort on the uniform ring

@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3000), seed=seeds)
def test_bitonic_sort(device, n, seed):
    """Sorting moves values: exact. One pipeline and one submit for all passes."""
    x = nonzero(np.random.default_rng(seed), n) * 1000
    before = dict(device.stats)
    got = bitonic.run(device, x)
    assert np.array_equal(got, np.sort(x))
    assert device.stats["submits"] - before["submits"] <= 2  # the sort, then the read
    assert device.stats["pipelines"] - before["pipelines"] <= 1
