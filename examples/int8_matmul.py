"""8-bit integer matrix multiply ``C = A @ B`` with packed dot products.

``A`` is int8 ``[M, K]`` and ``B`` int8 ``[K, N]``, both stored row-major
four bytes to a u32 (byte i of a word is bits 8i..8i+7, as WGSL's
``pack4xI8`` puts them: the memory layout of an int8 array read as
little-endian u32). ``C`` is i32 ``[M, N]``, summed exactly: numpy's int64
product, as long as ``K * 128 * 128 < 2**31`` (K below 131072), past which
i32 wraps. With ``signed=False`` the same kernel multiplies uint8 matrices
into u32 (exact while ``K * 255 * 255 < 2**32``).

What it shows:

* ``B.dot4_i8_packed(a, b)`` (WGSL ``dot4I8Packed``): four int8 products
  summed in one call, from two u32 words;
* a 4 x 4 byte transpose with ``unpack4x_i8``/``pack4x_i8``: a word of A
  holds four consecutive k of one row, a word of B four consecutive columns
  of one k, so each invocation reads four words of B (k .. k+3, columns
  4j .. 4j+3), unpacks them, and packs column q's four bytes into one word;
* these builtins are a WGSL language extension
  (``packed_4x8_integer_dot_product``), not an adapter feature: the kernel
  needs none (``kernel.features`` is empty) and runs on every adapter whose
  compiler knows them (naga in wgpu-native 0.32, Tint).

Each invocation computes four columns of one row of C; the grid's x covers
the column words (``ceil(N / 4)``), y the rows. Print the WGSL with

    python -m shaderdsl wgsl examples.int8_matmul:int8_matmul M=5 K=10 N=7 --workgroup-size 8,8
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import i32, u32, vec4i, vec4u

TILE = 8


def _ops(signed: bool):
    """(accumulator scalar, vec4 type, dot, unpack, pack) for int8 or uint8."""
    if signed:
        return i32, vec4i, B.dot4_i8_packed, B.unpack4x_i8, B.pack4x_i8
    return u32, vec4u, B.dot4_u8_packed, B.unpack4x_u8, B.pack4x_u8


def int8_matmul(m, M: int, K: int, N: int, signed: bool = True):
    """``C[r, c] = sum_k A[r, k] * B[k, c]`` over packed 8-bit A and B."""
    scalar, vec, dot, unpack, pack = _ops(signed)
    K4, N4 = -(-K // 4), -(-N // 4)                     # words per row of A and of B
    A = m.declare_input_buffer("A", u32, M * K4)        # A[r*K4 + k4] = A[r, 4k4 .. 4k4+3]
    Bw = m.declare_input_buffer("B", u32, 4 * K4 * N4)  # B[k*N4 + j] = B[k, 4j .. 4j+3]
    C = m.declare_output_buffer("C", scalar, M * N)

    j = m.let(m.global_id().x, "j")                     # column word: columns 4j .. 4j+3
    r = m.let(m.global_id().y, "r")
    with m.if_((r < M) & (j < N4)):
        acc = m.var(vec, vec(0), "acc")
        with m.loop(K4, name="k4") as k4:
            a = m.let(A[r * K4 + k4], "a")
            rows = [m.let(unpack(Bw[(k4 * 4 + t) * N4 + j]), f"b{t}") for t in range(4)]
            # column q of the 4 x 4 block: byte q of each row word, packed again
            cols = [m.let(pack(vec(*(getattr(b, lane) for b in rows))), f"c{q}")
                    for q, lane in enumerate("xyzw")]
            acc += vec(*(dot(a, c) for c in cols))
        for q, lane in enumerate("xyzw"):
            if q == 0 or N % 4 == 0:                    # column 4j exists: j < N4
                C[r * N + j * 4 + q] = getattr(acc, lane)
            else:
                with m.if_(j * 4 + q < N):
                    C[r * N + j * 4 + q] = getattr(acc, lane)


def pack_rows(x: np.ndarray, rows: int | None = None) -> np.ndarray:
    """An 8-bit matrix as u32 words, four consecutive columns to a word (byte i
    = column 4w + i), zero-padded to a multiple of four columns and to ``rows``."""
    x = np.asarray(x)
    if x.dtype not in (np.int8, np.uint8) or x.ndim != 2:
        raise ValueError(f"expected a 2-D int8 or uint8 array, got {x.dtype} {x.shape}")
    n_rows: int = x.shape[0] if rows is None else rows
    padded = np.zeros((n_rows, -(-x.shape[1] // 4) * 4), np.uint32)
    padded[:x.shape[0], :x.shape[1]] = x.astype(np.int64) & 0xFF
    b = padded.reshape(n_rows, -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def inputs(a, b) -> dict:
    """The host arrays the kernel binds, from 8-bit ``a [M, K]`` and ``b [K, N]``."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"cannot multiply {a.dtype} {a.shape} by {b.dtype} {b.shape}")
    K4 = -(-a.shape[1] // 4)
    return {"A": pack_rows(a), "B": pack_rows(b, rows=4 * K4)}


def workgroups(M: int, N: int, tile: int = TILE) -> tuple[int, int]:
    """The grid: x over the ceil(N / 4) column words, y over the M rows."""
    return -(-(-(-N // 4)) // tile), -(-M // tile)


def run(device, a, b, *, tile: int = TILE) -> np.ndarray:
    """``a @ b`` for int8 (-> int32) or uint8 (-> uint32) matrices on ``device``."""
    arrays = inputs(a, b)
    (M, K), N = a.shape, b.shape[1]
    signed = a.dtype == np.int8
    kernel = sd.compile(int8_matmul, (tile, tile), M=M, K=K, N=N, signed=signed)
    out = device.buffer(np.zeros((M, N), np.int32 if signed else np.uint32))
    bufs = {name: device.buffer(arr) for name, arr in arrays.items()}
    device.dispatch(kernel, {**bufs, "C": out}, workgroups(M, N, tile))
    return device.read(out)


def main() -> None:
    from shaderdsl.runtime import get_device

    device = get_device()
    print(f"device: {device!r}\n")
    M, K, N = 37, 301, 45                                # none a multiple of 4 or of TILE
    print(sd.compile(int8_matmul, (TILE, TILE), M=M, K=K, N=N).wgsl)
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (K, N), dtype=np.int8)
    got = run(device, a, b)
    want = a.astype(np.int64) @ b.astype(np.int64)
    print(f"int8 {M}x{K} @ {K}x{N}: exact = {bool(np.array_equal(got, want))}, "
          f"max |C| = {np.abs(want).max()}")


if __name__ == "__main__":
    main()
