"""The whole LoRA forward in one dispatch, one token per workgroup row (the
single strategy): h recomputed by every workgroup of the token."""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32

from .common import (
    b_row,
    input_matrix,
    output_buffer,
    partial_dots,
    reduce_sum,
    row_dot,
    storage_scalar,
    store_output,
    token_rows,
    widen,
    workgroup_token,
)


def fused_forward(m, rank, in_dim, out_dim, scale, tokens=1, threads=256,
                  outputs_per_thread=1, subgroups=False, unroll=True, dtype="f32", save_h=False,
                  from_base=False):
    """The whole LoRA delta in one dispatch.

    Workgroup (i, t) recomputes h = A @ x[t] (A stays in L2), then adds
    scale * B @ h to its slice of threads * outputs_per_thread outputs of
    token t. WebGPU has no sync between workgroups; recomputing h is cheaper
    than a second dispatch. The B rows and output values this thread will
    need are loaded first, so their latency overlaps the work on h. With
    ``save_h`` the workgroups of column 0 also write h (f32) for the backward.
    With ``from_base`` it adds to ``base`` and writes the sum to the output
    (a training step's base output, without a copy into the output first).
    """
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    out = output_buffer(m, token_rows(tokens, out_dim), dtype)
    old_values = m.declare_input_buffer("base", storage_scalar(dtype), token_rows(
        tokens, out_dim)) if from_base else out
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank)) if save_h else None
    wid = m.workgroup_id()
    t = workgroup_token(m, tokens, "y")
    tid = m.local_index()
    base = m.let(wid.x * (threads * outputs_per_thread) + tid, "base")
    mine = []
    for k in range(outputs_per_thread):
        i = m.let(base + k * threads, f"col{k}")
        safe = m.let(B.min(i, out_dim - 1), f"safe{k}")  # in-bounds prefetch
        mine.append((i, b_row(m, Bm, safe, rank),
                     m.let(widen(old_values[t * out_dim + safe]), f"o{k}")))
    accs = partial_dots(m, A, x, rank, in_n, t, tid, threads, unroll)
    hs = reduce_sum(m, accs, threads, subgroups)
    for i, row, old in mine:
        with m.if_(i < out_dim):
            store_output(out, t * out_dim + i, old + scale * row_dot(row, hs))
    if h is not None:
        with m.if_((wid.x == 0) & (tid == 0)):
            for r in range(rank):
                h[t * rank + r] = hs[r]
