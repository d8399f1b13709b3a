"""The GEMM engine (shaderdsl.matmul: tiling, prologue, epilogue), its
example (examples/matrix_gemm.py) and the LoRA kernels on it ("matrix").

The interpreter device runs them everywhere: it offers the H200's subgroup-
matrix shapes and checks, at run time, that each subgroup's matrix arguments
agree (the check Tint's diagnostic, turned off in the WGSL, cannot make), and
the workgroup-memory races of the staging. On an adapter with f16 -> f32
16x16x16 matrices (the H200 under Dawn) the same checks run on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import h200_interp
from hypothesis import given, settings
from hypothesis import strategies as st
from range_check import unproven

import lora
import shaderdsl as sd
from examples.matrix_gemm import CONFIG, SMALL, run
from lora import reference as R
from lora.kernels.registry import KERNELS
from shaderdsl import interp, vec4f, vec4h
from shaderdsl.matmul import Epilogue, MatrixTiling, Operand, gemm, tiled_product
from shaderdsl.types import MatrixConfig

F16_RESULTS = MatrixConfig("f16", "f16", 16, 16, 16)


def f32_steps_reference(a, b, step=16):
    """f16 products summed in f32 ``step`` columns of K at a time, each step
    exact (float64) and rounded once into the f32 sum: what the interpreter's
    subgroupMatrixMultiplyAccumulate computes."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(0, a.shape[1], step):
        exact = a[:, k:k + step].astype(np.float64) @ b[k:k + step].astype(np.float64)
        acc = (acc.astype(np.float64) + exact).astype(np.float32)
    return acc


def _gemm(dev, a, b, tiling, a_t=False, b_t=False, **kw):
    """gemm's C (f32, or as ``kw`` says) for f16 ``a`` [M, K] and ``b`` [K, N],
    either stored transposed (``a_t``, ``b_t``: the engine's column-major
    factors); ``kw["c"]``: C's initial contents (default NaN: a result nothing
    wrote fails), ``kw["bias"]``: the bias values."""
    (M, K), N = a.shape, b.shape[1]
    c = kw.pop("c", None)
    bias = kw.pop("bias", None)
    kw = dict(kw, a_major="col" if a_t else "row", b_major="col" if b_t else "row")
    k = sd.compile(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling, bias=bias is not None,
                   **kw)
    dtype = np.float16 if kw.get("out") == "f16" else np.float32
    if c is None:
        c = np.full(M * (kw.get("c_stride") or N), np.nan, dtype)
    bufs = {"A": dev.buffer(_as_bound(a.T if a_t else a, tiling)),
            "B": dev.buffer(_as_bound(b.T if b_t else b, tiling)),
            "C": dev.buffer(np.ascontiguousarray(c, dtype).reshape(-1))}
    if bias is not None:
        bufs["bias"] = dev.buffer(bias.astype(dtype))
    dev.dispatch(k, bufs, tiling.grid(M, N, kw.get("batches", 1)))
    return dev.read(bufs["C"]).reshape(M, -1)


@pytest.mark.examples(quick=2)
@settings(max_examples=8, deadline=None)
@given(dims=st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(1, 12)),
       a_t=st.booleans(), b_t=st.booleans(), k_step=st.sampled_from([16, 32]),
       group=st.sampled_from([0, 0, 2, 3]), seed=st.integers(0, 2**32 - 1))
def test_products_match_the_f32_step_reference(dims, a_t, b_t, k_step, group, seed):
    """Any M, N, K multiples of 4 (so edges of every tile are exercised),
    either factor stored transposed, one or several staged slices,
    workgroups in grouped order or not (a last group of fewer row blocks
    too): equal to the f16 products summed in f32 per 16 of K (fresh random
    inputs: every element exactly, so no block is missed or written twice)."""
    M, N, K = 4 * dims[0], 4 * dims[1], 4 * dims[2]
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=k_step, group=group)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float16)
    b = rng.standard_normal((K, N)).astype(np.float16)
    got = _gemm(h200_interp(), a, b, tiling, a_t, b_t)
    assert np.array_equal(got, f32_steps_reference(a, b))


# note 40's variants of the staging, small enough for the interpreter: 16-byte reads,
# one copy of each slice (two barriers a step), both with grouped workgroups; and
# note 42's: each slice read two steps ahead (held a step in registers)
VARIANTS = (MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, read_width=8),
            MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=16, stages=1),
            MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, group=2, read_width=8, stages=1),
            MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, read_width=8, prefetch=2))


def _as_bound(x: np.ndarray, tiling: MatrixTiling) -> np.ndarray:
    """f16 data as gemm binds it, for any read width (16-byte reads declare
    vec4<u32> holding f16: an f16 buffer binds to them)."""
    return np.ascontiguousarray(x, np.float16).reshape(-1)


def _within_f32_sums(got, a, b):
    """Within 1e-5 of |A| @ |B| of float64's product (the GPU test's bound: f16
    inputs, every product exact in f32, sums rounded to f32)."""
    want = a.astype(np.float64) @ b.astype(np.float64)
    bound = 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    return bool((np.abs(got - want) <= bound).all())


