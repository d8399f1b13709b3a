"""Subgroup matrices (Dawn's WGSL extension chromium_experimental_subgroup_matrix).

No adapter here has the "chromium-experimental-subgroup-matrix" feature
(wgpu-native has no such extension; Dawn offers it only on GPUs with
cooperative-matrix support and with unsafe APIs allowed), so the kernels are
checked as WGSL text, refused by the test device with FeatureError, and run
in the interpreter, which emulates the collectives exactly for integers:

* int8 and uint8 matrix products on the configurations 16x16x32 and
  16x8x32 (M x N x K), several tiles per matrix, row- and column-major
  loads and stores, summed into i32/u32 exactly as numpy's int64 product;
* f32/f16 products, rounded once from float64 (a GPU may differ there);
* staging through workgroup memory, with the race checks;
* the arguments the rules refuse, and non-uniform arguments, which the
  interpreter refuses at run time.

The WGSL is the form of the Dawn that wgpudawn 0.32 builds:
``subgroupMatrixLoad<T, row_major>(&a, offset, stride)`` and
``subgroupMatrixStore<row_major>(&a, offset, value, stride)``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shaderdsl as sd
from examples.subgroup_matmul import FEATURE, NUMPY, RESULT, SUBGROUP, host, tiled_matmul
from shaderdsl import builtins as B
from shaderdsl import f32, i32
from shaderdsl import subgroup_matrix_left as Left
from shaderdsl import subgroup_matrix_result as Result
from shaderdsl import subgroup_matrix_right as Right
from shaderdsl.checks import check_kernel
from shaderdsl.errors import (
    DispatchError,
    FeatureError,
    InterpreterError,
    OutOfBoundsError,
    ShaderTypeError,
)
from shaderdsl.interp import InterpDevice, Interpreter
from shaderdsl.interp.device import H200_MATRIX_CONFIGS
from shaderdsl.types import MatrixConfig


def run_interp(a, b, TM, TN, TK, comp="i8", layouts="rrr", subgroups_per_wg=1, **kw):
    (M, K), N = a.shape, b.shape[1]
    params: dict = dict(M=M, N=N, K=K, TM=TM, TN=TN, TK=TK, comp=comp, layouts=layouts, **kw)
    interp = Interpreter(tiled_matmul, SUBGROUP * subgroups_per_wg, subgroup_size=SUBGROUP,
                         **params)
    c = np.zeros(M * N, NUMPY[RESULT[comp].name])
    tiles = (M // TM) * (N // TN)
    out = interp.dispatch({"A": host(a, layouts[0], comp), "B": host(b, layouts[1], comp),
                           "C": c}, tiles // subgroups_per_wg)["C"]
    return out.reshape(M, N) if layouts[2] == "r" else out.reshape(N, M).T


def random_8bit(rng, shape, comp):
    lo, hi = (-128, 127) if comp == "i8" else (0, 255)
    v = np.where(rng.random(shape) < 0.2, rng.choice([lo, hi], shape),
                 rng.integers(lo, hi, shape, endpoint=True))
    return v.astype(NUMPY[comp])


# ================================================================ WGSL text and features

def test_wgsl_text_and_features():
    k = sd.compile(tiled_matmul, 32, M=16, N=16, K=64, TM=16, TN=16, TK=32, layouts="rcc")
    assert k.features == frozenset({FEATURE})
    lines = k.wgsl.splitlines()
    assert lines[1] == "enable chromium_experimental_subgroup_matrix;"
    zero = "subgroup_matrix_result<i32, 16, 16>"
    for text in (f"var acc: {zero} = {zero}();",
                 "subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(&A, ",
                 "subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&B, ",
                 "acc = subgroupMatrixMultiplyAccumulate(a, b, acc);",
                 "subgroupMatrixStore<col_major>(&C, "):
        assert text in k.wgsl, text
    k = sd.compile(tiled_matmul, 32, M=8, N=8, K=8, TM=8, TN=8, TK=8, comp="f16",
                   accumulate=False)
    assert k.features == frozenset({FEATURE, "shader-f16"})
    assert k.wgsl.splitlines()[1:3] == ["enable f16;",
                                        "enable chromium_experimental_subgroup_matrix;"]
    assert "acc = subgroupMatrixMultiply<f16>(a, b);" in k.wgsl


def test_a_device_without_the_feature_refuses(device):
    if device.has_feature(FEATURE):
        pytest.skip(f"{device.name} has {FEATURE}: test_gpu_products_are_exact runs instead")
    k = sd.compile(tiled_matmul, 32, M=16, N=8, K=32, TM=16, TN=8, TK=32)
    with pytest.raises(FeatureError, match=FEATURE):
        device.prepare(k)


@pytest.mark.parametrize("M, K, N", [(16, 64, 16), (32, 64, 32), (256, 256, 256)])
def test_gpu_products_are_exact(device, M, K, N):
    """On an adapter with subgroup matrices (the H200 under Dawn): the int8
    example against numpy's int64 product, several K steps and tiles."""
    if not device.has_feature(FEATURE) or not any(
            c.component == "i8" and (c.m, c.n, c.k) == (16, 16, 32)
            for c in device.subgroup_matrix_configs):
        pytest.skip(f"{device.name} has no i8 16x16x32 subgroup matrices ({FEATURE})")
    from examples.subgroup_matmul import run

    rng = np.random.default_rng(M + K)
    a, b = random_8bit(rng, (M, K), "i8"), random_8bit(rng, (K, N), "i8")
    assert np.array_equal(run(device, a, b), a.astype(np.int64) @ b.astype(np.int64))


