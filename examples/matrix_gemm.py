"""An f16 matrix multiply on matrix units (Dawn's subgroup matrices), summed in f32.

What it shows:

* a subgroup's register blocking: each workgroup is one subgroup (Tint wants
  the matrix builtins' offsets uniform in the workgroup, so a tile cannot
  come from ``local_index``) and owns ``BM x BN`` result tiles of 16 x 16,
  loading BM left and BN right fragments per step of K and reusing each
  across the row or column: on the H200 a 2 x 8 block ran 2048^3 at 59.6
  TFLOP/s against 19.1 for one tile per subgroup (docs/optimisation-notes.md);
* picking the shape from the device's ``subgroup_matrix_configs``
  (f16 x f16 -> f32, 16x16x16);
* the grid over two axes, so that 4096^3 (65,536 blocks of one tile) stays
  within max-compute-workgroups-per-dimension.

Run ``python -m examples.matrix_gemm`` (the GPU when it has the feature,
else the interpreter device) to compare with numpy.
"""
from __future__ import annotations

import numpy as np

from shaderdsl import builtins as B
from shaderdsl import compile as compile_kernel
from shaderdsl import f16, f32
from shaderdsl.types import SUBGROUP_MATRIX_FEATURE, MatrixConfig, matrix_config

SUBGROUP = 32
TILE = 16
CONFIG = MatrixConfig("f16", "f32", TILE, TILE, TILE)  # f16 x f16 -> f32, 16x16x16


def gemm_f16(m, M, N, K, BM=2, BN=8):
    """``C = A @ B``: A [M, K] and B [K, N] f16, row-major; C [M, N] f32. Each
    workgroup (one subgroup) computes (16 BM) x (16 BN) of C; workgroup (x, y)
    is column block x, row block y."""
    A = m.declare_input_buffer("A", f16)
    Bm = m.declare_input_buffer("B", f16)
    C = m.declare_output_buffer("C", f32)
    left, right, result = CONFIG.types()
    wg = m.workgroup_id()
    row0 = m.let(wg.y * (TILE * BM), "row0")
    col0 = m.let(wg.x * (TILE * BN), "col0")
    acc = [[m.var(result, name=f"c{i}_{j}") for j in range(BN)] for i in range(BM)]
    with m.loop(K // TILE, name="kt") as kt:
        k0 = m.let(kt * TILE, "k0")
        a = [m.let(B.subgroup_matrix_load(left, A, (row0 + TILE * i) * K + k0, K), f"a{i}")
             for i in range(BM)]
        b = [m.let(B.subgroup_matrix_load(right, Bm, k0 * N + col0 + TILE * j, N), f"b{j}")
             for j in range(BN)]
        for i in range(BM):
            for j in range(BN):
                m.assign(acc[i][j], B.subgroup_matrix_multiply_accumulate(a[i], b[j], acc[i][j]))
    for i in range(BM):
        for j in range(BN):
            B.subgroup_matrix_store(C, (row0 + TILE * i) * N + col0 + TILE * j, acc[i][j], N)


def run(device, a, b, bm=2, bn=8) -> np.ndarray:
    """``a @ b`` for f16 ``a`` [M, K], ``b`` [K, N] (M a multiple of 16 bm, N of
    16 bn, K of 16), summed in f32, on ``device``."""
    cfg = matrix_config(device.subgroup_matrix_configs, "f16", "f32", TILE, TILE)
    if cfg is None or cfg.k != TILE:
        raise ValueError(f"{device.name} has no f16 x f16 -> f32 16x16x16 subgroup matrices")
    (M, K), N = a.shape, b.shape[1]
    k = compile_kernel(gemm_f16, SUBGROUP, M=M, N=N, K=K, BM=bm, BN=bn)
    bufs = {"A": device.buffer(np.ascontiguousarray(a, np.float16).reshape(-1)),
            "B": device.buffer(np.ascontiguousarray(b, np.float16).reshape(-1)),
            "C": device.empty(M * N, np.float32)}
    device.dispatch(k, bufs, (N // (TILE * bn), M // (TILE * bm), 1))
    return device.read(bufs["C"]).reshape(M, N)


def main() -> None:
    from shaderdsl import interp
    from shaderdsl.runtime import get_device
    device = get_device()
    if not device.has_feature(SUBGROUP_MATRIX_FEATURE):
        print(f"{device.name} lacks {SUBGROUP_MATRIX_FEATURE}: running in the interpreter device")
        device = interp.Device(subgroup_size=SUBGROUP)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 48)).astype(np.float16)
    b = rng.standard_normal((48, 128)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = run(device, a, b)
    print("max relative error:", float(np.abs(got - want).max() / np.abs(want).max()))


if __name__ == "__main__":
    main()
