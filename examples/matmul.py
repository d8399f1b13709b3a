"""Tiled matrix multiply ``C = A @ B`` with ``A: M x K``, ``B: K x N`` (row-major f32).

What it shows:

* a 2-D workgroup (``workgroup_size=(TILE, TILE)``) and a 2-D grid: each
  workgroup computes one TILE x TILE block of C, invocation (x, y) of it the
  element at column ``x`` and row ``y`` of that block;
* shared tiles: the workgroup copies a TILE x TILE tile of A and one of B
  into workgroup memory, waits (``m.barrier()``), and every invocation reads
  its row and column TILE times from there instead of from the buffers;
* bounds guards that keep the barriers in uniform control flow: a load
  outside A or B stores 0 into the tile instead of skipping the store, and
  only the final write to C is skipped;
* sizes as Python parameters: M, K and N become WGSL literals, and the buffer
  declarations carry exact lengths (``array<f32, M*K>``), which the runtime
  checks against the buffers you bind.

The tile size is the workgroup size given to ``sd.compile``; print the WGSL with

    python -m shaderdsl wgsl examples.matmul:matmul M=100 K=50 N=70 --workgroup-size 8,8
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import f32

TILE = 8


def matmul(m, M: int, K: int, N: int):
    """``C[r, c] = sum_k A[r, k] * B[k, c]``; needs a square 2-D workgroup (TILE, TILE)."""
    tile, tile_y, tile_z = m.workgroup_size
    if tile != tile_y or tile_z != 1:
        raise ValueError(f"matmul needs a square 2-D workgroup such as (8, 8), got "
                         f"{m.workgroup_size}; pass workgroup_size=(T, T) / --workgroup-size T,T")
    A = m.declare_input_buffer("A", f32, M * K)
    B = m.declare_input_buffer("B", f32, K * N)
    C = m.declare_output_buffer("C", f32, M * N)
    a_tile = m.shared(f32, tile * tile, "a_tile")   # a_tile[ty * tile + tx] = A[row, t*tile + tx]
    b_tile = m.shared(f32, tile * tile, "b_tile")   # b_tile[ty * tile + tx] = B[t*tile + ty, col]

    local, group = m.local_id(), m.workgroup_id()
    tx = m.let(local.x, "tx")
    ty = m.let(local.y, "ty")
    row = m.let(group.y * tile + ty, "row")         # of A and C
    col = m.let(group.x * tile + tx, "col")         # of B and C
    acc = m.var(f32, 0.0, "acc")

    with m.loop(-(-K // tile), name="t") as t:      # ceil(K / tile) tiles along K
        m.comment("stage one tile of A and one of B; 0 outside the matrices")
        a_col = m.let(t * tile + tx, "a_col")
        with m.if_((row < M) & (a_col < K)):
            a_tile[ty * tile + tx] = A[row * K + a_col]
        with m.else_():
            a_tile[ty * tile + tx] = 0.0
        b_row = m.let(t * tile + ty, "b_row")
        with m.if_((b_row < K) & (col < N)):
            b_tile[ty * tile + tx] = B[b_row * N + col]
        with m.else_():
            b_tile[ty * tile + tx] = 0.0
        m.barrier()                                  # tiles complete before anyone reads them

        with m.loop(tile, name="k") as k:
            acc += a_tile[ty * tile + k] * b_tile[k * tile + tx]
        m.barrier()                                  # everyone done before the next tile overwrites

    with m.if_((row < M) & (col < N)):
        C[row * N + col] = acc


def run(device, a, b, *, tile: int = TILE) -> np.ndarray:
    """``a @ b`` in float32 on ``device``."""
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {a.shape} by {b.shape}")
    (M, K), N = a.shape, b.shape[1]
    kernel = sd.compile(matmul, (tile, tile), M=M, K=K, N=N)
    c = device.buffer(np.full((M, N), np.nan, np.float32))  # NaN: unwritten elements show
    # x covers the columns of C, y its rows
    device.dispatch(kernel, {"A": device.buffer(a), "B": device.buffer(b), "C": c},
                    (-(-N // tile), -(-M // tile)))
    return device.read(c)


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    M, K, N = 100, 50, 70  # none a multiple of TILE
    print(sd.compile(matmul, (TILE, TILE), M=M, K=K, N=N).wgsl)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    got = run(device, a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    print(f"{M}x{K} @ {K}x{N}: max |error| = {np.abs(got - want).max():.3g}, "
          f"max |error| / (|A| @ |B|) = {(np.abs(got - want) / scale).max():.3g}")


if __name__ == "__main__":
    main()