# ================================================================ the interpreter, exactly

CONFIGS = [(16, 16, 32), (16, 8, 32)]   # M x N x K of one subgroup matrix product


@pytest.mark.parametrize("TM, TN, TK", CONFIGS)
@pytest.mark.parametrize("comp", ["i8", "u8"])
def test_8bit_products_are_exact(TM, TN, TK, comp):
    """Two tiles each way, two K steps, the extremes included: numpy's int64 product."""
    rng = np.random.default_rng(TN + (comp == "u8"))
    a = random_8bit(rng, (2 * TM, 2 * TK), comp)
    b = random_8bit(rng, (2 * TK, 2 * TN), comp)
    got = run_interp(a, b, TM, TN, TK, comp)
    assert got.dtype == NUMPY[RESULT[comp].name]
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@settings(max_examples=12, deadline=None)
@given(config=st.sampled_from(CONFIGS), comp=st.sampled_from(["i8", "u8"]),
       tiles=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)),
       layouts=st.sampled_from(["rrr", "ccc", "rcr", "crc"]), two=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_8bit_products_property(config, comp, tiles, layouts, two, seed):
    """Any number of tiles, either layout of each matrix, one or two subgroups
    per workgroup: exact."""
    (TM, TN, TK), (tm, tn, tk) = config, tiles
    if two and (tm * tn) % 2:
        tn *= 2
    rng = np.random.default_rng(seed)
    a = random_8bit(rng, (tm * TM, tk * TK), comp)
    b = random_8bit(rng, (tk * TK, tn * TN), comp)
    got = run_interp(a, b, TM, TN, TK, comp, layouts, subgroups_per_wg=2 if two else 1)
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_int_sums_wrap_like_i32():
    """K = 4096 products of -128 * -128 = 2**26 (fits); u8 255 * 255 * 4096 wraps
    nothing either; the accumulator is 32 bits like on the GPU."""
    a, b = np.full((16, 4096), -128, np.int8), np.full((4096, 8), -128, np.int8)
    assert (run_interp(a, b, 16, 8, 32) == 4096 * 128 * 128).all()
    a, b = np.full((16, 64), 255, np.uint8), np.full((64, 8), 255, np.uint8)
    assert (run_interp(a, b, 16, 8, 32, comp="u8") == 64 * 255 * 255).all()


