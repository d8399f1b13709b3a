"""The forward on matrix units (subgroup matrices): f16 storage, f32 sums.

Two dispatches, each a :func:`shaderdsl.matmul.tiled_product`:

* ``project_a_matrix``: hp = x A^T over ``splits`` slices of in_dim
  (workgroup z is the slice), [splits * tokens, rank] f32;
* ``b_add_matrix``: output += scale * h B^T, with h the slices summed (and,
  with ``save_h``, written out by the workgroups of column block 0), rounded
  to f16 as it is staged, like PyTorch's fp16 h.

Fragments are f16 16x16x16 with f32 results (the H200's; the strategy offers
itself only where the adapter has them); the subgroup size is theirs (32).
"""
from __future__ import annotations

from shaderdsl import vec4f, vec4h
from shaderdsl.matmul import MatrixTiling, Operand, tiled_product
from shaderdsl.types import MatrixConfig

from .common import token_count, token_rows

FRAGMENT = MatrixConfig("f16", "f32", 16, 16, 16)


def _check(what: str, **dims) -> None:
    bad = {k: v for k, v in dims.items() if v % 4}
    if bad:
        raise ValueError(f"{what} reads four elements at a time: {bad} must be multiples of 4")


def a_tiling(rank: int, fragments: int, depth: int = 32) -> MatrixTiling:
    """project_a_matrix's tiling: 2 x ``fragments`` fragments of tokens per
    workgroup, the rank's columns (padded to 16) over one or two subgroups,
    ``depth`` columns of x per staged slice."""
    cols = -(-rank // FRAGMENT.n)
    across = 2 if cols % 2 == 0 else 1
    return MatrixTiling(FRAGMENT, (2, across), (fragments, cols // across), k_step=depth)


def b_tiling(rank: int, rows: int, cols: int) -> MatrixTiling:
    """b_add_matrix's tiling: 2 x 2 subgroups of ``rows`` x ``cols`` fragments,
    the rank (its K) in steps of at most 32."""
    return MatrixTiling(FRAGMENT, (2, 2), (rows, cols), k_step=min(32, -(-rank // 16) * 16))


def project_a_matrix(m, rank, in_dim, tokens, splits=1, fragments=2, depth=32):
    """hp[s * tokens + t, r] = sum over slice s of in_dim of x[t, i] A[r, i]."""
    _check("project_a_matrix", rank=rank, in_dim=in_dim, slice=in_dim // splits)
    if in_dim % splits:
        raise ValueError(f"project_a_matrix: splits ({splits}) must divide in_dim ({in_dim})")
    tiling, part = a_tiling(rank, fragments, depth), in_dim // splits
    A = m.declare_input_buffer("A", vec4h, rank * in_dim // 4)
    x = m.declare_input_buffer("x", vec4h, token_rows(tokens, in_dim // 4))
    hp = m.declare_output_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    n = token_count(m, tokens)
    first = m.let(m.workgroup_id().z * part, "first")

    def store(t, r, value):
        hp[((m.workgroup_id().z * n + t) * rank + r) / 4] = value

    tiled_product(m, tiling, Operand(lambda t, i: x[(t * in_dim + first + i) / 4]),
                  Operand(lambda i, r: A[(r * in_dim + first + i) / 4], axis=0),
                  n, rank, part, store)


def b_add_matrix(m, out_dim, rank, scale, tokens, splits=1, rows=2, cols=4, save_h=False):
    """output[t, o] += scale * sum_r h[t, r] B[o, r], h the sum of the slices."""
    _check("b_add_matrix", rank=rank, out_dim=out_dim)
    tiling = b_tiling(rank, rows, cols)
    hp = m.declare_input_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    Bm = m.declare_input_buffer("B", vec4h, out_dim * rank // 4)
    out = m.declare_output_buffer("output", vec4h, token_rows(tokens, out_dim // 4))
    n = token_count(m, tokens)

    def h_at(t, r):
        total = hp[(t * rank + r) / 4]
        for s in range(1, splits):
            total = total + hp[((s * n + t) * rank + r) / 4]
        return total

    if save_h:
        _save_h(m, tiling, h_at, rank, tokens, n)

    def add(t, o, value):
        at = m.let((t * out_dim + o) / 4, "at")
        out[at] = vec4h(vec4f(out[at]) + scale * value)

    tiled_product(m, tiling, Operand(h_at), Operand(lambda r, o: Bm[(o * rank + r) / 4], axis=0),
                  n, out_dim, rank, add)


def _save_h(m, tiling, h_at, rank, tokens, n) -> None:
    """h (the slices summed, f32) for this workgroup's tokens, by column block 0."""
    h = m.declare_output_buffer("h", vec4f, token_rows(tokens, rank // 4))
    quads = rank // 4
    with m.if_(m.workgroup_id().x == 0):
        t0 = m.let(m.workgroup_id().y * tiling.rows, "t0")
        with m.loop(m.local_index(), tiling.rows * quads, tiling.threads, name="j") as j:
            t = m.let(t0 + j / quads, "t")
            with m.if_(t < n):
                h[t * quads + j % quads] = h_at(t, j % quads * 4)