def _factors(seed, M, N, K):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((M, K)).astype(np.float16),
            rng.standard_normal((K, N)).astype(np.float16))


def variant_cases():
    """Each variant with both factors as stored and both transposed: the default tier
    takes the first variant transposed and the others as stored (--full: all six)."""
    for k, tiling in enumerate(VARIANTS):
        for a_t, b_t in ((False, False), (True, True)):
            slow = a_t != (k == 0)
            yield pytest.param(tiling, a_t, b_t, id=f"{a_t}-{b_t}-{tiling}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("tiling, a_t, b_t", list(variant_cases()))
def test_pipeline_variants_match_float64(tiling, a_t, b_t):
    """M, N, K multiples of 8 but of no tile or step (72 x 40 x 56: partial
    blocks and a partial last step), either factor stored transposed, races
    checked: equal to the f16 products summed in f32 per 16 of K, and within
    1e-5 of |A| @ |B| of float64's."""
    a, b = _factors(sum(map(ord, str(tiling))) + a_t, 72, 40, 56)
    got = _gemm(h200_interp(), a, b, tiling, a_t, b_t)
    assert np.array_equal(got, f32_steps_reference(a, b)) and _within_f32_sums(got, a, b)


EXACT = (MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, exact=True),
         MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, read_width=8, stages=1, exact=True),
         MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, group=2, read_width=8, exact=True))


@pytest.mark.parametrize("K, tiling", [  # the default tier: one K a tiling (--full: both)
    pytest.param(K, t, id=f"{K}-{t}", marks=[] if (K == 32) == (k == 0) else [pytest.mark.slow])
    for K in (32, 96) for k, t in enumerate(EXACT)])
def test_exact_tilings_match_float64(tiling, K):
    """Whole blocks and steps (64 x 128, three of each; K of one 32-wide step:
    the loop runs no time, the last step after it): no edge tests, the
    same sums, races checked."""
    M, N = 64, 128
    a, b = _factors(K, M, N, K)
    k = sd.compile(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling, b_major="col")
    assert "select(" not in k.wgsl and " < 64u" not in k.wgsl
    assert ("for (var kt" in k.wgsl) == (K > tiling.k_step)
    got = _gemm(h200_interp(), a, b, tiling, b_t=True)
    assert np.array_equal(got, f32_steps_reference(a, b)) and _within_f32_sums(got, a, b)


@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("K", [32, 96])
def test_exact_prefetch_2_matches_float64(stages, K):
    """Each slice read two steps ahead, no edge tests: two steps (no loop: the
    held slice's step, then the last) and three, both stagings."""
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=16, stages=stages, prefetch=2,
                          exact=True)
    a, b = _factors(K + stages, 32, 64, K)
    got = _gemm(h200_interp(), a, b, tiling)
    assert np.array_equal(got, f32_steps_reference(a, b))


def test_exact_prefetch_2_needs_two_steps():
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=16, prefetch=2, exact=True)
    assert tiling.whole(32, 64, 32) and not tiling.whole(32, 64, 16)
    with pytest.raises(sd.KernelBuildError, match="K at least 2 steps"):
        sd.compile(gemm, tiling.threads, M=32, N=64, K=16, tiling=tiling)


def test_an_exact_tiling_refuses_a_partial_block():
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, exact=True)
    assert tiling.whole(64, 128, 96) and not tiling.whole(64, 120, 96)
    with pytest.raises(sd.KernelBuildError, match=r"multiples of \(32, 64, 32\).*\(64, 120, 96\)"):
        sd.compile(gemm, tiling.threads, M=64, N=120, K=96, tiling=tiling)


def test_a_bench_variant_in_the_interpreter():
    """One of the bench's big variants as gemm builds it (256 x 128 blocks of
    16 accumulators per subgroup, 16-byte reads, one copy of each slice) on a
    product smaller than one block."""
    tiling = MatrixTiling(CONFIG, (4, 2), (4, 4), 32, read_width=8, stages=1)
    a, b = _factors(40, 40, 24, 48)
    got = _gemm(h200_interp(), a, b, tiling)
    assert np.array_equal(got, f32_steps_reference(a, b)) and _within_f32_sums(got, a, b)


@pytest.mark.slow
def test_a_bench_variant_over_two_blocks_in_the_interpreter():
    """The same on one of two blocks by three steps."""
    tiling = MatrixTiling(CONFIG, (4, 2), (4, 4), 32, read_width=8, stages=1)
    a, b = _factors(264, 264, 136, 96)
    got = _gemm(h200_interp(), a, b, tiling)
    assert np.array_equal(got, f32_steps_reference(a, b)) and _within_f32_sums(got, a, b)


