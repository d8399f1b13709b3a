"""The LoRA forward in separate dispatches: h = A @ x, y = B @ h, the scaled
add, and B @ h fused with the add (the seed, three and split strategies).

Shapes (row-major): A [rank, in_dim], B [out_dim, rank], x [tokens, in_dim],
h [tokens, rank], y and output [tokens, out_dim]. The scratch buffers h and
y are always f32 (see ``common`` for dtypes).

``tokens=None`` (every kernel that takes ``tokens``; add_scaled with
``num_elements=None``) reads the token count at run time from the u32
uniform ``tokens``: the token-sized buffers are runtime-sized, rows past the
count are guarded, and the grid axis that counts tokens may be split over z
(``common.split_index``), so one pipeline serves every token count. The
one-dispatch forms are in ``fused``, ``tiled``, ``gemm`` and ``matrix``.
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32

from .common import (
    b_row_dot,
    input_matrix,
    load_h,
    output_buffer,
    partial_dots,
    reduce_sum,
    split_index,
    storage_scalar,
    store_output,
    token_count,
    token_rows,
    widen,
    workgroup_token,
)


def project_a_seed(m, rank, in_dim, tokens=1, dtype="f32"):
    """Hesper's design: one thread per h element, a serial loop over in_dim."""
    A = m.declare_input_buffer("A", storage_scalar(dtype), rank * in_dim)
    x = m.declare_input_buffer("x", storage_scalar(dtype), token_rows(tokens, in_dim))
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank))
    gid = m.global_id()
    if tokens is None:  # grid (ceil(rank / 64), T) with T possibly split over z
        n = token_count(m, tokens)
        r, t = gid.x, split_index(m, "y", "t")
        inside = (r < rank) & (t < n)
    else:
        r, t = gid.x, gid.y
        inside = r < rank
    with m.if_(inside):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(in_dim, name="k") as k:
            acc += widen(A[r * in_dim + k]) * widen(x[t * in_dim + k])
        h[t * rank + r] = acc


def project_a_workgroup(m, rank, in_dim, tokens=1, threads=256, subgroups=False, dtype="f32",
                        rank_group=0):
    """h = A @ x with one workgroup per token (grid (tokens, 1)): every thread
    takes a strided slice of in_dim for all ranks, then the workgroup reduces.

    With ``rank_group`` (0 < rank_group < rank) workgroup (t, g) does ranks
    g * rank_group onwards only (grid (tokens, ceil(rank / rank_group))):
    more workgroups share the rows of A when the rank is high and tokens few.
    """
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank))
    t = workgroup_token(m, tokens, "x")
    if 0 < rank_group < rank:
        # rows r0 .. r0 + rank_group - 1; the last group reads row rank - 1 in
        # place of rows past the end and does not store them
        r0 = m.let(m.workgroup_id().y * rank_group, "r0")
        rows = [m.let(B.min(r0 + q, rank - 1) * in_n, f"row{q}") for q in range(rank_group)]
        accs = partial_dots(m, A, x, rank_group, in_n, t, m.local_index(), threads, rows=rows)
        hs = reduce_sum(m, accs, threads, subgroups)
        with m.if_(m.local_index() == 0):
            for q in range(rank_group):
                if (rank % rank_group) and q >= rank % rank_group:
                    with m.if_(r0 + q < rank):
                        h[t * rank + r0 + q] = hs[q]
                else:
                    h[t * rank + r0 + q] = hs[q]
        return
    accs = partial_dots(m, A, x, rank, in_n, t, m.local_index(), threads)
    hs = reduce_sum(m, accs, threads, subgroups)
    with m.if_(m.local_index() == 0):
        for r in range(rank):
            h[t * rank + r] = hs[r]


def project_b(m, out_dim, rank, tokens=1, threads=256, dtype="f32"):
    """y = B @ h: one thread per output element, h in workgroup memory (y is f32)."""
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, token_rows(tokens, rank))
    y = m.declare_output_buffer("y", f32, token_rows(tokens, out_dim))
    t = workgroup_token(m, tokens, "y")
    hs = load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        y[t * out_dim + i] = b_row_dot(m, Bm, i, rank, hs)


def add_scaled(m, num_elements, scale, dtype="f32", columns=1, y_dtype="f32"):
    """output[i] += scale * y[i] (y stored as ``y_dtype``, output as ``dtype``,
    the sum in f32). ``num_elements`` None: the first ``tokens * columns``
    elements, ``tokens`` read at run time (the grid's x may then be split over
    z). The causal LM's residual add h += y is dtype "f32" (the residual
    stream) with y_dtype its layer's storage type."""
    y = m.declare_input_buffer("y", storage_scalar(y_dtype), num_elements)
    out = output_buffer(m, num_elements, dtype)
    if num_elements is None:
        n = m.let(token_count(m, None) * columns, "n")
        wid = m.workgroup_id()
        i = m.let(m.global_id().x + wid.z * m.num_workgroups().x * m.workgroup_size[0], "i")
    else:
        n = num_elements
        i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        if dtype == "f32":
            out[i] += scale * widen(y[i])
        else:
            store_output(out, i, widen(out[i]) + scale * widen(y[i]))


def fused_b_add(m, out_dim, rank, scale, tokens=1, threads=256, dtype="f32"):
    """output[i] += scale * sum_r B[i, r] * h[r]: project_b and add_scaled in one."""
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, token_rows(tokens, rank))
    out = output_buffer(m, token_rows(tokens, out_dim), dtype)
    t = workgroup_token(m, tokens, "y")
    hs = load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        if dtype == "f32":
            out[t * out_dim + i] += scale * b_row_dot(m, Bm, i, rank, hs)
        else:
            j = m.let(t * out_dim + i, "j")
            store_output(out, j, widen(out[j]) + scale * b_row_dot(m, Bm, i, rank, hs))
