"""An int8 matrix multiply on Dawn's subgroup matrices (one subgroup per tile).

What it shows:

* subgroup matrix types (``subgroup_matrix_left/right/result``) and their
  load, multiply-accumulate and store builtins, which a whole subgroup runs
  together; the kernel needs the adapter feature
  "chromium-experimental-subgroup-matrix" (Dawn, with unsafe APIs allowed, on
  GPUs with cooperative matrices), which the WGSL's ``enable`` line names;
* where no adapter has it, the interpreter device runs the same host code and
  emulates the subgroup operations exactly: ``run(interp.Device(subgroup_size=32), a, b)``.

* offsets and strides count elements of the array: with 8-bit values packed
  four to an i32/u32, words (the WGSL proposal after gpuweb PR #6275); so K,
  and the rows of a column-major matrix, are multiples of four.

Run ``python -m examples.subgroup_matmul`` (the GPU when it has the feature,
else the interpreter) to compare with numpy.
"""
from __future__ import annotations

import numpy as np

from shaderdsl import builtins as B
from shaderdsl import compile as compile_kernel
from shaderdsl import f16, f32, i32, u32
from shaderdsl import subgroup_matrix_left as Left
from shaderdsl import subgroup_matrix_result as Result
from shaderdsl import subgroup_matrix_right as Right

FEATURE = "chromium-experimental-subgroup-matrix"
SUBGROUP = 32
STORED = {"i8": i32, "u8": u32, "f32": f32, "f16": f16, "i32": i32, "u32": u32}
RESULT = {"i8": i32, "u8": u32, "f32": f32, "f16": f16}
NUMPY = {"i8": np.int8, "u8": np.uint8, "f32": np.float32, "f16": np.float16,
         "i32": np.int32, "u32": np.uint32}


def tiled_matmul(m, M, N, K, TM, TN, TK, comp="i8", layouts="rrr", accumulate=True):
    """``C = A @ B`` with one subgroup per TM x TN tile of C, K in steps of TK;
    ``layouts``: 'r' (row-major) or 'c' (column-major) for A, B and C."""
    A = m.declare_input_buffer("A", STORED[comp])
    Bm = m.declare_input_buffer("B", STORED[comp])
    C = m.declare_output_buffer("C", RESULT[comp])
    tiles_n = N // TN
    # Tint wants the matrix builtins' offsets provably uniform: a workgroup of one
    # subgroup takes its tile from workgroup_id alone. With several subgroups per
    # workgroup the tile depends on local_index, which Tint refuses (the
    # interpreter runs it: its uniformity check is per dispatch, not static).
    per = m.workgroup_size[0] // SUBGROUP
    tile = m.let(m.workgroup_id().x if per == 1 else
                 m.workgroup_id().x * per + m.local_index() / SUBGROUP, "tile")
    row0, col0 = m.let(tile / tiles_n * TM, "row0"), m.let(tile % tiles_n * TN, "col0")

    def at(layout, r, c, rows, cols, pack=1):  # (offset, stride) of element (r, c)
        """In elements of the array: 8-bit values are packed four to an element
        (``pack`` 4), so a row (or column) starts at a multiple of four."""
        offset, stride = (r * cols + c, cols) if layout == "r" else (c * rows + r, rows)
        return (offset / pack, stride // pack) if pack > 1 else (offset, stride)

    pack = 4 if comp in ("i8", "u8") else 1

    def load(mtype, buf, layout, r, c, rows, cols):
        fn = B.subgroup_matrix_load if layout == "r" else B.subgroup_matrix_load_col_major
        return fn(mtype, buf, *at(layout, r, c, rows, cols, pack))

    acc = m.var(Result(RESULT[comp], TN, TM), name="acc")
    with m.loop(K // TK, name="kt") as kt:
        a = m.let(load(Left(comp, TK, TM), A, layouts[0], row0, kt * TK, M, K), "a")
        b = m.let(load(Right(comp, TN, TK), Bm, layouts[1], kt * TK, col0, K, N), "b")
        if accumulate:
            m.assign(acc, B.subgroup_matrix_multiply_accumulate(a, b, acc))
        else:
            m.assign(acc, B.subgroup_matrix_multiply(RESULT[comp], a, b))
    store = B.subgroup_matrix_store if layouts[2] == "r" else B.subgroup_matrix_store_col_major
    offset, stride = at(layouts[2], row0, col0, M, N)
    store(C, offset, acc, stride)


def host(x: np.ndarray, layout: str, comp: str) -> np.ndarray:
    """A matrix as the kernel's buffer: row- or column-major, 8-bit values four
    to an i32/u32 element."""
    flat = np.ascontiguousarray(x if layout == "r" else x.T).reshape(-1)
    return flat.view(np.dtype(NUMPY[{"i8": "i32", "u8": "u32"}.get(comp, comp)])) \
        if comp in ("i8", "u8") else flat


def run(device, a, b, *, tm=16, tn=16, tk=32) -> np.ndarray:
    """``a @ b`` for int8 ``a`` [M, K] and ``b`` [K, N] (M, N, K multiples of the
    tile), summed in int32, on ``device`` (it needs the subgroup-matrix feature
    and subgroups of 32)."""
    (M, K), N = a.shape, b.shape[1]
    k = compile_kernel(tiled_matmul, SUBGROUP, M=M, N=N, K=K, TM=tm, TN=tn, TK=tk)
    bufs = {"A": device.buffer(host(a, "r", "i8")), "B": device.buffer(host(b, "r", "i8")),
            "C": device.empty(M * N, np.int32)}
    device.dispatch(k, bufs, (M // tm) * (N // tn))
    return device.read(bufs["C"]).reshape(M, N)


def main() -> None:
    from shaderdsl import interp
    from shaderdsl.runtime import get_device
    device = get_device()
    if not device.has_feature(FEATURE):
        print(f"{device.name} lacks {FEATURE}: running in the interpreter device")
        device = interp.Device(subgroup_size=SUBGROUP)
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (32, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    print("exact:", np.array_equal(run(device, a, b), a.astype(np.int64) @ b))


if __name__ == "__main__":
    main()