@pytest.mark.parametrize("comp", ["f32", "f16"])
def test_float_products_round_once(comp):
    """f32/f16: the float64 product rounded once to the result type (the GPU may
    round partial sums too; the interpreter shows the exact answer's rounding)."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((16, 8)).astype(NUMPY[comp])     # one K step: one rounding
    b = rng.standard_normal((8, 16)).astype(NUMPY[comp])
    got = run_interp(a, b, 8, 8, 8, comp, accumulate=comp == "f32")
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(NUMPY[comp])
    assert got.dtype == NUMPY[comp] and np.array_equal(got, want)


# ================================================================ workgroup memory

def staged(m, read_back_barrier=True):
    """A tile of A staged in workgroup memory lane by lane, multiplied from
    there, the product stored to workgroup memory and copied out lane by lane."""
    A = m.declare_input_buffer("A", i32, 16 * 32 // 4)
    Bm = m.declare_input_buffer("B", i32, 32 * 8 // 4)
    C = m.declare_output_buffer("C", i32, 16 * 8)
    a_tile = m.shared(i32, 16 * 32 // 4, "a_tile")
    c_tile = m.shared(i32, 16 * 8, "c_tile")
    lane = m.let(m.local_index(), "lane")
    for k in m.static_loop(range(0, 128, SUBGROUP)):
        a_tile[lane + k] = A[lane + k]
    m.barrier()
    a = m.let(B.subgroup_matrix_load(Left("i8", 32, 16), a_tile, 0, 32 // 4), "a")
    b = m.let(B.subgroup_matrix_load(Right("i8", 8, 32), Bm, 0, 8 // 4), "b")
    B.subgroup_matrix_store(c_tile, 0, B.subgroup_matrix_multiply(i32, a, b), 8)
    if read_back_barrier:
        m.barrier()
    for k in m.static_loop(range(0, 128, SUBGROUP)):
        C[lane + k] = c_tile[lane + k]


def test_staging_through_workgroup_memory():
    rng = np.random.default_rng(9)
    a, b = random_8bit(rng, (16, 32), "i8"), random_8bit(rng, (32, 8), "i8")
    inputs = {"A": host(a, "r", "i8"), "B": host(b, "r", "i8"), "C": np.zeros(128, np.int32)}
    out = Interpreter(staged, SUBGROUP).dispatch(inputs, 1)["C"]
    assert np.array_equal(out.reshape(16, 8), a.astype(np.int64) @ b.astype(np.int64))
    # without the barrier, lane 1 reads what the subgroup's store wrote: a race
    with pytest.raises(sd.errors.RaceError, match="c_tile"):
        Interpreter(staged, SUBGROUP, read_back_barrier=False).dispatch(inputs, 1)


F16 = Left(sd.f16, 16, 16)   # the H200's f16 16x16 fragment


def tile_reuse(m, first="load", then="store", barrier=True, threads=SUBGROUP):
    """A 16x16 f16 tile of workgroup memory per subgroup, staged lane by lane,
    then used twice: ``first`` a matrix load (or a matrix store) of it,
    ``then`` ordinary stores (``"store"``), reads (``"read"``), a matrix store
    or a matrix load; ``barrier``: a workgroupBarrier() between the two uses."""
    n = 256 * threads // SUBGROUP
    A = m.declare_input_buffer("A", sd.f16, n)
    C = m.declare_output_buffer("C", sd.f16, n)
    tile = m.shared(sd.f16, n, "tile")
    lane = m.let(m.local_index(), "lane")
    mine = m.let(lane / SUBGROUP * 256, "mine")     # this subgroup's tile
    for k in m.static_loop(range(0, n, threads)):
        tile[lane + k] = A[lane + k]
    m.barrier()
    if first == "load":
        t = m.let(B.subgroup_matrix_load(F16, tile, mine, 16), "t")
    else:
        t = m.let(B.subgroup_matrix_load_col_major(F16, A, mine, 16), "t")
        B.subgroup_matrix_store(tile, mine, t, 16)
    if barrier:
        m.barrier()
    if then in ("store", "read"):
        for k in m.static_loop(range(0, n, threads)):
            if then == "store":
                tile[lane + k] = A[lane + k] + A[lane + k]
            else:
                C[lane + k] = tile[lane + k]
        return
    if then == "matrix store":
        B.subgroup_matrix_store_col_major(tile, mine, t, 16)
    else:
        t = m.let(B.subgroup_matrix_load_col_major(Right(sd.f16, 16, 16), tile, mine, 16), "u")
    B.subgroup_matrix_store(C, mine, t, 16)


REUSES = [("load", "store"), ("load", "matrix store"), ("store", "read"),
          ("store", "matrix load")]


@pytest.mark.parametrize("first, then", REUSES)
@pytest.mark.parametrize("threads", [SUBGROUP, 2 * SUBGROUP])
def test_matrix_loads_and_stores_take_part_in_the_race_check(first, then, threads):
    """Every element a matrix load reads or a matrix store writes counts as
    touched by every lane of the subgroup: without the barrier between the
    two uses each pattern is a race on ``tile`` (with one subgroup too: which
    lane moves which element is the hardware's choice); with it, none."""
    a = (np.arange(256 * threads // SUBGROUP) % 61).astype(np.float16)
    data = {"A": a, "C": np.zeros(a.size, np.float16)}
    out = Interpreter(tile_reuse, threads, subgroup_size=SUBGROUP, first=first, then=then,
                      threads=threads).dispatch(data, 1)["C"]
    tiles = a.reshape(-1, 16, 16)
    if then == "read":     # each tile holds its part of A transposed
        assert np.array_equal(out, tiles.transpose(0, 2, 1).reshape(-1))
    elif then != "store":
        assert np.array_equal(out, a)
    racy = Interpreter(tile_reuse, threads, subgroup_size=SUBGROUP, first=first, then=then,
                       barrier=False, threads=threads)
    with pytest.raises(sd.errors.RaceError, match=r"workgroup array element tile\[\d+\]") as e:
        racy.dispatch(data, 1)
    assert "subgroup-matrix load or store" in str(e.value)


def test_a_matrix_race_on_the_interpreter_device():
    """interp.Device checks it too: the message names the array, the subgroup and both lines."""
    device = InterpDevice(subgroup_size=SUBGROUP)
    k = sd.compile(tile_reuse, SUBGROUP, barrier=False)
    a = device.buffer(np.ones(256, np.float16))
    c = device.zeros(256, np.float16)
    with pytest.raises(sd.errors.RaceError) as e:
        device.dispatch(k, {"A": a, "C": c}, 1)
    msg = str(e.value)
    assert "data race on workgroup array element tile[" in msg, msg
    assert "read by the subgroup of local_index 0-31 (a subgroup-matrix load or store: any of " \
           "its lanes)" in msg and "then written by local_index " in msg, msg
    assert (device.read(c) == 0).all()


def test_matrix_loads_from_storage_and_reads_of_reads_do_not_race():
    """Two subgroups loading one tile of workgroup memory, and ordinary reads of
    it, between the same barriers: reads only, no race; a load of storage is
    not a workgroup access."""
    def k(m):
        A = m.declare_input_buffer("A", sd.f16, 256)
        C = m.declare_output_buffer("C", sd.f16, 512)
        tile = m.shared(sd.f16, 256, "tile")
        lane = m.let(m.local_index(), "lane")
        for j in m.static_loop(range(0, 256, 2 * SUBGROUP)):
            tile[lane + j] = A[lane + j]
        m.barrier()
        t = m.let(B.subgroup_matrix_load(F16, tile, 0, 16), "t")
        s = m.let(B.subgroup_matrix_load(F16, A, 0, 16), "s")
        C[lane] = tile[255 - lane]
        sub = m.let(lane / 32, "sub")
        B.subgroup_matrix_store(C, sub * 256, t, 16)
        B.subgroup_matrix_store(C, 0, s, 16)
    a = np.arange(256).astype(np.float16)
    out = Interpreter(k, 2 * SUBGROUP, subgroup_size=SUBGROUP).dispatch(
        {"A": a, "C": np.zeros(512, np.float16)}, 1)["C"]
    assert np.array_equal(out[256:], a)


def test_a_matrix_load_of_unwritten_workgroup_memory_raises():
    def k(m):
        C = m.declare_output_buffer("C", sd.f16, 256)
        tile = m.shared(sd.f16, 256, "tile")
        tile[m.local_index()] = sd.f16(1)
        m.barrier()
        B.subgroup_matrix_store(C, 0, B.subgroup_matrix_load(F16, tile, 0, 16), 16)
    with pytest.raises(sd.errors.UninitializedReadError,
                       match=r"the subgroup of local_index 0-31 .* reads workgroup array "
                             r"element tile\[32\]"):
        Interpreter(k, SUBGROUP, subgroup_size=SUBGROUP).dispatch(
            {"C": np.zeros(256, np.float16)}, 1)


# ================================================================ refusals

def _refuses(body, message, exc=ShaderTypeError):
    def k(m):
        bufs = {n: m.declare_input_buffer(n, t) for n, t in
                (("ai", i32), ("af", f32))}
        bufs["out"] = m.declare_output_buffer("out", i32)
        body(m, bufs)
    with pytest.raises(exc) as info:
        sd.compile(k, 32)
    assert message in str(info.value), str(info.value)


L8, R8 = Left("i8", 32, 16), Right("i8", 16, 32)
NOT_A_MATRIX: Any = f32     # a scalar type where a matrix type belongs (Any: it is the mistake)


@pytest.mark.parametrize("body, message", [
    (lambda m, b: B.subgroup_matrix_load(L8, b["af"], 0, 32),
     "subgroup_matrix_load() of subgroup_matrix_left<i8, 32, 16> needs a whole storage buffer "
     "or workgroup array of i32, got array<f32>"),
    (lambda m, b: B.subgroup_matrix_load(L8, b["ai"][0], 0, 32), "needs a whole storage buffer"),
    (lambda m, b: B.subgroup_matrix_load(NOT_A_MATRIX, b["ai"], 0, 32),
     "subgroup_matrix_load() needs a subgroup_matrix_*, got f32"),
    (lambda m, b: B.subgroup_matrix_load(L8, b["ai"], i32(0), 32),
     "offset and stride must be u32, got i32, u32"),
    (lambda m, b: B.subgroup_matrix_multiply(
        i32, m.let(B.subgroup_matrix_load(L8, b["ai"], 0, 32)),
        m.let(B.subgroup_matrix_load(Right("i8", 16, 16), b["ai"], 0, 16))),
     "left's K (columns) = right's K (rows)"),
    (lambda m, b: B.subgroup_matrix_multiply(
        i32, m.let(B.subgroup_matrix_load(R8, b["ai"], 0, 16)),
        m.let(B.subgroup_matrix_load(L8, b["ai"], 0, 32))),
     "subgroup_matrix_multiply() needs a subgroup_matrix_left, got subgroup_matrix_right"),
    (lambda m, b: B.subgroup_matrix_multiply(
        f32, m.let(B.subgroup_matrix_load(L8, b["ai"], 0, 32)),
        m.let(B.subgroup_matrix_load(R8, b["ai"], 0, 16))),
     "i8 matrices multiply into an i32/u32 result, not f32"),
    (lambda m, b: B.subgroup_matrix_multiply_accumulate(
        m.let(B.subgroup_matrix_load(L8, b["ai"], 0, 32)),
        m.let(B.subgroup_matrix_load(R8, b["ai"], 0, 16)), m.var(Result(i32, 8, 16))),
     "the product is 16 x 16 (N x M) but the accumulator is subgroup_matrix_result<i32, 8, 16>"),
    (lambda m, b: B.subgroup_matrix_store(
        b["ai"], 0, m.let(B.subgroup_matrix_load(L8, b["ai"], 0, 32)), 32),
     "subgroup_matrix_store() needs a writable array"),
    (lambda m, b: B.subgroup_matrix_store(b["out"], 0, 5, 32),
     "subgroup_matrix_store() needs a subgroup matrix value, got int"),
    (lambda m, b: Result("i8", 16, 16),
     "subgroup_matrix_result component must be one of ('f32', 'f16', 'i32', 'u32'), got 'i8'"),
    (lambda m, b: Left(f32, 0, 8), "sizes must be positive ints, got 0, 8"),
    (lambda m, b: m.declare_input_buffer("x", Result(f32, 8, 8)),
     "subgroup_matrix_result<f32, 8, 8> cannot be an array element, a buffer element or "
     "workgroup memory: a subgroup matrix lives in a let or var"),
    (lambda m, b: m.shared(L8, 2), "cannot be an array element"),
    (lambda m, b: m.declare_uniform("u", L8), "a uniform must be a numeric scalar or vector"),
])
def test_bad_arguments_are_refused(body, message):
    _refuses(body, message)


def product(m, n=16, comp="f16", result="f32"):
    """C = A @ A for one n x n x n product of ``comp`` into ``result``."""
    A = m.declare_input_buffer("A", sd.f16, n * n)
    C = m.declare_output_buffer("C", getattr(sd, result), n * n)
    a = m.let(B.subgroup_matrix_load(Left(comp, n, n), A, 0, n), "a")
    b = m.let(B.subgroup_matrix_load(Right(comp, n, n), A, 0, n), "b")
    B.subgroup_matrix_store(C, 0, B.subgroup_matrix_multiply(result, a, b), n)


def _refused_by(device, kernel, n, exc, message, a_dtype: type = np.float16):
    """``device`` refuses ``kernel`` before it runs (nothing recorded, the output as it was)."""
    a = device.buffer(np.ones(n * n, a_dtype))
    c = device.buffer(np.full(n * n, 7, np.float32))
    with pytest.raises(exc) as info:
        device.dispatch(kernel, {"A": a, "C": c}, 1)
    assert message in str(info.value), str(info.value)
    assert device.stats["dispatches"] == 0 and (device.read(c) == 7).all()
    return str(info.value)


H200_LIST = ("f16->f16 16x16x16, f16->f32 16x16x16, f16->f16 16x8x16, f16->f32 16x8x16, "
             "f16->f16 16x8x8, f16->f32 16x8x8, i8->i32 16x16x32, u8->u32 16x16x32, "
             "i8->i32 16x8x32, u8->u32 16x8x32 (component->result MxNxK, on subgroups of 32)")


@pytest.mark.parametrize("n", [8, 32])
def test_the_interpreter_device_refuses_shapes_the_h200_lacks(n):
    """As Dawn on the H200 would: the product's shape named, the shapes there are listed."""
    msg = _refused_by(InterpDevice(), sd.compile(product, 32, n=n), n, FeatureError,
                      f"kernel 'product' uses the product f16->f32 {n}x{n}x{n} (component->result "
                      f"MxNxK) (first at ")
    assert msg.endswith(f"a shape device 'shaderdsl interpreter' does not offer; its "
                        f"subgroup-matrix configurations: {H200_LIST}"), msg


def test_a_matrix_type_of_a_shape_the_device_lacks_is_refused_without_a_product():
    def copy(m):
        A = m.declare_input_buffer("A", f32, 64)
        C = m.declare_output_buffer("C", f32, 64)
        B.subgroup_matrix_store(C, 0, B.subgroup_matrix_load(Result(f32, 8, 8), A, 0, 8), 8)
    msg = _refused_by(InterpDevice(), sd.compile(copy, 32), 8, FeatureError,
                      "uses subgroup_matrix_result<f32, 8, 8> (MxN 8x8)", np.float32)
    assert H200_LIST in msg


def test_a_workgroup_of_part_of_a_subgroup_is_refused():
    """Dawn needs workgroup_size.x a multiple of the largest subgroup size (32 on the H200)."""
    for threads in (16, 48, (16, 2)):
        _refused_by(InterpDevice(), sd.compile(product, threads), 16, DispatchError,
                    "uses subgroup matrices, so its x size must be a multiple of the largest "
                    "subgroup size (32) on 'shaderdsl interpreter'")


def test_fragments_on_subgroups_the_configs_do_not_list_are_refused():
    """The H200's shapes run on subgroups of 32: a device of subgroups of 8 keeps
    them (``matrix_configs``, named in the message) but offers kernels none."""
    eights = InterpDevice(subgroup_size=8)
    assert eights.matrix_configs == H200_MATRIX_CONFIGS and eights.subgroup_matrix_configs == ()
    _refused_by(InterpDevice(subgroup_size=8), sd.compile(product, 32), 16, FeatureError,
                "uses the product f16->f32 16x16x16 (component->result MxNxK) (first at ")
    _refused_by(InterpDevice(subgroup_size=64), sd.compile(product, 64), 16, FeatureError,
                "which device 'shaderdsl interpreter' offers on subgroups of 32 only, not on "
                "its subgroups of 64")


def test_the_shapes_a_device_lists_run():
    """The listed shapes run (64 threads: two subgroups, a multiple of 32); a device
    given other configurations runs those, and the same check refuses for a GPU
    device that lists its shapes (as the wgpu runtime's does under Dawn)."""
    a = np.arange(256).astype(np.float16) / 64
    for threads, device in ((32, InterpDevice()), (64, InterpDevice(subgroup_size=32))):
        out = device.buffer(np.zeros(256, np.float32))
        device.dispatch(sd.compile(product, threads), {"A": device.buffer(a), "C": out}, 1)
        a64 = a.astype(np.float64).reshape(16, 16)
        assert np.array_equal(device.read(out).reshape(16, 16), (a64 @ a64).astype(np.float32))
    eights = InterpDevice(subgroup_size=8, subgroup_matrix_configs=[
        MatrixConfig("f16", "f32", 8, 8, 8, (8, 8))])
    out = eights.buffer(np.zeros(64, np.float32))
    eights.dispatch(sd.compile(product, 8, n=8), {"A": eights.buffer(a[:64]), "C": out}, 1)
    gpu = SimpleNamespace(name="NVIDIA H200", backend="Vulkan", limits={},
                          features=frozenset({FEATURE, "shader-f16"}),
                          subgroup_matrix_configs=H200_MATRIX_CONFIGS)
    with pytest.raises(FeatureError, match="the product f16->f32 8x8x8 .* does not offer"):
        check_kernel(sd.compile(product, 32, n=8), gpu)
    with pytest.raises(DispatchError, match=r"multiple of the largest subgroup size \(32\)"):
        check_kernel(sd.compile(product, 16), gpu)
    check_kernel(sd.compile(product, 32), gpu)


def _uneven(m, offset_of_lane, length=64):
    A = m.declare_input_buffer("A", f32, length)
    C = m.declare_output_buffer("C", f32, 64)
    a = m.let(B.subgroup_matrix_load(Left(f32, 8, 8), A, offset_of_lane(m.local_index()), 8))
    B.subgroup_matrix_store(C, 0, a, 8)


def test_non_uniform_or_out_of_bounds_arguments_raise_in_the_interpreter():
    data = {"A": np.arange(64, dtype=np.float32), "C": np.zeros(64, np.float32)}
    with pytest.raises(InterpreterError, match="same arguments in every lane of the subgroup: "
                                               "argument 2 of lane 1 differs from lane 0"):
        Interpreter(_uneven, SUBGROUP, offset_of_lane=lambda i: i % 2).dispatch(data, 1)
    with pytest.raises(OutOfBoundsError, match=r"at offset 1, stride 8 \(elements of the array\) "
                                               r"reaches element 64 of an array of 64"):
        Interpreter(_uneven, SUBGROUP, offset_of_lane=lambda i: 1).dispatch(data, 1)
    out = Interpreter(_uneven, SUBGROUP, offset_of_lane=lambda i: 0).dispatch(data, 1)
    assert np.array_equal(out["C"], data["A"])


# ================================================================ units: elements of the array

def _load_store(m, comp, rows, cols, offset, stride, col_major):
    """One matrix loaded at (offset, stride) and stored whole, row-major, at 0."""
    stored = {"i8": i32, "u8": sd.u32, "f16": sd.f16, "f32": f32}[comp]
    A = m.declare_input_buffer("A", stored)
    C = m.declare_output_buffer("C", stored)
    load = B.subgroup_matrix_load_col_major if col_major else B.subgroup_matrix_load
    a = m.let(load(Left(comp, cols, rows), A, offset, stride), "a")
    pack = 4 if comp in ("i8", "u8") else 1
    B.subgroup_matrix_store(C, 0, a, cols // pack)


@pytest.mark.parametrize("comp", ["i8", "u8", "f16", "f32"])
@pytest.mark.parametrize("col_major", [False, True])
def test_offsets_and_strides_count_array_elements(comp, col_major):
    """Offset 3 and stride 20 are array elements: for 8-bit values, u32 words,
    so element (r, c) is byte 4 * (3 + r * 20) + c (row-major) or
    4 * (3 + c * 20) + r (column-major); for f16 and f32, components."""
    pack = 4 if comp in ("i8", "u8") else 1
    rows, cols, offset, stride = 16, 32, 3, 20 if pack == 4 else 40
    if col_major:
        rows, cols, stride = 32, 16, 20 if pack == 4 else 40
    dt = NUMPY[comp]
    flat = np.arange(4096, dtype=np.int64).astype(dt) if pack == 1 else \
        np.random.default_rng(1).integers(0, 255, 4096).astype(dt)
    words = flat.view(np.int32 if comp == "i8" else np.uint32) if pack == 4 else flat
    out = Interpreter(_load_store, SUBGROUP, comp=comp, rows=rows, cols=cols, offset=offset,
                      stride=stride, col_major=col_major).dispatch(
        {"A": words, "C": np.zeros(rows * cols // pack, words.dtype)}, 1)["C"]
    got = out.view(dt).reshape(rows, cols) if pack == 4 else out.reshape(rows, cols)
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    start = pack * (offset + (c if col_major else r) * stride)
    assert np.array_equal(got, flat[start + (r if col_major else c)])


def _f16_into_f32(m):
    A = m.declare_input_buffer("A", sd.f16)
    Bm = m.declare_input_buffer("B", sd.f16)
    C = m.declare_output_buffer("C", f32)
    acc = m.var(Result(f32, 16, 16), name="acc")
    with m.loop(2, name="k") as k:
        a = m.let(B.subgroup_matrix_load(Left(sd.f16, 16, 16), A, k * 16, 32), "a")
        b = m.let(B.subgroup_matrix_load(Right(sd.f16, 16, 16), Bm, k * 256, 16), "b")
        m.assign(acc, B.subgroup_matrix_multiply_accumulate(a, b, acc))
    B.subgroup_matrix_store(C, 0, acc, 16)


def test_f16_products_accumulate_into_f32():
    """The f16 x f16 -> f32 configuration (the H200 offers 16x16x16), two K
    steps: each step's float64 product rounded once to f32 and added."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((16, 32)).astype(np.float16)
    b = rng.standard_normal((32, 16)).astype(np.float16)
    out = Interpreter(_f16_into_f32, SUBGROUP).dispatch(
        {"A": a.reshape(-1), "B": b.reshape(-1), "C": np.zeros(256, np.float32)}, 1)["C"]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (a64[:, :16] @ b64[:16]).astype(np.float32)
    want = (want.astype(np.float64) + a64[:, 16:] @ b64[16:]).astype(np.float32)
    assert out.dtype == np.float32 and np.array_equal(out.reshape(16, 16), want)