def test_every_bench_variant_fits_the_h200_and_is_proven():
    """``bench --gemm``'s variants at every shape it sweeps: the rule's tiling
    first, none twice, each within the H200's 48 KiB of workgroup memory
    (Dawn's limit there, h200_interp's), every workgroup index provable; the
    single-buffered ones have two barriers a step, the others one."""
    from lora.apps.bench_gemm import ISSUE_SHAPES, variants
    limit = h200_interp().limits["max-compute-workgroup-storage-size"]
    for M, N, K, layout in ISSUE_SHAPES:
        chosen = variants(M, N, K, layout)
        assert chosen[0][0] == "rule" and len(chosen) >= 8
        assert len({(str(t), str(o)) for _, t, o in chosen}) == len(chosen)
        for name, t, opts in chosen:
            k = sd.compile(gemm, t.threads, M=M, N=N, K=K, tiling=t, **opts)
            assert k.workgroup_bytes <= limit and unproven(k.wgsl) == [], (name, str(t))
            loop = k.wgsl[k.wgsl.index("for (var kt"):k.wgsl.index("subgroupMatrixStore")]
            tail = t.prefetch - 1 if t.exact else 0  # the held slice's step after the loop
            assert loop.count("workgroupBarrier()") == (3 - t.stages) * (1 + tail), (name, str(t))
            assert ("bitcast<vec2<f16>>" in k.wgsl) == (t.read_width == 8), (name, str(t))


def test_the_bench_ceilings_drop_what_they_say():
    """bench --gemm's ceilings (wrong results, timed only): without global
    reads no factor is read; with one staging store a read, an eighth of the
    stores (16-byte reads) and the reads still there."""
    t = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, read_width=8)
    full, loads, stores = (sd.compile(gemm, t.threads, M=64, N=128, K=64, tiling=t, ablate=a)
                           for a in ("", "loads", "stores"))
    assert " A[" in full.wgsl and " A[" not in loads.wgsl and " B[" not in loads.wgsl
    assert full.wgsl.count("stage_b[") == 8 * stores.wgsl.count("stage_b[") and \
        " A[" in stores.wgsl


# ------------------------------------------------------------------ the engine's epilogue

SMALL_BLOCKS = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32)  # 32 x 64 blocks


def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("kw, what", [   # two in the default tier, every option among them
    (dict(out="f16", scale=0.5, activation="relu"), "f16, scaled, bias, ReLU"),
    pytest.param(dict(out="f32", activation="silu", b_t=True), "SiLU, B transposed",
                 marks=pytest.mark.slow),
    pytest.param(dict(out="f16", accumulate=True, c_stride=52, c_offset=8),
                 "f16 += into wider rows", marks=pytest.mark.slow),
    (dict(out="f32", accumulate=True, c_stride=43, c_offset=1, a_t=True), "f32 scalars +="),
], ids=lambda v: v if isinstance(v, str) else None)
def test_epilogue_options_match_float64(kw, what):
    """Every epilogue option against float64 on partial blocks (72 x 40 x 56):
    the bias and activation after the scale, the add into the output as it
    was, the cast to f16 (within one f16 rounding) or f32, rows of the output
    wider than N from a column offset (vec4 stores where the offset and
    stride allow, scalars where not), the columns around the block untouched."""
    M, N, K = 72, 40, 56
    a, b = _factors(len(what), M, N, K)
    rng = np.random.default_rng(1)
    dtype = np.float16 if kw["out"] == "f16" else np.float32
    stride, first = kw.get("c_stride") or N, kw.get("c_offset", 0)
    c = rng.standard_normal((M, stride)).astype(dtype)
    bias = None if kw.get("accumulate") else rng.standard_normal(N).astype(dtype)
    a_t, b_t = kw.pop("a_t", False), kw.pop("b_t", False)
    got = _gemm(h200_interp(), a, b, SMALL_BLOCKS, a_t, b_t, c=c, bias=bias, **kw)
    v = kw.get("scale", 1.0) * (a.astype(np.float64) @ b.astype(np.float64))
    if bias is not None:
        v = v + bias.astype(np.float64)
    v = {"relu": lambda v: np.maximum(v, 0.0), "silu": _silu}.get(kw.get("activation"),
                                                                   lambda v: v)(v)
    want = c.astype(np.float64)
    want[:, first:first + N] = (want[:, first:first + N] if kw.get("accumulate") else 0.0) + v
    rounding = 2.0**-11 if dtype == np.float16 else 0.0
    bound = rounding * np.abs(want) + 1e-5 * (np.abs(want).max() + 1.0)
    assert (np.abs(got - want) <= bound).all(), what


@pytest.mark.parametrize("config, out", [(CONFIG, "f32"), (F16_RESULTS, "f16")], ids=str)
def test_in_place_accumulators_match_float64(config, out):
    """The output's own fragments as the accumulators (loaded, multiplied
    into, stored) in the whole block of a 40 x 72 output (blocks of 32 x 64),
    the blocks at the edges drained: every element the output's value plus
    the product, f32 sums exactly as staged, f16 sums within one f16
    rounding a step of 16."""
    M, N, K = 40, 72, 32
    a, b = _factors(7, M, N, K)
    c = np.random.default_rng(2).standard_normal((M, N)).astype(np.dtype(out.replace("f", "float")))
    tiling = MatrixTiling(config, (2, 2), (1, 2), k_step=32)
    k = sd.compile(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling, out=out, in_place=True,
                   accumulate=True)
    assert "subgroupMatrixLoad<subgroup_matrix_result" in k.wgsl and "if (whole)" in k.wgsl
    got = _gemm(h200_interp(), a, b, tiling, c=c, out=out, in_place=True, accumulate=True)
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    if out == "f32":
        first = (c.astype(np.float64) + f32_steps_reference(a, b)).astype(np.float32)
        assert np.allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        assert np.abs(got - first).max() <= 1e-5 * np.abs(want).max()
        return
    bound = (K // 16 + 1) * 2.0**-11 * (np.abs(c) + np.abs(a).astype(np.float64) @ np.abs(b))
    assert (np.abs(got - want) <= bound).all()


def test_in_place_with_an_exact_tiling_stores_without_a_drain():
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, exact=True)
    k = sd.compile(gemm, tiling.threads, M=64, N=128, K=32, tiling=tiling, in_place=True)
    assert "drain" not in k.wgsl and k.workgroup_bytes == tiling.shared_bytes(in_place=True)
    a, b = _factors(3, 64, 128, 32)
    got = _gemm(h200_interp(), a, b, tiling, in_place=True)
    assert np.array_equal(got, f32_steps_reference(a, b))


