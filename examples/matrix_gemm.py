"""An f16 matrix multiply on matrix units (Dawn's subgroup matrices), summed in f32.

What it shows: :func:`shaderdsl.matmul.gemm`, a whole kernel on the GEMM
engine :func:`shaderdsl.matmul.tiled_product` (read its last lines: the
two factors as ``Operand`` (their buffers and layouts) and an ``Epilogue``
that stores the f32 results), compiled for a ``MatrixTiling`` (subgroups
per workgroup, result fragments per subgroup, K per staged slice) and
checked against numpy. Sizes need not be multiples of a tile.

On the H200 under Dawn (2026-12-03, docs/benchmarks.md "Matrix units") the
LARGE tiling (4 x 2 subgroups of 2 x 4 fragments) ran 4096^3 at 156.7 TFLOP/s
with the ``disable_robustness`` toggle and 64.0 without, against 743-751 for
torch.mm fp16; the single-subgroup kernel this example used to be ran 2048^3
at 59.6.

Run ``python -m examples.matrix_gemm`` (the GPU when it has the feature,
else the interpreter device) to compare with numpy.
"""
from __future__ import annotations

import numpy as np

from shaderdsl import compile as compile_kernel
from shaderdsl.matmul import MatrixTiling, gemm
from shaderdsl.types import SUBGROUP_MATRIX_FEATURE, MatrixConfig

CONFIG = MatrixConfig("f16", "f32", 16, 16, 16)  # f16 x f16 -> f32, 16x16x16, subgroups of 32
SMALL = MatrixTiling(CONFIG)                      # 2 x 2 subgroups of 2 x 2 fragments: 64 x 64
LARGE = MatrixTiling(CONFIG, (4, 2), (2, 4), k_step=32)  # 128 x 128 (45 KiB of workgroup memory)


def run(device, a, b, tiling=SMALL) -> np.ndarray:
    """``a @ b`` for f16 ``a`` [M, K], ``b`` [K, N] (K and N multiples of 4),
    summed in f32, on ``device``."""
    if tiling.config not in device.subgroup_matrix_configs:
        raise ValueError(f"{device.name} has no {tiling.config} subgroup matrices")
    (M, K), N = a.shape, b.shape[1]
    k = compile_kernel(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling)
    bufs = {"A": device.buffer(np.ascontiguousarray(a, np.float16).reshape(-1)),
            "B": device.buffer(np.ascontiguousarray(b, np.float16).reshape(-1)),
            "C": device.empty(M * N, np.float32)}
    device.dispatch(k, bufs, tiling.grid(M, N))
    return device.read(bufs["C"]).reshape(M, N)


def main() -> None:
    from shaderdsl import interp
    from shaderdsl.runtime import get_device
    device = get_device()
    if not device.has_feature(SUBGROUP_MATRIX_FEATURE):
        print(f"{device.name} lacks {SUBGROUP_MATRIX_FEATURE}: running in the interpreter device")
        device = interp.Device(subgroup_size=CONFIG.subgroup_sizes[0])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((72, 48)).astype(np.float16)
    b = rng.standard_normal((48, 100)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = run(device, a, b)
    print("max relative error:", float(np.abs(got - want).max() / np.abs(want).max()))


if __name__ == "__main__":
    main()