def _batched_kernel(m, M, N, K, batches, tiling):
    """Strided batches with a shared right factor, and a left factor that is
    the sum of two parts (split-K partials of an earlier product, f32)."""
    A = m.declare_input_buffer("A", vec4f, 2 * batches * M * K // 4)
    Bm = m.declare_input_buffer("B", vec4h, K * N // 4)
    C = m.declare_output_buffer("C", vec4f, batches * M * N // 4)
    tiled_product(m, tiling, Operand(A, batch=M * K, parts=2, part_stride=batches * M * K,
                                     scale=0.5),
                  Operand(Bm), M, N, K, Epilogue(C, batch=M * N), batches)


def test_batches_and_parts_match_float64():
    """Workgroup z as the batch (each factor and the output offset by its
    batch stride, a stride of 0 sharing B) and the left factor summed from two
    f32 parts and scaled as it is staged (rounded to f16 then): every batch
    equal to float64's product of the staged values within f32 sums."""
    M, N, K, batches = 32, 24, 32, 2
    rng = np.random.default_rng(9)
    parts = rng.standard_normal((2, batches, M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float16)
    dev = h200_interp()
    bufs = {"A": dev.buffer(parts.reshape(-1)), "B": dev.buffer(b.reshape(-1)),
            "C": dev.buffer(np.full(batches * M * N, np.nan, np.float32))}
    dev.dispatch(sd.compile(_batched_kernel, SMALL_BLOCKS.threads, M=M, N=N, K=K,
                            batches=batches, tiling=SMALL_BLOCKS), bufs,
                 SMALL_BLOCKS.grid(M, N, batches))
    got = dev.read(bufs["C"]).reshape(batches, M, N)
    staged = (0.5 * (parts[0] + parts[1])).astype(np.float16)
    for z in range(batches):
        assert _within_f32_sums(got[z], staged[z], b), z


@pytest.mark.parametrize("kw, message", [
    (dict(activation="gelu"), "activation: expected one of"),
    (dict(in_place=True, scale=2.0), "in_place: the output's own f32 fragments"),
    (dict(in_place=True, out="f16"), "must hold f32 scalars"),
])
def test_bad_epilogues_are_refused(kw, message):
    with pytest.raises(sd.KernelBuildError, match=message):
        sd.compile(gemm, SMALL.threads, M=64, N=64, K=32, tiling=SMALL, **kw)


def test_shared_bytes_is_what_the_kernel_declares():
    """MatrixTiling.shared_bytes (what lora.core.tilings checks limits with)
    against the compiled kernels, both majors and staging depths."""
    for t in (SMALL, *VARIANTS, MatrixTiling(CONFIG, (4, 2), (4, 4), 16, read_width=8)):
        for a_major, b_major in (("row", "row"), ("row", "col"), ("col", "row")):
            k = sd.compile(gemm, t.threads, M=256, N=256, K=64, tiling=t, a_major=a_major,
                           b_major=b_major)
            assert k.workgroup_bytes == t.shared_bytes(a_major, b_major), (str(t), a_major)


def test_the_wgsl_turns_off_only_tints_workgroup_uniformity_check():
    k = sd.compile(gemm, SMALL.threads, M=64, N=64, K=32, tiling=SMALL)
    assert "diagnostic(off, chromium.subgroup_matrix_uniformity);" in k.wgsl
    assert k.wgsl.count("workgroupBarrier()") >= 3 and "subgroupMatrixLoad" in k.wgsl


def test_16_byte_reads_bind_f16_data_and_nothing_else():
    """A 16-byte-read factor is vec4<u32> in the WGSL and holds f16 for the
    host: an f16 buffer binds to it, a u32 or f32 one is refused by name."""
    tiling = VARIANTS[0]
    k = sd.compile(gemm, tiling.threads, M=32, N=64, K=32, tiling=tiling)
    assert "array<vec4<u32>, 128>" in k.wgsl and k.binding("A").dtype == np.float16
    dev = h200_interp()
    a = np.ones(32 * 32, np.float16)
    bufs = {"A": dev.buffer(a.view(np.uint32)), "B": dev.buffer(np.ones(32 * 64, np.float16)),
            "C": dev.empty(32 * 64, np.float32)}
    with pytest.raises(sd.BindingError, match=r"binding 'A' .*expected dtype float16 \(WGSL "
                                              r"vec4<u32>\), got uint32"):
        dev.dispatch(k, bufs, tiling.grid(32, 64))
    with pytest.raises(sd.ShaderTypeError, match="a buffer of u32 .* may hold f16 or f32"):
        sd.compile(lambda m: m.declare_input_buffer("x", vec4f, 4, holds=sd.f16), 1)


def test_tints_range_analysis_proves_every_workgroup_index():
    """Every workgroup-array index of the matrix kernels lies provably inside
    its array by the rules of Tint's integer range analysis (note 37;
    tests/range_check.py), so Dawn's robustness with
    enable_integer_range_analysis_in_robustness leaves it unclamped; and the
    check is not vacuous: ``& 1u`` and a strided loop's variable are not proven."""
    kernels = [sd.compile(gemm, t.threads, M=M, N=N, K=K, tiling=t)
               for t in (SMALL, MatrixTiling(CONFIG, (4, 2), (2, 4), k_step=32, group=8))
               for M, N, K in ((128, 128, 64), (72, 100, 48))]
    kernels.append(sd.compile(gemm, SMALL.threads, M=40, N=48, K=32, tiling=SMALL,
                              a_major="col", b_major="col"))
    for name, params in [
            ("project_a_matrix", dict(rank=64, in_dim=256, tokens=100, splits=2)),
            ("project_a_matrix", dict(rank=24, in_dim=64, tokens=None, fragments=1,
                                      a_columns=True)),
            ("b_add_matrix", dict(out_dim=136, rank=64, scale=0.5, tokens=70, splits=2,
                                  save_h=True)),
            ("b_add_matrix", dict(out_dim=136, rank=32, scale=0.5, tokens=None, rows=1, cols=2,
                                  group=4)),
            ("b_add_matrix", dict(out_dim=128, rank=64, scale=0.5, tokens=70, splits=2,
                                  save_h=True, direct=True)),
            ("grad_outer_matrix", dict(n=136, rank=64, scale=0.5, tokens=300, chunk=128)),
            ("grad_outer_matrix", dict(n=136, rank=32, scale=0.5, tokens=64, chunk=64,
                                       layout="rj", accumulate=True))]:
        kernels.append(KERNELS[name].kernel(**params))
    for k in kernels:
        assert unproven(k.wgsl) == [], k.name
    # storage too, where the sizes are baked: every read of the factors is proven, only
    # the result stores (rows from workgroup_id) stay clamped
    for k, result in ((kernels[0], "C["), (kernels[5], "hp[")):
        stores = unproven(k.wgsl, "storage")
        assert stores and all(u.startswith(result) for u in stores), (k.name, stores)
    control = ("var<workgroup> t: array<f32, 64>;\n@compute @workgroup_size(64)\n"
               "fn main(@builtin(local_invocation_index) li: u32) {\n"
               "    t[li % 64u] = t[min(li * 2u, 63u)] + t[li & 63u];\n"
               "    for (var j: u32 = li; j < 64u; j += 64u) {\n"
               "        t[j] = 0.0;\n    }\n}\n")
    assert unproven(control) == ["t[li & 63u]", "t[j]"]


@pytest.mark.parametrize("kw, message", [
    (dict(config=CONFIG, group=-1), "group: expected 0"),
    (dict(config=MatrixConfig("f32", "f32", 16, 16, 16)), "multiplies f16 into f16 or f32"),
    (dict(config=MatrixConfig("f16", "i32", 16, 16, 16)), "multiplies f16 into f16 or f32"),
    (dict(config=MatrixConfig("f16", "f32", 16, 16, 16, (16, 64))), "one subgroup size"),
    (dict(config=CONFIG, k_step=24), "k_step must be a multiple of 16"),
    (dict(config=CONFIG, subgroups=(2,)), "subgroups: expected"),
    (dict(config=CONFIG, subgroups=(4, 4), fragments=(1, 1), k_step=16),
     "must split into vec4 reads evenly over 512 threads"),
    (dict(config=CONFIG, subgroups=(4, 2), fragments=(1, 1), k_step=16, read_width=8),
     r"must split into 16-byte \(8 f16\) reads evenly over 256 threads"),
    (dict(config=CONFIG, read_width=16), "read_width: expected 4, or 8"),
    (dict(config=CONFIG, pad=4), "pad: expected a multiple of 8"),
    (dict(config=CONFIG, stages=3), "stages: expected 1 or 2"),
    (dict(config=CONFIG, prefetch=3), "prefetch: expected 1 or 2"),
])
def test_bad_tilings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        MatrixTiling(**kw)


def _four_halves_as_sixteen_bytes(m, tiling):
    """A read_width 8 product whose factors are bound as vec4<f16> (four elements)."""
    A = m.declare_input_buffer("A", vec4h)
    C = m.declare_output_buffer("C", vec4f)
    tiled_product(m, tiling, Operand(A), Operand(A), 32, 32, 32, Epilogue(C))


def test_a_16_byte_read_must_be_packed_f16():
    tiling = MatrixTiling(CONFIG, (2, 2), (1, 2), k_step=32, read_width=8)
    with pytest.raises(sd.KernelBuildError, match=r"must be bound as vec4<u32> \(eight f16 a "
                                                  r"read\), got vec4<f16>"):
        sd.compile(_four_halves_as_sixteen_bytes, tiling.threads, tiling=tiling)


def test_the_example_in_the_interpreter():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((72, 48)).astype(np.float16)
    b = rng.standard_normal((48, 100)).astype(np.float16)
    got = run(h200_interp(), a, b)
    assert got.dtype == np.float32 and np.array_equal(got, f32_steps_reference(a, b))


def _has_fragment(device):
    if CONFIG not in device.subgroup_matrix_configs:
        pytest.skip(f"{device.name} has no {CONFIG} subgroup matrices")


def test_the_example_on_the_gpu(device):
    """Within 1e-5 of |A| @ |B| (f32 sums; the GPU may order partial sums otherwise)."""
    _has_fragment(device)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((200, 136)).astype(np.float16)
    b = rng.standard_normal((136, 264)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for tiling in (SMALL, MatrixTiling(CONFIG, (4, 2), (2, 4), k_step=32)):
        got = run(device, a, b, tiling)
        bound = 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
        assert (np.abs(got - want) <= bound).all(), str(tiling)


def test_the_variants_on_the_gpu(device):
    """Note 40's staging variants as gemm builds them, within 1e-5 of |A| @ |B|."""
    _has_fragment(device)
    from shaderdsl.matmul import gemm
    rng = np.random.default_rng(4)
    M, N, K = 200, 264, 136
    a = rng.standard_normal((M, K)).astype(np.float16)
    b = rng.standard_normal((K, N)).astype(np.float16)
    for tiling in (*VARIANTS, MatrixTiling(CONFIG, (4, 2), (4, 4), 32, read_width=8, stages=1)):
        bufs = {"A": device.buffer(_as_bound(a, tiling)), "B": device.buffer(_as_bound(b, tiling)),
                "C": device.empty(M * N, np.float32)}
        device.dispatch(sd.compile(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling), bufs,
                        tiling.grid(M, N))
        assert _within_f32_sums(device.read(bufs["C"]).reshape(M, N), a, b), str(tiling)


# ------------------------------------------------------------------ LoRA's "matrix" strategy

def _lora_case(device, rank, in_dim, out_dim, tokens, text, seed, save_h=False):
    rng = np.random.default_rng(seed)

    def f16(*shape):
        return rng.standard_normal(shape).astype(np.float16)
    a, b, x, base = f16(rank, in_dim), f16(out_dim, rank), f16(tokens, in_dim), f16(tokens, out_dim)
    w = lora.Weight.from_numpy(device, a, b, dtype=np.float16)
    out = device.buffer(base)
    plan = lora.forward_plan(device, w, 0.5, tokens, text, save_h=save_h)
    plan(device.buffer(x), out)
    got = device.read(out).astype(np.float64)
    # h is rounded to f16 as it is staged (as PyTorch's fp16 h is): one more 2**-11;
    # direct sums into f16 fragments: one more rounding per 16 ranks
    roundings = 1 + (rank // 16 if "direct" in text else 0)
    tol = R.f16_tolerance(x, a, b, 0.5, base) + roundings * R.F16_ROUNDING * R.tolerance(
        x, a, b, 0.5, base, rtol=1.0, atol=0.0)
    assert R.within(got, R.forward(x, a, b, 0.5, base), tol), text
    if save_h:
        h = device.read(plan.scratch["h"]).reshape(tokens, rank)
        assert R.within(h, R.project_a(a, x), R.h_tolerance(x, a)), "saved h"


@pytest.mark.examples(quick=1)
@settings(max_examples=4, deadline=None)
@given(rank=st.sampled_from([8, 16, 32]), dims=st.tuples(st.integers(4, 12), st.integers(4, 40)),
       tokens=st.integers(1, 48), form=st.sampled_from(["matrix", "matrix:2:1:1:4", "matrix:4"]),
       seed=st.integers(0, 2**32 - 1))
def test_matrix_strategy_in_the_interpreter(rank, dims, tokens, form, seed):
    """Any token count (partial tiles), in_dim split or not: the f16 forward
    within f16 rounding of float64, h (saved for a backward) within f32's."""
    in_dim, out_dim = 16 * dims[0], 4 * dims[1]
    _lora_case(h200_interp(), rank, in_dim, out_dim, tokens, form, seed, save_h=True)


@pytest.mark.examples(quick=1)
@settings(max_examples=4, deadline=None)
@given(rank=st.sampled_from([16, 32]), dims=st.tuples(st.integers(4, 12), st.integers(8, 40)),
       tokens=st.integers(1, 70), form=st.sampled_from(["matrix:1:1:2:2:direct",
                                                        "matrix:2:1:1:1:direct",
                                                        "matrix:4:1:4:2:direct"]),
       seed=st.integers(0, 2**32 - 1))
def test_direct_matrix_strategy_in_the_interpreter(rank, dims, tokens, form, seed):
    """The output's f16 fragments as accumulators (the engine's in-place
    epilogue) in the blocks inside the output, the blocks at its edges
    drained: within f16 rounding of float64, one more per 16 ranks."""
    in_dim, out_dim = 16 * dims[0], 4 * dims[1]
    _lora_case(h200_interp(), rank, in_dim, out_dim, tokens, form, seed, save_h=True)


@pytest.mark.examples(quick=1)
@settings(max_examples=4, deadline=None)
@given(rank=st.sampled_from([16, 32]), dims=st.tuples(st.integers(4, 8), st.integers(1, 40)),
       tokens=st.integers(1, 100),
       form=st.sampled_from(["matrix(rows=1, cols=2, group=3)",
                             "matrix(rows=1, cols=2, group=3, direct=True)",
                             "matrix(splits=2, rows=1, cols=1, group=2)",
                             "matrix(splits=2, fragments=1, rows=2, cols=2, depth=64)"]),
       seed=st.integers(0, 2**32 - 1))
def test_grouped_and_deep_matrix_forms_in_the_interpreter(rank, dims, tokens, form, seed):
    """b_add_matrix in grouped workgroup order (h saved by the workgroups of
    column block 0 wherever the order puts them; in the output's own
    fragments too), and project_a with 64
    columns per staged slice (the candidates for few tokens): within f16
    rounding of float64, like the plain form."""
    in_dim, out_dim = 16 * dims[0], 4 * dims[1]
    _lora_case(h200_interp(), rank, in_dim, out_dim, tokens, form, seed, save_h=True)


@pytest.mark.slow
def test_matrix_strategy_at_rank_64_in_the_interpreter():
    _lora_case(h200_interp(), 64, 128, 136, 70, "matrix:2:2:2:4", 1, save_h=True)


@pytest.mark.parametrize("rank, tokens", [(8, 300), (64, 77)])
def test_matrix_strategy_on_the_gpu(device, rank, tokens):
    _has_fragment(device)
    from lora.kernels.matrix import DIRECT
    direct = rank % 16 == 0 and DIRECT in device.subgroup_matrix_configs
    for text in ("matrix", "matrix:4:1:1:4") + (("matrix:1:1:2:2:direct", "matrix:4:1:4:2:direct")
                                                 if direct else ()):
        _lora_case(device, rank, 512, 256 if text.endswith("direct") else 264, tokens, text, 2,
                   save_h=True)


def test_matrix_is_offered_only_with_f16_fragments():
    from lora.core import tuning
    dev = h200_interp()
    f16 = {str(s) for s in tuning.candidates(dev, 16, 256, 256, 64, np.float16)}
    f32 = {str(s) for s in tuning.candidates(dev, 16, 256, 256, 64, np.float32)}
    none = interp.Device(subgroup_size=32, subgroup_matrix_configs=())
    assert any(s.startswith("matrix") for s in f16)
    assert not any(s.startswith("matrix") for s in f32)
    assert not any(str(s).startswith("matrix")
                   for s in tuning.candidates(none, 16, 256, 256, 64, np.float16))


def test_the_model_starts_with_the_h200s_matrix_winners():
    """f16 rank 64, 2560 -> 2560 on the H200 (optimisation note 37): matrix:2:1:2:2
    from 2048 tokens, 8 slices at depth 64 up to 1024; where the shape does not
    offer that form, the first candidate."""
    from lora.core import tuning
    from lora.core.strategy import Matrix
    dev = h200_interp()

    def first(tokens, in_dim=2560):
        w = lora.Weight.from_numpy(dev, np.zeros((64, in_dim)), np.zeros((2560, 64)),
                                   dtype=np.float16)
        return tuning.model(dev, w, tokens)[0]
    assert first(4096) == lora.Strategy.parse("matrix:2:1:2:2") == \
        Matrix(splits=2, fragments=1, rows=2, cols=2)
    assert first(2048) == Matrix(splits=2, fragments=1, rows=2, cols=2)
    assert first(512) == lora.Strategy.parse("matrix:8:1:2:2:64") == \
        Matrix(splits=8, fragments=1, rows=2, cols=2, depth=64)
    assert first(8192) == Matrix(fragments=1, rows=2, cols=2)  # 2 slices of 8192: over 8192 rows
    assert first(512, in_dim=2568) == Matrix(fragments=1, rows=2, cols=2)  # 8 slices: not x4


def test_matrix_depth_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match=r"matrix: depth must be a multiple of 16 \(the "
                                         r"fragments' K\), got 24"):
        lora.Strategy.parse("matrix:1:1:1:1:24")


def test_matrix_on_an_f32_weight_is_refused():
    dev = h200_interp()
    w = lora.Weight.from_numpy(dev, np.ones((8, 64)), np.ones((64, 8)))
    with pytest.raises(ValueError, match="multiplies f16 on matrix units; the weight is f32"):
        lora.forward_plan(dev, w, 1.0, 16, "matrix")


# ------------------------------------------------------------------ the "matrix" backward

def _backward_case(device, rank, in_dim, out_dim, tokens, text, seed):
    """dA and dB of the matrix backward (h and dh rounded to f16 as they are
    staged, f32 sums) within two f16 roundings of the magnitudes of float64."""
    from lora.training.backward import backward_plan
    rng = np.random.default_rng(seed)

    def f16(*shape):
        return rng.standard_normal(shape).astype(np.float16)
    a, b, x, g = f16(rank, in_dim), f16(out_dim, rank), f16(tokens, in_dim), f16(tokens, out_dim)
    w = lora.Weight.from_numpy(device, a, b, dtype=np.float16)
    h = R.project_a(a, x).astype(np.float32)
    bufs = [device.buffer(v) for v in (g, x, h)] + [device.empty(a.shape, np.float32),
                                                    device.empty(b.shape, np.float32)]
    plan = backward_plan(device, w, 0.5, tokens, text, with_dx=False)
    assert "grad_outer_matrix" in {s.kernel.name for s in plan.steps}
    plan(*bufs)
    want = R.backward(x, a, b, g, 0.5)
    ab, bb, xb, gb = (np.abs(v.astype(np.float64)) for v in (a, b, x, g))
    mag_b = 0.5 * gb.T @ (xb @ ab.T)
    mag_a = (0.5 * gb @ bb).T @ xb
    for got, key, mag in ((bufs[3], "grad_a", mag_a), (bufs[4], "grad_b", mag_b)):
        tol = 2 * R.F16_ROUNDING * mag + 1e-6 * mag.max()
        assert R.within(device.read(got), want[key], tol), (text, key)


@pytest.mark.slow
def test_matrix_backward_in_the_interpreter():
    """Two chunks of tokens (the second partial), dh in two slices of out_dim."""
    _backward_case(h200_interp(), 16, 32, 64, 40, "matrix:32", 4)


@pytest.mark.parametrize("rank, tokens", [(16, 77), (64, 600)])
def test_matrix_backward_on_the_gpu(device, rank, tokens):
    _has_fragment(device)
    for text in ("matrix", "matrix:128"):
        _backward_case(device, rank, 512, 264, tokens, text, 5)


def test_matrix_backward_dx_matches_float64():
    """The matrix backward's dx += dh A (grad_input_matrix, the engine on b_add's
    tiling) on partial blocks: within two f16 roundings (dh staged as f16, dx
    stored as f16) of float64's, the backward plan naming it."""
    from lora.core.plan import Plan
    from lora.training.backward import backward_plan
    dev = h200_interp()
    rng = np.random.default_rng(8)
    tokens, rank, in_dim = 40, 16, 72
    a = rng.standard_normal((rank, in_dim)).astype(np.float16)
    dh = rng.standard_normal((tokens, rank)).astype(np.float32)
    dx0 = rng.standard_normal((tokens, in_dim)).astype(np.float16)
    dx = dev.buffer(dx0)
    Plan(dev, "dx", [("grad_input_matrix", dict(in_dim=in_dim, rank=rank, tokens=tokens,
                                                accumulate=True))], {},
         bound={"A": dev.buffer(a), "dh": dev.buffer(dh), "dx": dx}).record()
    want = dx0.astype(np.float64) + dh.astype(np.float64) @ a.astype(np.float64)
    mag = np.abs(dx0).astype(np.float64) + np.abs(dh).astype(np.float64) @ np.abs(a)
    assert (np.abs(dev.read(dx) - want) <= 2 * R.F16_ROUNDING * mag + 1e-6).all()
    w = lora.Weight.from_numpy(dev, a, np.ones((64, rank)), dtype=np.float16)
    plan = backward_plan(dev, w, 0.5, tokens, "matrix")
    assert "grad_input_matrix" in {s.kernel.name for s in plan.steps}


def test_matrix_backward_is_the_f16_default_with_fragments():
    from lora.training.backward import backward_of
    w = lora.Weight.from_numpy(h200_interp(), np.ones((64, 256)), np.ones((256, 64)),
                               dtype=np.float16)
    assert str(backward_of(None, 512, w, h200_interp())) == "matrix"
    none = interp.Device(subgroup_size=32, subgroup_matrix_configs=())
    assert str(backward_of(None, 512, w, none)) == "gemm"
    with pytest.raises(ValueError, match="the matrix backward multiplies f16 on matrix units"):
        lora.backward_plan(h200_interp(), lora.Weight.from_numpy(
            h200_interp(), np.ones((64, 256)), np.ones((256, 64))), 1.0, 16, "matrix")


def test_a_matrix_var_says_its_zero():
    """A subgroup-matrix var without an initializer is written with the zero
    value (`= subgroup_matrix_result<f32, 16, 16>()`): WGSL zeroes a var each
    time its declaration runs, which Tint's Vulkan build on the H200 did not
    do for one declared inside a loop (many_matrix's expand accumulated one
    block of columns onto the last)."""
    def kernel(m):
        out = m.declare_output_buffer("out", sd.f32, 256)
        with m.loop(2, name="i"):
            acc = m.var(CONFIG.types()[2], name="acc")
            sd.builtins.subgroup_matrix_store(out, 0, acc, 16)

    wgsl = sd.compile(kernel, 32).wgsl
    assert "var acc: subgroup_matrix_result<f32, 16, 16> = subgroup_matrix_result<f32, 16, 16>();" \
        in wgsl, wgsl
